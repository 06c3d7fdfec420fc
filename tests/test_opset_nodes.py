"""Incremental opset conversion (k3opt/modelio/opset_nodes.py): only the nodes whose schema changes go
through onnx's converter; the result equals onnx's whole-model conversion node for node and computes the
same in onnxruntime, in the main graph and in bodies, and the untouched nodes are the originals."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, version_converter

from k3opt.errors import UsageError
from k3opt.modelio import opset as opsets
from k3opt.modelio.opset_nodes import schema_changes
from tests.helpers import make_model

F = TensorProto.FLOAT


def _run(model: onnx.ModelProto, feeds: dict) -> list:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _ops(graph: onnx.GraphProto) -> list[tuple]:
    """(op, attributes, subgraph ops) of each node: what a conversion decides, without generated names."""
    out = []
    for n in graph.node:
        attrs = sorted((a.name, str(helper.get_attribute_value(a))) for a in n.attribute if a.type != a.GRAPH)
        subs = [_ops(a.g) for a in n.attribute if a.type == a.GRAPH]
        out.append((n.op_type, attrs, subs))
    return out


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def reduce_relu_sin(opset: int = 12) -> onnx.ModelProto:
    """ReduceSum (axes attribute until 13, an input from 13), Relu (new schema at 13 and 14), Sin (same
    schema from 7 on), at ``opset``."""
    nodes = [helper.make_node("Sin", ["x"], ["s"], name="sin"),
             helper.make_node("ReduceSum", ["s"], ["r"], axes=[1], keepdims=1, name="reduce"),
             helper.make_node("Relu", ["r"], ["y"], name="relu")]
    return make_model(nodes, [("x", F, [2, 3])], [("y", F, [2, 1])], opset=opset)


X = {"x": np.linspace(-2, 2, 6, dtype=np.float32).reshape(2, 3)}


def test_only_changed_nodes_are_converted_and_the_result_is_onnxs():
    model = reduce_relu_sin()
    sin = _copy(model).graph.node[0]
    reference = version_converter.convert_version(_copy(model), 17)
    out, notes = opsets.convert(model)
    assert notes == ["opset converted from 12 to 17"] and out is model  # in place
    assert [(o.domain, o.version) for o in out.opset_import] == [("", 17)]
    assert _ops(out.graph) == _ops(reference.graph)  # Sin, Constant (axes), ReduceSum, Relu
    assert out.graph.node[0] == sin  # not rewritten
    onnx.checker.check_model(out, full_check=True)
    np.testing.assert_array_equal(_run(out, X)[0], _run(reduce_relu_sin(), X)[0])


def test_when_no_schema_changes_only_the_opset_import_moves():
    model = make_model([helper.make_node("Sin", ["x"], ["y"])], [("x", F, [2, 3])], [("y", F, [2, 3])], opset=14)
    before = _copy(model).graph
    assert not schema_changes("Sin", 14, 17)
    out, _ = opsets.convert(model)
    assert out.graph == before and opsets.model_opset(out) == 17


def test_a_body_of_an_unchanged_node_is_converted_inside_it():
    """Scan has one schema from 11 to 15: it stays, the ReduceSum in its body is converted (11 -> 15)."""
    body = helper.make_graph(
        [helper.make_node("ReduceSum", ["row"], ["r"], axes=[0], keepdims=0),
         helper.make_node("Add", ["acc", "r"], ["acc_out"]), helper.make_node("Identity", ["acc_out"], ["scan_out"])],
        "body", [helper.make_tensor_value_info("acc", F, []), helper.make_tensor_value_info("row", F, [3])],
        [helper.make_tensor_value_info("acc_out", F, []), helper.make_tensor_value_info("scan_out", F, [])])
    scan = helper.make_node("Scan", ["init", "x"], ["total", "partial"], body=body, num_scan_inputs=1)
    model = make_model([scan], [("init", F, []), ("x", F, [2, 3])], [("total", F, []), ("partial", F, [2])], opset=11)
    assert not schema_changes("Scan", 11, 15) and schema_changes("ReduceSum", 11, 15)
    reference = version_converter.convert_version(_copy(model), 15)
    feeds = {"init": np.array(1, np.float32), **X}
    want = _run(model, feeds)
    out, _ = opsets.convert(model, 15)
    assert _ops(out.graph) == _ops(reference.graph)
    onnx.checker.check_model(out, full_check=True)
    for got, expected in zip(_run(out, feeds), want):
        np.testing.assert_array_equal(got, expected)


def test_a_changed_node_with_bodies_is_converted_whole():
    """If changes schema at 13 and 16: it goes to onnx's converter with its branches (ReduceSum inside)."""
    then = helper.make_graph([helper.make_node("ReduceSum", ["x"], ["t"], axes=[1], keepdims=1)], "then", [],
                             [helper.make_tensor_value_info("t", F, [2, 1])])
    other = helper.make_graph([helper.make_node("ReduceMax", ["x"], ["e"], axes=[1], keepdims=1)], "else", [],
                              [helper.make_tensor_value_info("e", F, [2, 1])])
    model = make_model([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
                       [("c", TensorProto.BOOL, []), ("x", F, [2, 3])], [("y", F, [2, 1])], opset=12)
    reference = version_converter.convert_version(_copy(model), 17)
    out, _ = opsets.convert(_copy(model))
    assert _ops(out.graph) == _ops(reference.graph)
    onnx.checker.check_model(out, full_check=True)
    for c in (True, False):
        feeds = {"c": np.array(c), **X}
        np.testing.assert_array_equal(_run(out, feeds)[0], _run(model, feeds)[0])


def test_names_the_converter_makes_up_do_not_clash_with_the_models():
    plain = version_converter.convert_version(reduce_relu_sin(), 17)
    made_up = [o for n in plain.graph.node if n.op_type == "Constant" for o in n.output]
    assert made_up
    # the model already uses the converter's name for something else
    model = reduce_relu_sin()
    model.graph.node.insert(0, helper.make_node("Cos", ["x"], [made_up[0]]))
    model.graph.node.append(helper.make_node("Add", ["y", "y"], ["y2"]))
    model.graph.node[-1].input[1] = made_up[0]
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("y2", F, [2, 3]))
    want = _run(model, X)[0]
    out, notes = opsets.convert(model)
    assert notes == ["opset converted from 12 to 17"]
    onnx.checker.check_model(out, full_check=True)
    np.testing.assert_array_equal(_run(out, X)[0], want)


