"""Every built-in pass has its page in docs/passes/ and its line in docs/passes.md, in the right table and order."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from k3opt.plugins import registered_passes

DOCS = Path(__file__).resolve().parent.parent / "docs"
_ROW = re.compile(r"^\| (\d+(?:\.\d+)?) \| \[([a-z0-9-]+)\]\(passes/([a-z0-9-]+)\.md\) \|", re.M)


def _builtins() -> dict[str, type]:
    return {name: cls for name, cls in registered_passes().items() if cls.plugin is None}


def _tables() -> tuple[dict[str, float], dict[str, float]]:
    """The passes.md rows, ``name -> order``: the default pipeline's table and the lowerings' table."""
    text = (DOCS / "passes.md").read_text()
    head, _, lowerings = text.partition("Target lowerings")
    rows = []
    for part in (head, lowerings):
        found = {}
        for order, name, page in _ROW.findall(part):
            assert name == page, f"passes.md links {name} to passes/{page}.md"
            found[name] = float(order)
        rows.append(found)
    return rows[0], rows[1]


@pytest.mark.parametrize("name", sorted(_builtins()))
def test_every_pass_has_its_page(name: str) -> None:
    cls = _builtins()[name]
    page = DOCS / "passes" / f"{name}.md"
    assert page.exists(), f"docs/passes/{name}.md is missing"
    title = page.read_text().splitlines()[0]
    order = int(cls.order) if cls.order == int(cls.order) else cls.order
    assert title.startswith(f"# {name} (order {order}"), f"{page.name}: title {title!r} should name its order {order}"


def test_every_pass_has_its_line_in_passes_md_in_its_table() -> None:
    passes, lowerings = _tables()
    for name, cls in _builtins().items():
        table = lowerings if cls.lowering else passes
        assert name in table, f"docs/passes.md has no line for {name} in the {'lowerings' if cls.lowering else 'passes'} table"
        assert table[name] == cls.order, f"docs/passes.md gives {name} order {table[name]:g}, the pass says {cls.order:g}"
    assert set(passes) | set(lowerings) <= set(_builtins()), "docs/passes.md lists a pass that does not exist"
    assert list(passes.values()) == sorted(passes.values()) and list(lowerings.values()) == sorted(lowerings.values())


def test_no_page_without_a_pass() -> None:
    pages = {p.stem for p in (DOCS / "passes").glob("*.md")}
    assert pages <= set(_builtins()), f"pages of no pass: {sorted(pages - set(_builtins()))}"
