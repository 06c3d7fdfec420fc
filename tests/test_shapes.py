"""Shape refreshes: reusing the protos of unchanged nodes, seeding from the imported model."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
from onnx import TensorProto, helper

from k3opt import io
from k3opt.shapes import ShapeRefresher
from tests.helpers import make_model


def transpose_reshape():
    """x[2,3,4] -> Transpose(perm) -> Reshape(to) -> Relu -> ReduceSum (all axes) -> y[]."""
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1], name="tr"),
             helper.make_node("Reshape", ["t", "to"], ["r"], name="rs"),
             helper.make_node("Relu", ["r"], ["q"], name="relu"),
             helper.make_node("ReduceSum", ["q"], ["y"], keepdims=0, name="sum")]
    return make_model(nodes, [("x", TensorProto.FLOAT, [2, 3, 4])], [("y", TensorProto.FLOAT, [])],
                      {"to": np.array([8, 3], np.int64)})


def shapes_of(graph: gs.Graph) -> dict:
    return {name: t.shape for name, t in graph.tensors().items() if isinstance(t, gs.Variable)}


def test_a_refresh_exports_only_what_changed_and_sees_every_change():
    graph = io.import_graph(transpose_reshape())
    refresh = ShapeRefresher()
    assert refresh(graph) and refresh.protos.exported == 5  # 4 nodes + the Reshape target
    assert shapes_of(graph)["t"] == [2, 4, 3] and shapes_of(graph)["q"] == [8, 3]
    assert refresh(graph) and refresh.protos.exported == 0

    nodes = {n.name: n for n in graph.nodes}
    nodes["tr"].attrs["perm"] = [1, 0, 2]  # an attribute
    assert refresh(graph) and refresh.protos.exported == 1 and shapes_of(graph)["t"] == [3, 2, 4]
    to = nodes["rs"].inputs[1]
    to.values = np.array([4, 6], np.int64)  # a constant's values
    assert refresh(graph) and refresh.protos.exported == 1 and shapes_of(graph)["q"] == [4, 6]
    nodes["relu"].op = "Sigmoid"  # the op, and an input renamed
    nodes["rs"].outputs[0].name = "r2"
    assert refresh(graph) and refresh.protos.exported == 2 and shapes_of(graph)["q"] == [4, 6]
    nodes["relu"].inputs[0] = gs.Variable("x2", dtype=np.float32, shape=[5])  # a rewired input
    graph.inputs.append(nodes["relu"].inputs[0])
    assert refresh(graph) and refresh.protos.exported == 1 and shapes_of(graph)["q"] == [5]


def test_seeding_from_the_model_gives_the_shapes_a_refresh_gives():
    model = transpose_reshape()
    seeded, refreshed = io.import_graph(model), io.import_graph(model)
    assert ShapeRefresher().seed(seeded, model) and ShapeRefresher()(refreshed)
    assert shapes_of(seeded) == shapes_of(refreshed) and shapes_of(seeded)["q"] == [8, 3]
