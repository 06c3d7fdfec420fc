"""The node protos a shape refresh hands onnx, written directly (gs_export.node_bytes).

``node_bytes`` must give exactly the bytes of gs's ``export_node`` or decline
(None) so that gs exports the node, or raises as it did.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter

from k3opt import modelio
from k3opt.graph.gs_export import node_bytes
from tests.zoo import needs_torch, zoo_model


def gs_bytes(node: gs.Node):
    """gs's export of ``node``, serialized; or the type of what it raised."""
    try:
        return OnnxExporter.export_node(node).SerializeToString()
    except Exception as exc:  # noqa: BLE001 -- the point is which one
        return type(exc)


def lazy_constant() -> gs.Constant:
    return modelio.import_graph(helper.make_model(helper.make_graph(
        [helper.make_node("Constant", [], ["c"], value=onnx.numpy_helper.from_array(np.arange(3, dtype=np.int64)))],
        "g", [], [helper.make_tensor_value_info("c", TensorProto.INT64, [3])]))).nodes[0].attrs["value"]


#: Attribute values gs's export writes (the direct writer must give the same bytes).
WRITTEN = {"int": 3, "negative": -(2**63), "largest": 2**63 - 1, "bool": True, "float": 1.5, "nan": float("nan"),
           "inf": float("-inf"), "tiny": 1e-45, "str": "héllo", "bytes": b"\xff\x00", "long_str": "s" * 300,
           "ints": [1, -2, 2**40], "int_tuple": (4, 5), "floats": [1.5, 2, True], "strs": ["a", b"b", "ü"],
           "numpy_constant": gs.Constant("k", np.ones((2, 2), np.float16)), "lazy_constant": lazy_constant()}
#: Values left to gs: it raises on some, writes others its own way.
LEFT_TO_GS = {"too_big": 2**63, "float_overflow": 1e39, "bool_in_ints": [1, True], "empty": [], "mixed": [1, "a"],
              "numpy_int": np.int64(3), "numpy_float": np.float64(2.5), "surrogate": "\ud800", "dtype": np.float32,
              "list_too_big": [2**64], "subgraph": gs.Graph(name="body"), "variable": gs.Variable("v"),
              "reference": gs.Node.AttributeRef("outer", int)}


def one_node(attrs=None, name="n", domain=None, op="Op", inputs=("x",), outputs=("y",)) -> gs.Node:
    return gs.Node(op, name=name, domain=domain, attrs=dict(attrs or {}),
                   inputs=[gs.Variable(t) for t in inputs], outputs=[gs.Variable(t) for t in outputs])


@pytest.mark.parametrize("key", list(WRITTEN))
def test_plain_attributes_are_written_as_gs_writes_them(key):
    node = one_node({key: WRITTEN[key], "after": 1})
    assert node_bytes(node) is not None and node_bytes(node) == gs_bytes(node)


@pytest.mark.parametrize("key", list(LEFT_TO_GS))
def test_other_attributes_are_left_to_gs(key):
    assert node_bytes(one_node({key: LEFT_TO_GS[key]})) is None


@pytest.mark.parametrize("fields", [dict(name=""), dict(name="", domain=""), dict(domain="com.example"),
                                    dict(name="ñ" * 100, inputs=("", "b" * 200), outputs=("y", "z")),
                                    dict(inputs=(), outputs=()), dict(op="")], ids=str)
def test_names_domains_and_edges_are_written_as_gs_writes_them(fields):
    node = one_node({"axis": -1}, **fields)
    assert node_bytes(node) == gs_bytes(node)


def test_what_protobuf_refuses_in_names_is_left_to_gs():
    assert node_bytes(one_node(name="\ud800")) is None and gs_bytes(one_node(name="\ud800")) is UnicodeEncodeError
    assert node_bytes(one_node(domain=b"bytes")) is None


@needs_torch
@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_every_zoo_node_is_written_as_gs_writes_it(name):
    graph = modelio.import_graph(onnx.load(zoo_model(name)))
    written = [node_bytes(n) for n in graph.nodes]
    assert all(w is not None for w in written)
    assert written == [gs_bytes(n) for n in graph.nodes]
