"""Every fenced code block in README.md and docs/**/*.md runs (the convention: docs/writing-rules.md, last section).

- Every fence names its language. ``python`` blocks of one page run in order in one fresh interpreter (a
  page's blocks build on each other), ``sh``/``shell``/``bash`` blocks each in ``bash -e``; any other
  language (``text`` for diagrams and sample output, ``ini``, ``json``...) is not run. An unlabelled fence
  fails the test: label it.
- ``<!-- no-run: reason -->`` on the line before a fence skips that block (a placeholder only the reader
  can fill in, an hour-long benchmark); ``<!-- slow -->`` marks a block that takes more than a few seconds.
- Blocks run in a fresh folder holding ``model.onnx`` (the bundled example model), ``examples/`` (that
  model and the example plugin) and an empty ``out/``, with this checkout first on PYTHONPATH, ``k3opt`` and
  ``python`` meaning this interpreter, a stand-in ``atc`` (tests/fake_atc.py) on PATH, and ``pip``,
  ``pytest`` and sourcing CANN's ``set_env.sh`` doing nothing (the suite runs installed, and is not rerun).
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from tests.fake_atc import write_fake_atc

ROOT = Path(__file__).resolve().parent.parent
RUN_AS = {"python": "python", "py": "python", "sh": "sh", "shell": "sh", "bash": "sh"}
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<info>.*)$")
MARKER = re.compile(r"^\s*<!--\s*(?P<kind>no-run|slow)\s*(?::\s*(?P<reason>.*?))?\s*-->\s*$")
SHELL_PRELUDE = """\
set -e -o pipefail
pip() { :; }
pytest() { :; }
source() { case "$1" in */set_env.sh) ;; *) builtin source "$@" ;; esac; }
"""


@dataclasses.dataclass
class Block:
    """One fenced block: where it is, its language, its code (dedented), and the marker before it."""

    page: str
    line: int
    lang: str
    code: str
    no_run: Optional[str] = None
    slow: bool = False

    @property
    def label(self) -> str:
        return f"{self.page}:{self.line}"


def doc_pages() -> list[Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def blocks_of(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown page, with the ``no-run``/``slow`` marker on the line before each."""
    page = str(path.relative_to(ROOT))
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        end = next((j for j in range(i + 1, len(lines))
                    if lines[j].strip().startswith(fence[0] * len(fence)) and not lines[j].strip().strip(fence[0])),
                   len(lines))
        body = "\n".join(line[min(indent, len(line) - len(line.lstrip(" "))):] for line in lines[i + 1:end])
        block = Block(page, i + 1, opening["info"].strip().split(" ")[0].lower(), body + "\n")
        marker = MARKER.match(lines[i - 1]) if i else None
        if marker:
            block.no_run = (marker["reason"] or "no reason given") if marker["kind"] == "no-run" else None
            block.slow = marker["kind"] == "slow"
        found.append(block)
        i = end + 1
    return found


ALL = [b for page in doc_pages() for b in blocks_of(page)]
SHELL = [b for b in ALL if RUN_AS.get(b.lang) == "sh"]
PYTHON_PAGES = sorted({b.page for b in ALL if RUN_AS.get(b.lang) == "python"})


def _param(block_or_page, slow: bool):
    label = block_or_page.label if isinstance(block_or_page, Block) else block_or_page
    return pytest.param(block_or_page, id=label, marks=[pytest.mark.slow] if slow else [])


@pytest.fixture
def sandbox(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """The folder and environment the blocks run in (see the module docstring)."""
    bin_dir = tmp_path / "bin"
    write_fake_atc(bin_dir)
    for name, command in (("k3opt", f'"{sys.executable}" -m k3opt'), ("python", f'"{sys.executable}"')):
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec {command} "$@"\n')
        shim.chmod(0o755)
    work = tmp_path / "work"
    (work / "examples").mkdir(parents=True)
    (work / "out").mkdir()
    shutil.copy(ROOT / "examples" / "tiny_transformer.onnx", work / "model.onnx")
    shutil.copy(ROOT / "examples" / "tiny_transformer.onnx", work / "examples")
    shutil.copytree(ROOT / "examples" / "plugin_example", work / "examples" / "plugin_example")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_ATC", "ASCEND_", "K3OPT_"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(ROOT), HOME=str(tmp_path),
               K3OPT_NO_ENTRY_POINTS="1")
    return work, env


def _check(proc: subprocess.CompletedProcess, what: str) -> None:
    if proc.returncode != 0:
        pytest.fail(f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def test_every_fence_names_its_language():
    unlabelled = [b.label for b in ALL if not b.lang]
    assert not unlabelled, f"label these fences (python, sh, or text for diagrams and output): {unlabelled}"


def test_markers_give_reasons_and_precede_runnable_blocks():
    for b in ALL:
        if b.no_run is not None:
            assert b.no_run != "no reason given", f"{b.label}: say why after no-run:"
            assert b.lang in RUN_AS, f"{b.label}: no-run on a block that is not run anyway ({b.lang})"


@pytest.mark.parametrize("block", [_param(b, b.slow) for b in SHELL])
def test_shell_block_runs(block: Block, sandbox):
    if block.no_run:
        pytest.skip(f"no-run: {block.no_run}")
    work, env = sandbox
    proc = subprocess.run(["bash", "-c", SHELL_PRELUDE + block.code], cwd=work, env=env, capture_output=True,
                          text=True, timeout=600)
    _check(proc, f"shell block {block.label}")


_DRIVER = """\
import sys, traceback
namespace = {"__name__": "__main__"}
for label, code in BLOCKS:
    try:
        exec(compile(code, label, "exec"), namespace)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            print(f"block {label}: SystemExit({exc.code})", file=sys.stderr)
            sys.exit(1)
    except BaseException:
        print(f"block {label} raised:", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
"""


@pytest.mark.parametrize("page", [_param(p, any(b.slow for b in ALL if b.page == p)) for p in PYTHON_PAGES])
def test_python_blocks_of_a_page_run(page: str, sandbox):
    blocks = [b for b in ALL if b.page == page and RUN_AS.get(b.lang) == "python" and not b.no_run]
    if not blocks:
        pytest.skip("every python block of the page is no-run")
    work, env = sandbox
    script = work / "doc_blocks.py"
    script.write_text(f"BLOCKS = {[(b.label, b.code) for b in blocks]!r}\n" + _DRIVER)
    proc = subprocess.run([sys.executable, str(script)], cwd=work, env=env, capture_output=True, text=True,
                          timeout=600)
    _check(proc, f"python blocks of {page}")


def test_the_extractor_sees_markers_indented_fences_and_unlabelled_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    page = tmp_path / "p.md"
    page.write_text("intro\n\n<!-- no-run: placeholder -->\n```sh\nk3opt optimize my.onnx\n```\n\n"
                    "- item:\n\n  ```python\n  x = 1\n  ```\n\n<!-- slow -->\n```bash\necho hi\n```\n\n```\nplain\n```\n")
    found = blocks_of(page)
    assert [(b.line, b.lang, b.code, b.no_run, b.slow) for b in found] == [
        (4, "sh", "k3opt optimize my.onnx\n", "placeholder", False),
        (10, "python", "x = 1\n", None, False),
        (15, "bash", "echo hi\n", None, True),
        (19, "", "plain\n", None, False),
    ]
