"""Opset 18 -> 17 (``--target cann``, ``--opset 17``): every op whose schema differs between 17 and 18
converts exactly (same outputs in onnxruntime, a valid opset-17 model) or stops with one line naming it."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import k3opt
from k3opt.errors import UsageError
from k3opt.modelio import opset as opsets

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def model18(nodes: list, inputs: list, outputs: list, inits: dict = None) -> onnx.ModelProto:
    """A checked opset-18 model."""
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_tensor_value_info(*o) for o in outputs],
                              [onnx.numpy_helper.from_array(np.asarray(v), k) for k, v in (inits or {}).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _run(model: onnx.ModelProto, feeds: dict) -> list:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


X = np.arange(1, 13, dtype=np.float32).reshape(3, 4)
EXACT = {
    "pad with constant axes": model18(
        [helper.make_node("Pad", ["x", "pads", "value", "axes"], ["y"], mode="constant")], [("x", F, [3, 4])],
        [("y", F, [3, 7])], {"pads": np.array([1, 2], np.int64), "value": np.array(5, np.float32),
                             "axes": np.array([-1], np.int64)}),
    "pad without axes": model18(
        [helper.make_node("Pad", ["x", "pads"], ["y"], mode="reflect")], [("x", F, [3, 4])], [("y", F, [5, 4])],
        {"pads": np.array([1, 0, 1, 0], np.int64)}),
    "pad with an empty axes name": model18(
        [helper.make_node("Pad", ["x", "pads", "", ""], ["y"])], [("x", F, [3, 4])], [("y", F, [5, 4])],
        {"pads": np.array([1, 0, 1, 0], np.int64)}),
    "reduce with constant axes": model18(
        [helper.make_node("ReduceMean", ["x", "axes"], ["y"], keepdims=0)], [("x", F, [3, 4])], [("y", F, [3])],
        {"axes": np.array([1], np.int64)}),
    "reduce, noop flag with constant axes": model18(
        [helper.make_node("ReduceL2", ["x", "axes"], ["y"], noop_with_empty_axes=1)], [("x", F, [3, 4])],
        [("y", F, [1, 4])], {"axes": np.array([0], np.int64)}),
    "reduce without axes": model18(
        [helper.make_node("ReduceMax", ["x"], ["y"], keepdims=0)], [("x", F, [3, 4])], [("y", F, [])]),
    "split by num_outputs, even": model18(
        [helper.make_node("Split", ["x"], ["a", "b"], axis=1, num_outputs=2)], [("x", F, [3, 4])],
        [("a", F, [3, 2]), ("b", F, [3, 2])]),
    "split by num_outputs, last smaller": model18(
        [helper.make_node("Split", ["x5"], ["a", "b", "c"], axis=0, num_outputs=3)], [("x5", F, [5, 4])],
        [("a", F, [2, 4]), ("b", F, [2, 4]), ("c", F, [1, 4])]),
    "split by sizes": model18(
        [helper.make_node("Split", ["x", "s"], ["a", "b"], axis=1)], [("x", F, [3, 4])],
        [("a", F, [3, 1]), ("b", F, [3, 3])], {"s": np.array([1, 3], np.int64)}),
    "resize without the new attributes": model18(
        [helper.make_node("Resize", ["x4", "", "scales"], ["y"], mode="nearest")], [("x4", F, [1, 1, 3, 4])],
        [("y", F, [1, 1, 6, 8])], {"scales": np.array([1, 1, 2, 2], np.float32)}),
    "scatter with reduction add": model18(
        [helper.make_node("ScatterElements", ["x", "i", "u"], ["y"], axis=1, reduction="add")],
        [("x", F, [3, 4]), ("u", F, [3, 1])], [("y", F, [3, 4])], {"i": np.array([[1], [0], [3]], np.int64)}),
    "scatternd": model18(
        [helper.make_node("ScatterND", ["x", "i", "row"], ["y"])], [("x", F, [3, 4]), ("row", F, [1, 4])],
        [("y", F, [3, 4])], {"i": np.array([[2]], np.int64)}),
    "lppool without ceil_mode": model18(
        [helper.make_node("LpPool", ["x3"], ["y"], kernel_shape=[2], ceil_mode=0)], [("x3", F, [1, 3, 4])],
        [("y", F, [1, 3, 3])]),
    "optional has element": model18(
        [helper.make_node("Optional", ["x"], ["o"]), helper.make_node("OptionalHasElement", ["o"], ["y"])],
        [("x", F, [3, 4])], [("y", TensorProto.BOOL, [])]),
}
FEEDS = {"x": X, "x4": X.reshape(1, 1, 3, 4), "x3": X.reshape(1, 3, 4), "x5": np.arange(20, dtype=np.float32).reshape(5, 4),
         "u": np.full((3, 1), 10, np.float32), "row": np.ones((1, 4), np.float32)}


@pytest.mark.parametrize("case", EXACT)
def test_converts_to_17_with_the_same_outputs(case: str) -> None:
    model = EXACT[case]
    feeds = {i.name: FEEDS[i.name] for i in model.graph.input}
    out, notes = opsets.convert(_copy(model), 17)
    assert notes == ["opset converted from 18 to 17"]
    onnx.checker.check_model(out, full_check=True)
    assert opsets.model_opset(out) == 17
    for got, want in zip(_run(out, feeds), _run(model, feeds)):
        np.testing.assert_array_equal(got, want)
    used = {i for n in out.graph.node for i in n.input}
    assert all(t.name in used for t in out.graph.initializer), "a constant moved into the node is left behind"


def test_pad_inside_a_branch_converts_too() -> None:
    pad = helper.make_node("Pad", ["x", "pads", "", "axes"], ["t"])
    then = helper.make_graph([pad], "then", [], [helper.make_tensor_value_info("t", F, [3, 6])],
                             [onnx.numpy_helper.from_array(np.array([1, 1], np.int64), "pads"),
                              onnx.numpy_helper.from_array(np.array([1], np.int64), "axes")])
    other = helper.make_graph([helper.make_node("Pad", ["x", "pads2"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", F, [3, 6])],
                              [onnx.numpy_helper.from_array(np.array([0, 2, 0, 0], np.int64), "pads2")])
    model = model18([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
                    [("c", TensorProto.BOOL, []), ("x", F, [3, 4])], [("y", F, [3, 6])])
    out, _ = opsets.convert(_copy(model), 17)
    onnx.checker.check_model(out, full_check=True)
    for c in (True, False):
        feeds = {"c": np.array(c), "x": X}
        np.testing.assert_array_equal(_run(out, feeds)[0], _run(model, feeds)[0])


REFUSED = {
    "pad with computed axes": (model18(
        [helper.make_node("Pad", ["x", "pads", "", "axes"], ["y"], name="pad")], [("x", F, [3, 4]), ("axes", I64, [1])],
        [("y", F, [None, None])], {"pads": np.array([1, 1], np.int64)}),
        "op Pad (node 'pad'): its 'axes' input is computed"),
    "pad of unknown rank": (model18(  # a Reshape to a shape of unknown length: a value of unknown rank
        [helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("Pad", ["r", "pads", "", "axes"], ["y"])],
        [("x", F, [3, 4]), ("shape", I64, ["k"])], [("y", F, [None, None])],
        {"pads": np.array([1, 1], np.int64), "axes": np.array([0], np.int64)}),
        "op Pad: the rank of its input is unknown"),
    "split of a dynamic axis": (model18(
        [helper.make_node("Split", ["x"], ["a", "b"], axis=0, num_outputs=2)], [("x", F, ["n", 4])],
        [("a", F, [None, 4]), ("b", F, [None, 4])]),
        "op Split: num_outputs=2 needs the size of axis 0"),
    "reduce, noop without axes": (model18(
        [helper.make_node("ReduceMean", ["x"], ["y"], noop_with_empty_axes=1)], [("x", F, [3, 4])], [("y", F, [None, None])]),
        "op ReduceMean: noop_with_empty_axes=1 without axes has no opset-17 form"),
    "reduce with computed axes": (model18(
        [helper.make_node("ReduceMean", ["x", "axes"], ["y"])], [("x", F, [3, 4]), ("axes", I64, [1])],
        [("y", F, [None, None])]), "op ReduceMean: its 'axes' input is computed"),
    "resize antialias": (model18(
        [helper.make_node("Resize", ["x", "", "s"], ["y"], mode="linear", antialias=1)], [("x", F, [3, 4])],
        [("y", F, [None, None])], {"s": np.array([1, 0.5], np.float32)}), "op Resize: antialias=1 exists from opset 18 on"),
    "resize axes": (model18(
        [helper.make_node("Resize", ["x", "", "s"], ["y"], axes=[1])], [("x", F, [3, 4])], [("y", F, [None, None])],
        {"s": np.array([2], np.float32)}), "op Resize: axes=[1] exists from opset 18 on"),
    "scatter max": (model18(
        [helper.make_node("ScatterND", ["x", "i", "u"], ["y"], reduction="max")], [("x", F, [3, 4]), ("u", F, [1, 4])],
        [("y", F, [3, 4])], {"i": np.array([[2]], np.int64)}), "op ScatterND: reduction='max' exists from opset 18 on"),
    "lppool ceil": (model18(
        [helper.make_node("LpPool", ["x"], ["y"], kernel_shape=[2], strides=[2], ceil_mode=1)], [("x", F, [1, 3, 5])],
        [("y", F, [1, 3, 3])]), "op LpPool: ceil_mode=1 exists from opset 18 on"),
    "bitwise": (model18([helper.make_node("BitwiseAnd", ["a", "b"], ["y"])],
                        [("a", TensorProto.INT32, [2]), ("b", TensorProto.INT32, [2])], [("y", TensorProto.INT32, [2])]),
                "op BitwiseAnd does not exist at opset 17"),
    "center crop pad": (model18([helper.make_node("CenterCropPad", ["x", "s"], ["y"])], [("x", F, [3, 4])],
                                [("y", F, [None, None])], {"s": np.array([2, 2], np.int64)}),
                        "op CenterCropPad does not exist at opset 17"),
    "col2im": (model18([helper.make_node("Col2Im", ["x", "i", "b"], ["y"])], [("x", F, [1, 4, 4])],
                       [("y", F, [1, 1, 3, 3])], {"i": np.array([3, 3], np.int64), "b": np.array([2, 2], np.int64)}),
               "op Col2Im does not exist at opset 17"),
    "mish": (model18([helper.make_node("Mish", ["x"], ["y"])], [("x", F, [3, 4])], [("y", F, [3, 4])]),
             "op Mish does not exist at opset 17"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_17_cannot_say_stops_with_one_line_naming_the_op(case: str) -> None:
    model, why = REFUSED[case]
    with pytest.raises(UsageError) as err:
        opsets.convert(_copy(model), 17)
    assert str(err.value) == f"cannot convert opset 18 to 17: {why}" or why in str(err.value)
    assert "\n" not in str(err.value) and why in str(err.value)


def test_cann_target_takes_an_opset_18_pad() -> None:
    model = EXACT["pad with constant axes"]
    out = k3opt.optimize(_copy(model), target="cann")
    assert [(o.domain, o.version) for o in out.opset_import] == [("", 17)]
    np.testing.assert_array_equal(_run(out, {"x": X})[0], _run(model, {"x": X})[0])


def test_a_name_two_sibling_bodies_define_is_not_read_as_one_constant():
    """Both If branches define their own Constant 'ax' (ONNX allows it): taking one branch's value for the
    other's ReduceMean would change its output, so the conversion is refused (found in review)."""
    def branch(name: str, axis: int) -> onnx.GraphProto:
        axes = helper.make_node("Constant", [], ["ax"], value=helper.make_tensor("v", TensorProto.INT64, [1], [axis]))
        mean = helper.make_node("ReduceMean", ["x", "ax"], [f"{name}_y"], keepdims=0)
        return helper.make_graph([axes, mean], name, [], [helper.make_tensor_value_info(f"{name}_y", TensorProto.FLOAT,
                                                                                        [None])])

    node = helper.make_node("If", ["cond"], ["y"], then_branch=branch("then", 0), else_branch=branch("else", 1))
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
                                            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model, full_check=True)
    with pytest.raises(UsageError, match="cannot convert opset 18 to 17"):
        opsets.convert(model, 17)
