"""Every shape refresh of a real optimization run equals a plain reference: onnx on a full gs export.

The refresher reuses protos, keeps big weights out of inference and copies
inferred types onto the graph with shortcuts; none of that may change a
single dtype or shape. Before each refresh (the seed included) the reference
exports the graph as it stands with ``gs.export_onnx``, infers it the
documented way (data propagation unless a 1-D tensor is longer than
``DATA_PROP_MAX_LEN``) and predicts every variable's dtype and shape; after
the refresh the graph must hold exactly that.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper

import k3opt
from k3opt import modelio
from k3opt.pipeline import shapes
from tests.helpers import make_model
from tests.zoo import needs_torch, zoo_model, zoo_params

State = dict[str, tuple[Any, Any]]


def state(graph: gs.Graph) -> State:
    """Every variable's (dtype, shape), with the element types of the shape (int vs numpy int matters)."""
    def typed(shape):
        return None if shape is None else [(type(d), d) for d in shape]

    return {name: (t.dtype, typed(t.shape)) for name, t in graph.tensors().items() if isinstance(t, gs.Variable)}


def _long(graph: onnx.GraphProto) -> bool:
    return any(len(vi.type.tensor_type.shape.dim) == 1
               and vi.type.tensor_type.shape.dim[0].dim_value > shapes.DATA_PROP_MAX_LEN
               for vi in list(graph.input) + list(graph.value_info) + list(graph.output))


def reference(graph: gs.Graph) -> State:
    """The state a refresh of ``graph`` must leave, computed the plain way without touching ``graph``."""
    model = gs.export_onnx(graph.copy(), do_type_check=False)
    del model.graph.value_info[:]
    light = modelio.weights_as_inputs(model)[0]
    inferred = onnx.shape_inference.infer_shapes(light, strict_mode=True)
    if not _long(inferred.graph):
        inferred = onnx.shape_inference.infer_shapes(light, strict_mode=True, data_prop=True)
    infos = {vi.name: vi for vi in list(inferred.graph.value_info) + list(inferred.graph.output)}
    declared = {d for t in list(graph.inputs) + list(graph.outputs) for d in (t.shape or ()) if isinstance(d, str)}
    inputs = {t.name for t in graph.inputs}
    expected = state(graph)
    for name in expected:
        vi = infos.get(name)
        if vi is None or name in inputs or not vi.type.HasField("tensor_type"):
            continue
        tt = vi.type.tensor_type
        if tt.elem_type == TensorProto.UNDEFINED:
            continue
        shape = expected[name][1]
        if tt.HasField("shape"):
            shape = [(int, d.dim_value) if d.HasField("dim_value")
                     else (str, d.dim_param) if d.dim_param in declared else (type(None), None)
                     for d in tt.shape.dim]
        expected[name] = (helper.tensor_dtype_to_np_dtype(tt.elem_type), shape)
    return expected


class CheckedRefresher(shapes.ShapeRefresher):
    """A ShapeRefresher that compares the graph after each successful refresh with :func:`reference`."""

    checked = 0

    def _refresh(self, graph, tensors, model, propagate_first=False) -> bool:
        expected = reference(graph)
        ok = super()._refresh(graph, tensors, model, propagate_first)
        if ok:
            got = state(graph)
            wrong = {n: (got[n], expected[n]) for n in expected if got[n] != expected[n]}
            assert not wrong, f"refresh {self.calls}: {len(wrong)} tensors differ, e.g. {list(wrong.items())[:3]}"
            CheckedRefresher.checked += 1
        return ok


@pytest.fixture
def checked(monkeypatch):
    monkeypatch.setattr(shapes, "ShapeRefresher", CheckedRefresher)
    CheckedRefresher.checked = 0
    return CheckedRefresher


@needs_torch
@pytest.mark.parametrize("name,exporter", zoo_params())
def test_every_refresh_of_a_zoo_run_matches_the_reference(checked, name, exporter):
    k3opt.optimize(str(zoo_model(name, exporter)))
    assert checked.checked >= 2  # the seed and at least one refresh after a rewrite


def test_edge_cases_match_the_reference(checked):
    """Symbolic dims (declared and made up), a sequence, an unused input, a graph output read by a node."""
    nodes = [helper.make_node("Shape", ["x"], ["s"], name="shape"),
             helper.make_node("ConstantOfShape", ["s"], ["z"], name="cos"),
             helper.make_node("Add", ["x", "z"], ["y"], name="add"),
             helper.make_node("NonZero", ["y"], ["nz"], name="nonzero"),  # a made-up dim (unk__N)
             helper.make_node("Cast", ["nz"], ["nzf"], to=TensorProto.FLOAT, name="cast"),
             helper.make_node("SplitToSequence", ["y"], ["seq"], axis=1, keepdims=1, name="split"),
             helper.make_node("SequenceAt", ["seq", "zero"], ["first"], name="at"),
             helper.make_node("Relu", ["first"], ["r"], name="relu"),
             helper.make_node("Identity", ["y"], ["y2"], name="id")]
    model = make_model(nodes, [("x", TensorProto.FLOAT, ["batch", 3]), ("unused", TensorProto.INT64, [2])],
                       [("y", TensorProto.FLOAT, ["batch", 3]), ("nzf", TensorProto.FLOAT, [2, "n"]),
                        ("r", TensorProto.FLOAT, ["batch", "one"]), ("y2", TensorProto.FLOAT, ["b2", 3])],
                       {"zero": np.array(0, np.int64)})
    graph = modelio.import_graph(model)
    refresher = shapes.ShapeRefresher()
    assert refresher.seed(graph, model) and refresher(graph)
    graph.nodes[-2].op = "Sigmoid"  # a change, then a refresh reusing the other protos
    assert refresher(graph) and checked.checked == 3
    assert graph.tensors()["nz"].shape == [2, None] and graph.tensors()["nzf"].shape == [2, "n"]