def test_a_constant_an_adapter_moves_into_an_attribute_is_dropped():
    """Going down, ReduceSum 13 -> 12 takes its axes from the initializer into an attribute."""
    model = make_model([helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=1)], [("x", F, [2, 3])],
                       [("y", F, [2, 1])], {"axes": np.array([1], np.int64)}, opset=13)
    out, _ = opsets.convert(_copy(model), 12)
    assert [n.op_type for n in out.graph.node] == ["ReduceSum"] and not out.graph.initializer
    np.testing.assert_array_equal(_run(out, X)[0], _run(model, X)[0])


def test_a_failed_conversion_leaves_the_model_untouched():
    """A convertible node (Pow 15 -> 13) and one that cannot go down (no LayerNormalization at 13):
    nothing is changed."""
    nodes = [helper.make_node("Pow", ["x", "x"], ["p"]), helper.make_node("LayerNormalization", ["p", "g"], ["y"])]
    model = make_model(nodes, [("x", F, [2, 3])], [("y", F, [2, 3])], {"g": np.ones(3, np.float32)}, opset=17)
    before = _copy(model)
    with pytest.raises(UsageError, match="LayerNormalization"):  # an explicit opset must be reached
        opsets.convert(model, 13)
    assert model == before


@pytest.mark.parametrize("target", [18, 23])
def test_up_from_17_adapters_that_add_nodes_match_onnx(target: int):
    """Reduce axes become an input (a Constant node the adapter adds), Split/Pad/Resize change schema too."""
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], axes=[1], keepdims=1),
             helper.make_node("ReduceMax", ["x"], ["n"], axes=[0], keepdims=0),
             helper.make_node("Split", ["x"], ["a", "b"], axis=1), helper.make_node("Pad", ["x", "p"], ["q"]),
             helper.make_node("Resize", ["x4", "", "sc"], ["r"], mode="nearest")]
    outputs = [("m", F, [3, 1]), ("n", F, [4]), ("a", F, [3, 2]), ("b", F, [3, 2]), ("q", F, [3, 6]),
               ("r", F, [1, 1, 6, 6])]
    model = make_model(nodes, [("x", F, [3, 4]), ("x4", F, [1, 1, 3, 3])], outputs,
                       {"p": np.array([0, 1, 0, 1], np.int64), "sc": np.array([1, 1, 2, 2], np.float32)}, opset=17)
    reference = version_converter.convert_version(_copy(model), target)
    out, _ = opsets.convert(_copy(model), target)
    assert _ops(out.graph) == _ops(reference.graph)
    onnx.checker.check_model(out, full_check=True)
    feeds = {"x": np.arange(12, dtype=np.float32).reshape(3, 4), "x4": np.arange(9, dtype=np.float32).reshape(1, 1, 3, 3)}
    for got, want in zip(_run(out, feeds), _run(model, feeds)):
        np.testing.assert_array_equal(got, want)


def test_validation_says_whether_there_are_bodies_and_a_body_free_model_converts_the_same_unsearched(tmp_path):
    """modelio.validate reports bodies (a Scan's, nested or not); convert(bodies=False), which reads no
    node's attributes, converts a body-free model exactly as the full search does."""
    from k3opt import modelio

    plain = reduce_relu_sin()
    body = helper.make_graph([helper.make_node("Identity", ["row"], ["r"])], "body",
                             [helper.make_tensor_value_info("row", F, [3])],
                             [helper.make_tensor_value_info("r", F, [3])])
    scan = make_model([helper.make_node("Scan", ["x"], ["y"], body=body, num_scan_inputs=1)], [("x", F, [2, 3])],
                      [("y", F, [2, 3])], opset=11)
    assert modelio.validate(_copy(plain), tmp_path).bodies is False
    assert modelio.validate(_copy(scan), tmp_path).bodies is True
    onnx.save(plain, tmp_path / "m.onnx")
    loaded = modelio.read_model(tmp_path / "m.onnx")
    assert loaded.bodies is False
    searched, _ = opsets.convert(_copy(plain))
    unsearched, _ = opsets.convert(loaded.model, bodies=loaded.bodies)
    assert unsearched.SerializeToString() == searched.SerializeToString()
