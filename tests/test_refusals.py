"""Issue #26 items 4-7: the input is blamed when it is at fault, a verification that cannot run writes
nothing, and every option value is parsed and range-checked up front (exit 2, one line).

Each case: the exit code, one line on stderr with the fragment, no traceback, the folder unchanged.
"""
from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import k3opt
from k3opt.pipeline import option_values, verify
from tests.helpers import make_model
from tests.test_bad_input import assert_one_line_error, good_model, invoke, snapshot


def unchecked(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_tensor_value_info(*o) for o in outputs], list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def mixed_types() -> onnx.ModelProto:
    """Add(float, int64): onnx's loader takes it, onnxruntime's type check does not."""
    return unchecked([helper.make_node("Add", ["x", "i"], ["y"])],
                     [("x", TensorProto.FLOAT, [2]), ("i", TensorProto.INT64, [2])], [("y", TensorProto.FLOAT, [2])])


def impossible_reshape() -> onnx.ModelProto:
    """Reshape of 6 elements to 4x4: loads, but onnxruntime cannot run it."""
    return unchecked([helper.make_node("Reshape", ["x", "s"], ["y"])], [("x", TensorProto.FLOAT, [2, 3])],
                     [("y", TensorProto.FLOAT, None)], [helper.make_tensor("s", TensorProto.INT64, [2], [4, 4])])


def concat_without_axis() -> onnx.ModelProto:
    """Concat with no ``axis`` (required): onnx's checker and onnxruntime refuse it."""
    return unchecked([helper.make_node("Concat", ["x", "x"], ["y"])], [("x", TensorProto.FLOAT, [2])],
                     [("y", TensorProto.FLOAT, [4])])


def symbolic_model() -> onnx.ModelProto:
    nodes = [helper.make_node("Add", ["a", "b"], ["y"])]
    return make_model(nodes, [("a", TensorProto.FLOAT, ["batch", "seq"]), ("b", TensorProto.FLOAT, ["batch", "seq"])],
                      [("y", TensorProto.FLOAT, ["batch", "seq"])])


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    onnx.save(good_model(), "m.onnx")
    onnx.save(mixed_types(), "mixed.onnx")
    onnx.save(symbolic_model(), "sym.onnx")
    onnx.save(concat_without_axis(), "concat.onnx")
    np.savez("wrong_shape.npz", x=np.ones((3, 3), np.float32))
    np.savez("strings.npz", x=np.array(["a"] * 16).reshape(2, 8))
    np.save("one.npy", np.ones((2, 8), np.float32))
    (tmp_path / "not_zip.npz").write_bytes(b"PK\x03\x04 this is no zip file")
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(0)\n")
    return tmp_path


CASES = [
    # item 4: the input is at fault, not the optimized model
    (["mixed.onnx"], "the input mixed.onnx does not load in onnxruntime: "),
    (["mixed.onnx", "--no-verify"], "the input mixed.onnx does not load in onnxruntime: "),
    # item 8: invalid inputs refused, verified or not
    (["concat.onnx"], "Required attribute 'axis' is missing"),
    (["concat.onnx", "--no-verify"], "Required attribute 'axis' is missing"),
    (["concat.onnx", "--no-verify", "--passes", "fold-constants"], "Required attribute 'axis' is missing"),
    (["sym.onnx", "--input-shape", "a:1,128", "--input-shape", "a:1,64"], "'a' given twice, as 1,128 and 1,64"),
    (["sym.onnx", "--input-shape", "a:1,128", "--input-shape", "b:1,64"],
     "dimension 'seq' is 128 for 'a' but 64 for 'b'"),
    (["m.onnx", "--input-shape", "x:2,99999999999999999999"], "positive int64"),
    # item 5: verification that cannot run writes nothing
    (["m.onnx", "--input-data", "not_zip.npz"], "File is not a zip file"),
    (["m.onnx", "--input-data", "wrong_shape.npz"], "'x' has shape [3, 3], the graph input takes [2, 8]"),
    (["m.onnx", "--input-data", "strings.npz"], "'x' cannot be float32"),
    (["m.onnx", "--input-data", "one.npy"], "one array (.npy)"),
    # item 6: option values
    (["m.onnx", "--pass-option", "fold_max_bytes=-5"], "fold_max_bytes=-5: expected a number of bytes"),
    (["m.onnx", "--pass-option", "fold_max_bytes=abc"], "fold_max_bytes=abc: expected a number of bytes"),
    (["m.onnx", "--pass-option", "fold_max_elements=1.5"], "expected a count"),
    (["m.onnx", "--pass-option", "cse_max_const_bytes=1e400"], "cse_max_const_bytes=1e400"),
    (["m.onnx", "--pass-option", "matmul_add_nd=sideways"], "expected one of auto, flatten, keep"),
    (["m.onnx", "--pass-option", "matmul_add_nd=yes"], "expected one of auto, flatten, keep"),
    (["m.onnx", "--pass-option", "npu_attention_form=fast"], "expected one of auto, opset16, npu"),
    (["m.onnx", "--rtol", "nan"], "not a finite number"),
    (["m.onnx", "--atol", "inf"], "not a finite number"),
    (["m.onnx", "--opset", "2147483648"], "range 7<=x<="),
    (["m.onnx", "--opset", "99"], "range 7<=x<="),
    (["m.onnx", "--opset", "1"], "range 7<=x<="),
    # item 7
    (["m.onnx", "--plugin", "exits.py"], "plugin 'exits' failed to load: SystemExit: 0"),
]


