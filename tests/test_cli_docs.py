"""Every option of every ``k3opt`` command is documented: in docs/cli.md or in the command's own page."""
from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from k3opt.cli import main

DOCS = Path(__file__).resolve().parent.parent / "docs"
#: The page that documents a command besides docs/cli.md.
PAGES = {"check": "cann.md", "compile": "cann.md", "export": "export.md", "generate": "llm.md", "llm": "llm.md",
         "quantize": "quantize.md", "split": "split.md"}


def _commands() -> list[str]:
    return main.list_commands(click.Context(main))


def test_every_command_is_in_the_cli_table() -> None:
    table = (DOCS / "cli.md").read_text().split("\n## ")[0]
    assert [c for c in _commands() if f"`k3opt {c}" not in table] == []


@pytest.mark.parametrize("name", _commands())
def test_every_option_is_documented(name: str) -> None:
    command = main.get_command(click.Context(main), name)
    text = (DOCS / "cli.md").read_text() + ((DOCS / PAGES[name]).read_text() if name in PAGES else "")
    missing = []
    for param in command.params:
        if isinstance(param, click.Option) and not param.hidden:
            spellings = param.opts + param.secondary_opts
            if not any(re.search(rf"(?<![\w-]){re.escape(s)}(?![\w-])", text) for s in spellings):
                missing.append("/".join(spellings))
    assert missing == [], f"k3opt {name}: options in no doc page: {missing}"
