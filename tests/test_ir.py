"""k3opt.ir helpers: constants are read without being cached in the graph."""
from __future__ import annotations

import onnx_graphsurgeon as gs
from onnx import TensorProto as T, helper

from k3opt import ir

F = T.FLOAT


def _int4_model():
    w = helper.make_tensor("w", T.INT4, [4], [1, -2, 3, -8])
    scale = helper.make_tensor("scale", F, [], [0.5])
    nodes = [helper.make_node("Constant", [], ["s"], value_strings=["a", "b"]),
             helper.make_node("DequantizeLinear", ["w", "scale"], ["d"]), helper.make_node("Add", ["x", "d"], ["y"])]
    graph = helper.make_graph(nodes, "t", [helper.make_tensor_value_info("x", F, [4])],
                              [helper.make_tensor_value_info("y", F, [4])], [w, scale])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), w


def test_const_value_does_not_cache_and_export_keeps_the_proto():
    """gs.Constant.values keeps the loaded array and gs then re-encodes it from numpy on
    export (4-bit types and strings break, weights stay in memory)."""
    model, w = _int4_model()
    graph = gs.import_onnx(model)
    t = graph.tensors()["w"]
    assert ir.const_value(t).tolist() == [1, -2, 3, -8]
    assert isinstance(t._values, gs.ir.tensor.LazyValues)
    exported = {i.name: i for i in gs.export_onnx(graph).graph.initializer}
    assert exported["w"] == w


def test_const_value_of_constant_nodes():
    model, _ = _int4_model()
    graph = gs.import_onnx(model)
    assert ir.const_value(graph.tensors()["s"]).tolist() == ["a", "b"]
    assert tuple(ir.const_tensor(graph.tensors()["s"]).shape) == (2,)
    assert ir.const_value(graph.tensors()["x"]) is None and ir.const_tensor(graph.tensors()["y"]) is None