@pytest.mark.parametrize("args, fragment", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_refused_in_one_line_with_nothing_written(folder, args, fragment):
    before = snapshot(folder)
    code, out, err = invoke(["optimize", *args[:1], "o.onnx", *args[1:]])
    assert_one_line_error(code, out, err, 2, fragment)
    assert snapshot(folder) == before


@pytest.mark.parametrize("value", ["1MiB", "1 MiB", "1048576", "1024KiB", "1MB"])
def test_the_displayed_size_form_is_accepted(folder, value):
    code, out, err = invoke(["optimize", "m.onnx", "o.onnx", "-q", "--pass-option", f"fold_max_bytes={value}"])
    assert code == 0, err


def test_parsers_give_the_passes_numbers():
    assert option_values.byte_size("1MiB") == option_values.byte_size(1 << 20) == 1 << 20
    assert option_values.byte_size("1MB") == 10**6 and option_values.count("64Ki") == 65536
    assert option_values.choice("a", "b")("b") == "b"
    for bad in (-1, "1.5", True, float("nan"), "2 apples", 2**63):
        with pytest.raises(ValueError):
            option_values.byte_size(bad)


def test_out_of_memory_in_onnxruntime_writes_nothing(folder, monkeypatch):
    """ORT failing to allocate while running the original: not a skipped verification with exit 0."""
    def no_memory(sess, feeds):
        raise RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Failed to allocate memory for 4096 bytes")

    from k3opt.pipeline import run

    monkeypatch.setattr(run, "_ORT", run._ORT._replace(run=no_memory))  # what verification runs models with
    before = snapshot(folder)
    code, out, err = invoke(["optimize", "m.onnx", "o.onnx", "-q"])
    assert code != 0 and "--no-verify" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1
    assert snapshot(folder) == before


def test_library_refuses_an_opset_out_of_range():
    for opset in (1, 99, 2**31):
        with pytest.raises(k3opt.UsageError, match="choose an opset from 7 to"):
            k3opt.optimize(good_model(), opset=opset)


def test_library_gets_parsed_option_values():
    with pytest.raises(k3opt.UsageError, match="fold_max_bytes=-5"):
        k3opt.optimize(good_model(), fold_max_bytes=-5)
    k3opt.optimize(good_model(), fold_max_bytes="2MiB")


# item 8: wrong results caught only by verification, or not at all


def test_a_graph_output_listed_twice_survives_fuse_matmul_add(tmp_path):
    w = onnx.numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    b = onnx.numpy_helper.from_array(np.arange(4, dtype=np.float32), "b")
    model = unchecked([helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])],
                      [("x", TensorProto.FLOAT, [2, 4])], [("y", TensorProto.FLOAT, [2, 4])] * 2, [w, b])
    out = k3opt.optimize(model, verify=True)
    assert [o.name for o in out.graph.output] == ["y", "y"]
    assert [n.op_type for n in out.graph.node] == ["Gemm"] and list(out.graph.node[0].output) == ["y"]


def test_duplicate_initializer_names_are_refused(folder):
    b = onnx.numpy_helper.from_array(np.ones(4, np.float32), "b")
    onnx.save(unchecked([helper.make_node("Add", ["x", "b"], ["y"])], [("x", TensorProto.FLOAT, [4])],
                        [("y", TensorProto.FLOAT, [4])], [b, onnx.numpy_helper.from_array(np.zeros(4, np.float32), "b")]),
              "dup.onnx")
    before = snapshot(folder)
    code, out, err = invoke(["optimize", "dup.onnx", "o.onnx", "--no-verify"])
    assert_one_line_error(code, out, err, 2, "initializer 'b' is defined twice")
    assert snapshot(folder) == before


def gather_out_of_range() -> onnx.ModelProto:
    """Gather of index 7 from 3 rows: loads, but onnxruntime cannot run it."""
    return unchecked([helper.make_node("Gather", ["d", "i"], ["y"], name="pick")], [("d", TensorProto.FLOAT, [3])],
                     [("y", TensorProto.FLOAT, [1])], [onnx.numpy_helper.from_array(np.array([7]), "i")])


