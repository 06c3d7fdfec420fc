"""CLI commands contributed by k3opt.export; k3opt/cli.py adds every command in ``commands``."""
from __future__ import annotations

import click

commands: list[click.Command] = []
