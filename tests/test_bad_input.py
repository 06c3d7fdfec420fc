"""Every bad input through the CLI: exit 2, one line on stderr, no traceback, input untouched, nothing written."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

from k3opt.cli import main
from tests.helpers import make_model


def good_model() -> onnx.ModelProto:
    w = np.ones((8, 8), dtype=np.float32)
    return make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [("x", TensorProto.FLOAT, [2, 8])],
                      [("y", TensorProto.FLOAT, [2, 8])], {"w": w})


def raw_graph(nodes, inputs=("x",), outputs=("y",)) -> onnx.ModelProto:
    """A model built without the checker (to make invalid graphs)."""
    graph = helper.make_graph(nodes, "bad", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in inputs],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def write_missing_external(folder: Path) -> Path:
    model = good_model()
    onnx.save(model, folder / "m.onnx", save_as_external_data=True, location="m.data", size_threshold=0)
    (folder / "m.data").unlink()
    return folder / "m.onnx"


def _write(folder: Path, name: str, data) -> Path:
    path = folder / name
    if isinstance(data, onnx.ModelProto):
        onnx.save(data, path)
    else:
        path.write_bytes(data)
    return path


def short_raw_data(model: onnx.ModelProto, name: str, cut: int) -> onnx.ModelProto:
    """``model`` with ``cut`` bytes missing from the end of initializer ``name``'s raw_data."""
    t = next(t for t in model.graph.initializer if t.name == name)
    t.raw_data = t.raw_data[:-cut]
    return model


def short_shape_constant() -> onnx.ModelProto:
    """A Reshape whose int64 shape constant holds 12 bytes for its two elements (the shape computations
    decode it: fold-constants, remove-noop-ops)."""
    model = make_model([helper.make_node("Reshape", ["x", "s"], ["y"])], [("x", TensorProto.FLOAT, [2, 8])],
                       [("y", TensorProto.FLOAT, [2, 8])], {"s": np.array([2, 8], np.int64)})
    return short_raw_data(model, "s", 4)


def short_sibling_weight() -> onnx.ModelProto:
    """Q/K/V-like MatMuls reading one activation, one weight 8 bytes short (sibling merge reads the weights)."""
    rng = np.random.default_rng(0)
    weights = {f"w{i}": rng.standard_normal((16, 16)).astype(np.float32) for i in range(3)}
    model = make_model([helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]) for i in range(3)],
                       [("x", TensorProto.FLOAT, [2, 16])], [(f"y{i}", TensorProto.FLOAT, [2, 16]) for i in range(3)],
                       weights)
    return short_raw_data(model, "w1", 8)


BAD_FILES = {
    "short raw_data of a shape constant": (lambda d: _write(d, "m.onnx", short_shape_constant()),
                                           "tensor 's': its data does not fit its type and shape"),
    "short raw_data of a weight": (lambda d: _write(d, "m.onnx", short_sibling_weight()),
                                   "'w1': raw_data size (1016 bytes) does not match"),  # onnxruntime, on the input
    "empty": (lambda d: _write(d, "m.onnx", b""), "file is empty"),
    "random bytes": (lambda d: _write(d, "m.onnx", np.random.default_rng(0).bytes(4096)), "not a"),
    "truncated": (lambda d: _write(d, "m.onnx", good_model().SerializeToString()[:150]), "not a readable ONNX model"),
    "text": (lambda d: _write(d, "m.onnx", b"hello, I am not a model\n"), "not a"),
    "cycle": (lambda d: _write(d, "m.onnx", raw_graph([helper.make_node("Add", ["x", "b"], ["a"], name="n1"),
                                                        helper.make_node("Relu", ["a"], ["b"], name="n2"),
                                                        helper.make_node("Relu", ["a"], ["y"], name="n3")])),
              "has a cycle"),
    "undefined input": (lambda d: _write(d, "m.onnx", raw_graph([helper.make_node("Add", ["x", "ghost"], ["y"],
                                                                                  name="add")])),
                        "input 'ghost' of node 'add' is produced by nothing"),
    "tensor defined twice": (lambda d: _write(d, "m.onnx", raw_graph([helper.make_node("Relu", ["x"], ["y"], name="a"),
                                                                        helper.make_node("Neg", ["x"], ["y"], name="b")])),
                             "tensor 'y' is defined twice (node 'b')"),
    "missing external data": (write_missing_external, "missing external-data file"),
    "directory": (lambda d: d, "is a directory"),
    "missing file": (lambda d: d / "nope.onnx", "no such file"),
}


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}


def invoke(args: list[str]):
    result = CliRunner().invoke(main, args)
    return result.exit_code, result.stdout, result.stderr


def assert_one_line_error(code: int, out: str, err: str, expected_code: int, fragment: str) -> None:
    assert code == expected_code, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("k3opt: error: ") and fragment in lines[0], lines[0]
    assert "Traceback" not in err + out


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_model_file(tmp_path, case):
    make, fragment = BAD_FILES[case]
    target = make(tmp_path)
    before = snapshot(tmp_path)
    code, out, err = invoke(["optimize", str(target), "-q"])
    assert_one_line_error(code, out, err, 2, fragment)
    assert snapshot(tmp_path) == before  # input untouched, no partial output


@pytest.mark.parametrize("args, fragment", [
    (["--passes", "nope"], "unknown pass 'nope'"),
    (["--skip", "fold-constants,nope"], "unknown pass 'nope'"),
    (["--target", "tpu"], "'tpu' is not one of"),
    (["--opset", "0"], "--opset"),
    (["--opset", "seventeen"], "--opset"),
    (["--input-shape", "ghost:1,2"], "'ghost' is not a graph input"),
    (["--input-shape", "x:1,2,3"], "rank 2"),
    (["--input-shape", "x"], "expected NAME:D1,D2"),
    (["--rtol", "-1"], "--rtol"),
    (["--no-such-option"], "No such option"),
    (["-o", "nowhere/out.onnx"], "does not exist"),
    (["--input-data", "missing.npz"], "cannot read input data"),
    (["--plugin", "no_such_plugin_module_xyz"], "no_such_plugin_module_xyz"),
])
def test_bad_options(tmp_path, monkeypatch, args, fragment):
    monkeypatch.chdir(tmp_path)
    onnx.save(good_model(), "m.onnx")
    before = snapshot(tmp_path)
    code, out, err = invoke(["optimize", "m.onnx", *args])
    assert_one_line_error(code, out, err, 2, fragment)
    assert snapshot(tmp_path) == before


def test_output_equal_to_input_is_refused(tmp_path):
    onnx.save(good_model(), tmp_path / "m.onnx")
    before = snapshot(tmp_path)
    code, out, err = invoke(["optimize", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "m.onnx")])
    assert_one_line_error(code, out, err, 2, "--overwrite")
    assert snapshot(tmp_path) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_output_folder(tmp_path):
    onnx.save(good_model(), tmp_path / "m.onnx")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    code, out, err = invoke(["optimize", str(tmp_path / "m.onnx"), "-o", str(locked / "o.onnx")])
    assert_one_line_error(code, out, err, 2, "not writable")


def test_real_process_one_line_and_debug_traceback(tmp_path):
    """Through ``python -m k3opt`` (not CliRunner): exit 2, one line; --debug adds the traceback."""
    (tmp_path / "m.onnx").write_bytes(b"\x00garbage")
    cmd = [sys.executable, "-m", "k3opt", "optimize", str(tmp_path / "m.onnx")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    proc = subprocess.run(cmd + ["--debug"], capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
