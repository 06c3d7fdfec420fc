"""CLI commands contributed by k3opt.cann_bridge; k3opt/cli.py adds every command in ``commands``."""
from __future__ import annotations

import click

commands: list[click.Command] = []