def computed_out_of_range() -> onnx.ModelProto:
    """The index of :func:`gather_out_of_range` computed (5 + 2): no constant to check before running it."""
    nodes = [helper.make_node("Add", ["a", "b"], ["i"]), helper.make_node("Gather", ["d", "i"], ["y"])]
    return unchecked(nodes, [("d", TensorProto.FLOAT, [3])], [("y", TensorProto.FLOAT, [1])],
                     [onnx.numpy_helper.from_array(np.array([5]), "a"), onnx.numpy_helper.from_array(np.array([2]), "b")])


@pytest.mark.parametrize("flags", [[], ["--no-verify"], ["--passes", "fold-constants", "--no-verify"]])
@pytest.mark.parametrize("model, fragment", [
    (gather_out_of_range, "Gather node 'pick' cannot run: index 7 is out of range for axis 0 of size 3 (valid: -3 to 2)"),
    (impossible_reshape, "Reshape node 'y' cannot run: input [2, 3] has 6 elements, target shape [4, 4] takes 16"),
])
def test_nodes_that_cannot_run_are_refused_before_any_pass(folder, model, fragment, flags):
    """Item 8: found on static shapes and constants, with or without verification, whatever passes run."""
    onnx.save(model(), "bad.onnx")
    before = snapshot(folder)
    code, out, err = invoke(["optimize", "bad.onnx", "o.onnx", *flags])
    assert_one_line_error(code, out, err, 2, f"bad.onnx: {fragment}")
    assert snapshot(folder) == before


def reshape_to(target: list[int], allowzero: int = 0, opset: int = 17) -> onnx.ModelProto:
    shape = helper.make_tensor("s", TensorProto.INT64, [len(target)], target)
    model = unchecked([helper.make_node("Reshape", ["x", "s"], ["y"], allowzero=allowzero)],
                      [("x", TensorProto.FLOAT, [2, 3, 4])], [("y", TensorProto.FLOAT, None)], [shape])
    model.opset_import[0].version = opset
    return model


@pytest.mark.parametrize("target, allowzero", [([4, -1], 0), ([0, 12], 0), ([0, 0, -1], 0), ([24], 0), ([-1], 0),
                                               ([2, 3, 4], 1), ([6, 1, 4], 0), ([0, 0, 0, 1], 0)])
def test_reshapes_onnxruntime_runs_are_kept(target, allowzero):
    out = k3opt.optimize(reshape_to(target, allowzero), verify=True)
    assert out.graph.output[0].name == "y"


@pytest.mark.parametrize("target, allowzero, why", [
    ([5, -1], 0, "24 elements, not a multiple of the 5"),
    ([-1, -1], 0, "more than one -1"),
    ([2, -3, 4], 0, "negative size other than -1"),
    ([1, 0, 0, 0], 0, "copies (0) a dim of input [2, 3, 4], which has only 3"),
    ([0, 24], 1, "takes 0"),
    ([2, 3, 5], 0, "takes 30"),
])
def test_reshapes_onnxruntime_refuses_are_refused(target, allowzero, why):
    model = reshape_to(target, allowzero)
    with pytest.raises(Exception):  # onnxruntime agrees: the original cannot run
        verify.run(verify.session(model), {"x": np.ones((2, 3, 4), np.float32)})
    with pytest.raises(k3opt.InputError, match=re.escape(why)):
        k3opt.optimize(model)


@pytest.mark.parametrize("indices, axis", [([-3, 2, 0], 0), ([[1, -1]], 1), ([], 0)])
def test_gathers_in_range_are_kept(indices, axis):
    table = onnx.numpy_helper.from_array(np.arange(9, dtype=np.float32).reshape(3, 3), "t")
    model = unchecked([helper.make_node("Gather", ["t", "i"], ["g"], axis=axis), helper.make_node("Add", ["g", "x"], ["y"])],
                      [("x", TensorProto.FLOAT, [1])], [("y", TensorProto.FLOAT, None)],
                      [table, onnx.numpy_helper.from_array(np.array(indices, np.int64), "i")])
    k3opt.optimize(model, verify=True)


def test_an_input_onnxruntime_cannot_run_is_refused_not_written_unverified(folder):
    """A fault no static check proves (a computed index) is onnxruntime's to find: verification cannot run."""
    onnx.save(computed_out_of_range(), "bad.onnx")
    before = snapshot(folder)
    code, out, err = invoke(["optimize", "bad.onnx", "o.onnx"])
    assert_one_line_error(code, out, err, 2, "indices element out of data bounds")
    assert "--no-verify" in err
    assert snapshot(folder) == before


def test_infinities_and_nans_compare_without_warnings(recwarn):
    a = np.array([np.inf, -np.inf, np.nan, 1.0], np.float16)
    result = verify.compare([a], [a.copy()], ["y"])
    assert result["status"] == "passed" and not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
    assert verify.compare([a], [np.array([-np.inf, -np.inf, np.nan, 1.0], np.float16)], ["y"])["status"] == "failed"
