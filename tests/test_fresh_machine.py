"""What a fresh machine has not got: CI runs the README's own test line, the extras declare what their
features import, a missing optional module is named with what to install, and no test needs a cache folder
that only a developer's home has."""
from __future__ import annotations

import ast
import configparser
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import onnx
import pytest

from k3opt.errors import K3optError
from k3opt.export.exporters import DYNAMO_HINT, explain_failure
from tests.helpers import make_model
from tests.zoo import needs_torch, zoo_config

ROOT = Path(__file__).resolve().parent.parent


def readme_setup_lines() -> list[str]:
    """The command lines of the README's first code block under "## Set-up"."""
    section = (ROOT / "README.md").read_text().split("## Set-up", 1)[1]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_ci_runs_the_readmes_test_line_in_a_fresh_venv() -> None:
    (test_line,) = [line for line in readme_setup_lines() if "pytest" in line]
    script = (ROOT / ".ci" / "run").read_text()
    (ci_line,) = re.findall(r'^TEST_LINE="(.*)"$', script, re.M)
    assert ci_line == test_line
    assert 'bash -c "$TEST_LINE"' in script
    assert "python3 -m venv --clear .ci-venv" in script and ". .ci-venv/bin/activate" in script
    assert script.index("activate") < script.index('bash -c "$TEST_LINE"')
    assert ".ci-venv/" in (ROOT / ".gitignore").read_text().splitlines()


def test_ci_turns_pytests_no_tests_exit_into_a_failure(tmp_path) -> None:
    """pytest's exit 5 (nothing collected) must not pass CI: run .ci/run with stand-ins for python3 and pip."""
    clone = tmp_path / "clone"
    (clone / ".ci").mkdir(parents=True)
    (clone / ".ci" / "run").write_text((ROOT / ".ci" / "run").read_text())
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fakes = {"python3": 'mkdir -p "$4/bin"; echo "" > "$4/bin/activate"',  # python3 -m venv --clear DIR
             "pip": "exit 0", "pytest": "exit $PYTEST_STATUS"}
    for name, body in fakes.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    runs = {status: subprocess.run(["bash", str(clone / ".ci" / "run")], env={**env, "PYTEST_STATUS": str(status)},
                                   capture_output=True, text=True) for status in (0, 1, 5)}
    assert [runs[s].returncode for s in (0, 1, 5)] == [0, 1, 1]
    assert "collected no tests" in runs[5].stderr


def test_export_extra_declares_what_the_dynamo_exporter_imports() -> None:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    export = [r.strip() for r in cfg["options.extras_require"]["export"].splitlines() if r.strip()]
    assert "torch==2.13.0" in export
    assert any(re.fullmatch(r"onnxscript>=[\d.]+", r) for r in export), export


