"""Saving a model a piece at a time writes exactly ``SerializeToString()``'s bytes (modelio.save, modelio.inline_size)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from k3opt import modelio


def busy_model() -> onnx.ModelProto:
    """A model setting every kind of field around the graph and its initializers."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((32, 32)).astype(np.float32), "w"),
             helper.make_tensor("b", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0]),  # float_data, not raw
             helper.make_tensor("e", TensorProto.INT64, [0], [])]
    sparse = helper.make_sparse_tensor(helper.make_tensor("sv", TensorProto.FLOAT, [1], [5.0]),
                                       helper.make_tensor("si", TensorProto.INT64, [1], [2]), [4])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"], name="mm", doc_string="n"),
             helper.make_node("Add", ["mm", "b"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 32])], inits,
                              doc_string="graph doc",
                              value_info=[helper.make_tensor_value_info("mm", TensorProto.FLOAT, ["n", 32])],
                              sparse_initializer=[sparse])
    graph.quantization_annotation.add(tensor_name="mm")
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="p",
                              doc_string="model doc", model_version=3, domain="d")
    helper.set_model_props(model, {"k": "v"})
    model.functions.add(name="f", domain="local")
    return model


def with_unknown_field(message) -> None:
    """Give ``message`` field 999 (a varint 1), which no onnx message has: protobuf keeps it as unknown."""
    message.MergeFromString(bytes([0xB8, 0x3E, 1]))  # key: 999 << 3 | 0 as a varint


def saved_bytes(model: onnx.ModelProto, tmp_path) -> bytes:
    modelio.save(model, tmp_path / "o.onnx", external_data=False)
    return (tmp_path / "o.onnx").read_bytes()


@pytest.mark.parametrize("unknown", [None, "model", "graph", "tensor"])
def test_pieces_join_into_the_whole_serialization(tmp_path, unknown):
    model = busy_model()
    target = {"model": model, "graph": model.graph, "tensor": model.graph.initializer[0], None: None}[unknown]
    if target is not None:
        with_unknown_field(target)
    whole = model.SerializeToString()
    assert saved_bytes(model, tmp_path) == whole
    assert modelio.inline_size(model) == len(whole) == modelio.proto_size(model)


def test_big_graph_length_prefix(tmp_path):
    """A graph over 2 MB: its length takes four varint bytes."""
    model = busy_model()
    model.graph.initializer.append(numpy_helper.from_array(np.ones((600, 1000), np.float32), "big"))
    assert saved_bytes(model, tmp_path) == model.SerializeToString()


def test_model_without_graph_or_initializers(tmp_path):
    model = busy_model()
    del model.graph.initializer[:]
    assert saved_bytes(model, tmp_path) == model.SerializeToString()
    empty = onnx.ModelProto(ir_version=8)
    assert modelio.inline_size(empty) == empty.ByteSize()