def _extras() -> dict[str, list[str]]:
    """``install_requires`` (as ``""``) and every extra of setup.cfg: distribution names, normalized."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lists = {"": cfg["options"]["install_requires"], **cfg["options.extras_require"]}
    return {k: [_norm(re.match(r"[\w.-]+", r.strip()).group()) for r in v.splitlines()
                if r.strip() and not r.strip().startswith("#")] for k, v in lists.items()}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(names: list[str]) -> set[str]:
    """``names`` and, as far as they are installed, what they require (an installed one brings those)."""
    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [_norm(re.match(r"[\w.-]+", r).group()) for r in reqs if "extra ==" not in r]
    return seen


def _required_imports(files: list[Path]) -> dict[str, str]:
    """Top-level names of third-party modules the files import, each with one file importing it. An import
    inside ``try: ... except ImportError`` is optional and left out."""
    found: dict[str, str] = {}
    local = {"k3opt", "bench", "tests"}
    for path in files:
        tree = ast.parse(path.read_text())
        optional = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try)
                    and any("ImportError" in ast.unparse(h.type or ast.Name("")) for h in t.handlers)
                    for stmt in t.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in optional:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {n.split(".")[0] for n in names} - local - set(sys.stdlib_module_names):
                found.setdefault(top, str(path.relative_to(ROOT)))
    return found


# What each part of the repository may import: install_requires ("") plus the extras its users install.
PARTS = {
    "k3opt (but k3opt.export)": ([p for p in (ROOT / "k3opt").rglob("*.py") if "export" not in p.parts], [""]),
    "k3opt.export": (sorted((ROOT / "k3opt" / "export").glob("*.py")), ["", "export"]),
    "bench (and the tests/zoo.py it runs)": (sorted((ROOT / "bench").glob("*.py")) + [ROOT / "tests" / "zoo.py"],
                                             ["", "bench", "export"]),
    "tests": (sorted((ROOT / "tests").glob("*.py")), ["", "test", "export"]),
    "examples": (sorted((ROOT / "examples").glob("*.py")), ["", "export"]),
}


@pytest.mark.parametrize("part", PARTS)
def test_every_import_is_declared_by_the_extras_its_users_install(part: str) -> None:
    files, extras = PARTS[part]
    declared = _closure([name for extra in extras for name in _extras()[extra]])
    dists = metadata.packages_distributions()
    undeclared = {module: where for module, where in _required_imports(files).items()
                  if not {_norm(d) for d in dists.get(module, [module])} & declared}
    assert not undeclared, f"{part} imports modules that {extras} do not declare: {undeclared}"


@needs_torch
def test_dynamo_export_without_onnxscript_says_what_to_install(tmp_path, monkeypatch) -> None:
    import torch

    from k3opt.export import export_onnx

    monkeypatch.setitem(sys.modules, "onnxscript", None)  # `import onnxscript` now fails as if not installed
    with pytest.raises(K3optError) as info:
        export_onnx(torch.nn.ReLU(), (torch.randn(2),), tmp_path / "m.onnx", input_names=["x"],
                    output_names=["y"], exporter="dynamo")
    assert str(info.value) == DYNAMO_HINT and "pip install 'k3opt[export]'" in DYNAMO_HINT
    assert not (tmp_path / "m.onnx").exists()


@needs_torch
def test_cli_dynamo_export_without_onnxscript_is_one_line(tmp_path) -> None:
    zoo_config("bert").to_json_file(tmp_path / "bert.json")
    code = ("import sys; sys.modules['onnxscript'] = None\n"
            f"from k3opt.cli import main; main(['export', {str(tmp_path / 'bert.json')!r}, '--exporter', 'dynamo'])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "error" in line]  # progress lines may come first
    assert errors == [f"k3opt: error: {DYNAMO_HINT}"] and "Traceback" not in proc.stderr
    assert not list(tmp_path.glob("*.onnx"))


def test_a_module_missing_inside_the_exporter_is_named_with_the_install_line() -> None:
    try:
        try:
            raise ModuleNotFoundError("No module named 'onnx_ir'", name="onnx_ir")
        except ModuleNotFoundError as inner:
            raise RuntimeError("Failed to export the model") from inner
    except RuntimeError as exc:
        line = explain_failure("dynamo", 18, exc)
    assert "module onnx_ir is not installed: pip install 'k3opt[export]'" in line
    assert "try exporter" not in line and "\n" not in line


def test_bench_creates_its_cache_folder_in_an_empty_home(tmp_path) -> None:
    """``python -m bench.run`` on a machine whose home has no ~/.cache at all."""
    home = tmp_path / "home"
    home.mkdir()
    path = tmp_path / "tiny.onnx"
    onnx.save(make_model([onnx.helper.make_node("Relu", ["x"], ["y"])], [("x", onnx.TensorProto.FLOAT, [2])],
                         [("y", onnx.TensorProto.FLOAT, [2])]), str(path))
    env = {k: v for k, v in os.environ.items() if k not in ("K3OPT_BENCH_CACHE", "K3OPT_ZOO_CACHE")}
    env.update(HOME=str(home), PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "bench.run", "--model-file", str(path), "--optimizers", "ort-basic",
                           "--budget", "0.02", "--rounds", "1", "--time-runs", "1", "--out", str(tmp_path / "out")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "out" / "results.json").is_file()
    assert (home / ".cache" / "k3opt-bench").is_dir()
    assert not list((home / ".cache" / "k3opt-bench").iterdir())  # the work folder is removed again


@needs_torch
def test_zoo_creates_its_cache_folder_in_an_empty_home(tmp_path, monkeypatch) -> None:
    from tests import zoo

    monkeypatch.delenv("K3OPT_ZOO_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(zoo, "_export", lambda name, exporter, target: Path(target).write_bytes(b"stand-in"))
    path = zoo.zoo_model("vit", "torchscript")
    assert path.parent == tmp_path / ".cache" / "k3opt-zoo" and path.read_bytes() == b"stand-in"
