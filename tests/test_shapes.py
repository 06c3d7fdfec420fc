"""Shape refreshes: the joined inference model, seeing every change, seeding from the imported model."""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter, dtype_to_onnx, update_import_domains
from onnx_graphsurgeon.ir.tensor import SparseValues

from k3opt import modelio
from k3opt.pipeline import shapes
from k3opt.pipeline.shapes import ShapeRefresher, export_for_inference, model_for_inference
from tests.helpers import make_model
from tests.zoo import zoo_model


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


def test_a_refresh_sees_every_change():
    graph = modelio.import_graph(transpose_reshape())
    refresh = ShapeRefresher()
    assert refresh(graph)
    assert shapes_of(graph)["t"] == [2, 4, 3] and shapes_of(graph)["q"] == [8, 3]
    assert refresh(graph) and shapes_of(graph)["q"] == [8, 3]

    nodes = {n.name: n for n in graph.nodes}
    nodes["tr"].attrs["perm"] = [1, 0, 2]  # an attribute
    assert refresh(graph) and shapes_of(graph)["t"] == [3, 2, 4]
    to = nodes["rs"].inputs[1]
    to.values = np.array([4, 6], np.int64)  # a constant's values
    assert refresh(graph) and shapes_of(graph)["q"] == [4, 6]
    nodes["relu"].op = "Sigmoid"  # the op, and an input renamed
    nodes["rs"].outputs[0].name = "r2"
    assert refresh(graph) and shapes_of(graph)["q"] == [4, 6]
    nodes["relu"].inputs[0] = gs.Variable("x2", dtype=np.float32, shape=[5])  # a rewired input
    graph.inputs.append(nodes["relu"].inputs[0])
    assert refresh(graph) and shapes_of(graph)["q"] == [5]


def test_seeding_from_the_model_gives_the_shapes_a_refresh_gives():
    model = transpose_reshape()
    seeded, refreshed = modelio.import_graph(model), modelio.import_graph(model)
    assert ShapeRefresher().seed(seeded, model) and ShapeRefresher()(refreshed)
    assert shapes_of(seeded) == shapes_of(refreshed) and shapes_of(seeded)["q"] == [8, 3]


def helper_built(graph: gs.Graph) -> onnx.ModelProto:
    """The inference model built the plain way (onnx.helper, whole protos): what the joined bytes must parse to."""
    inputs = [OnnxExporter.export_value_info_proto(t, False) for t in graph.inputs]
    initializers = []
    for t in graph.tensors().values():
        if isinstance(t, gs.Constant) and not isinstance(t._values, SparseValues):
            if getattr(t._values, "nbytes", 0) >= modelio.EXTERNAL_THRESHOLD:
                inputs.append(helper.make_tensor_value_info(t.name, dtype_to_onnx(t._values.dtype),
                                                            [int(d) for d in t._values.shape]))
            else:
                initializers.append(modelio.inline_copy(OnnxExporter.export_tensor_proto(t)))
    g = helper.make_graph([OnnxExporter.export_node(n) for n in graph.nodes], graph.name or "k3opt", inputs,
                          [OnnxExporter.export_value_info_proto(t, False) for t in graph.outputs], initializers)
    model = helper.make_model(g, opset_imports=update_import_domains(graph),
                              functions=[OnnxExporter.export_function(f) for f in graph.functions])
    if graph.ir_version is not None:
        model.ir_version = graph.ir_version
    return model


def with_if_and_custom_domain() -> onnx.ModelProto:
    """An If with a subgraph using a domain the model does not import, a big constant and a small one."""
    branch = helper.make_graph([helper.make_node("Relu", ["x"], ["b"], domain="com.example")], "then", [],
                               [helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 3])])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["c"])], "else", [],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, [2, 3])])
    nodes = [helper.make_node("If", ["cond"], ["y0"], then_branch=branch, else_branch=other, name="if"),
             helper.make_node("Add", ["y0", "big"], ["y1"], name="add"),
             helper.make_node("Reshape", ["y1", "to"], ["y"], name="rs")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                                           helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [600])],
                              [onnx.numpy_helper.from_array(np.ones((100, 2, 3), np.float32), "big"),
                               onnx.numpy_helper.from_array(np.array([600], np.int64), "to")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("which", ["transpose_reshape", "if_and_domain", "bert", "gpt2"])
def test_the_joined_bytes_parse_to_the_helper_built_model(which):
    if which == "transpose_reshape":
        model = transpose_reshape()
    elif which == "if_and_domain":
        model = with_if_and_custom_domain()
    else:
        model = onnx.load(zoo_model(which))
    graph = modelio.import_graph(model)
    first = export_for_inference(graph)
    assert onnx.ModelProto.FromString(first.data) == helper_built(graph) and not first.long_io
    graph.nodes[-1].name = "renamed"
    assert onnx.ModelProto.FromString(export_for_inference(graph).data) == helper_built(graph)
    graph.nodes[-1].domain = "com.other"  # a domain the model does not import yet
    assert onnx.ModelProto.FromString(export_for_inference(graph).data) == helper_built(graph)
    assert "com.other" in {o.domain for o in onnx.ModelProto.FromString(export_for_inference(graph).data).opset_import}


def test_a_long_graph_input_is_reported_with_the_bytes():
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [("x", TensorProto.FLOAT, [70000])],
                       [("y", TensorProto.FLOAT, [70000])])
    assert export_for_inference(modelio.import_graph(model)).long_io


def test_a_long_weight_is_reported_with_the_bytes():
    """A big 1-D constant becomes a typed graph input: long, it rules out data propagation like a long input."""
    model = make_model([helper.make_node("Add", ["x", "w"], ["y"])], [("x", TensorProto.FLOAT, [1])],
                       [("y", TensorProto.FLOAT, ["n"])], {"w": np.zeros(70000, np.float32)})
    assert model_for_inference(model).long_io
    graph = modelio.import_graph(model)
    assert export_for_inference(graph).long_io
    graph.nodes[0].inputs[1].values = np.zeros(1000, np.float32)  # still big, no longer long
    assert not export_for_inference(graph).long_io


def with_everything() -> onnx.ModelProto:
    """Model and graph metadata, value_info, a big weight declared as an input, a small one in external data."""
    model = with_if_and_custom_domain()
    model.doc_string, model.producer_name, model.model_version = "doc", "me", 3
    onnx.helper.set_model_props(model, {"k": "v"})
    model.graph.doc_string = "graph doc"
    model.graph.value_info.append(helper.make_tensor_value_info("y0", TensorProto.FLOAT, [2, 3]))
    model.graph.input.append(helper.make_tensor_value_info("big", TensorProto.FLOAT, [100, 2, 3]))
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([1.0], np.float32), "unused_small"))
    return model


@pytest.mark.parametrize("which", ["transpose_reshape", "if_and_domain", "everything", "external", "bert"])
def test_the_seed_model_parses_to_the_weights_as_inputs_copy(which, tmp_path):
    """What the seed infers: the model with weights as inputs and no value_info, joined without copying it."""
    if which == "bert":
        model = onnx.load(zoo_model("bert"))
    elif which == "external":
        onnx.save(with_everything(), tmp_path / "m.onnx", save_as_external_data=True, size_threshold=0)
        model = modelio.load(tmp_path / "m.onnx")
    else:
        model = {"transpose_reshape": transpose_reshape, "if_and_domain": with_if_and_custom_domain,
                 "everything": with_everything}[which]()
    expected = modelio.weights_as_inputs(model)[0]
    del expected.graph.value_info[:]
    light = model_for_inference(model)
    assert onnx.ModelProto.FromString(light.data) == expected and not light.long_io


def test_type_conversions_are_reused_only_for_the_same_declared_symbols(monkeypatch):
    model = make_model([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Neg", ["r"], ["y"])],
                       [("x", TensorProto.FLOAT, ["n", 3])], [("y", TensorProto.FLOAT, ["n", 3])])
    inferred = onnx.shape_inference.infer_shapes(model).graph
    graph = modelio.import_graph(model)
    memo: dict = {}
    shapes.apply_shapes(graph, inferred, memo=memo)
    assert shapes_of(graph)["r"] == ["n", 3]
    real, calls = shapes._dtype_and_shape, []
    monkeypatch.setattr(shapes, "_dtype_and_shape", lambda *a: calls.append(a) or real(*a))
    shapes.apply_shapes(graph, inferred, memo=memo)
    assert calls == [] and shapes_of(graph)["r"] == ["n", 3]
    graph.inputs[0].shape = graph.outputs[0].shape = [None, 3]  # "n" no longer declared: onnx's symbol is dropped
    monkeypatch.undo()
    shapes.apply_shapes(graph, inferred, memo=memo)
    assert shapes_of(graph)["r"] == [None, 3] and len(memo) == 2


def inference_calls(monkeypatch) -> list[bool]:
    """The data_prop flag of every onnx shape inference run from now on."""
    calls: list[bool] = []
    real = onnx.shape_inference.infer_shapes

    def spy(model, *args, **kwargs):
        calls.append(bool(kwargs.get("data_prop")))
        return real(model, *args, **kwargs)

    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", spy)
    return calls


def test_the_seed_propagates_data_in_one_run_when_nothing_is_long(monkeypatch):
    calls = inference_calls(monkeypatch)
    model = transpose_reshape()
    assert ShapeRefresher().seed(modelio.import_graph(model), model) and calls == [True]


@pytest.mark.parametrize("attr", ["value", "value_ints"])
def test_a_long_constant_node_makes_the_seed_infer_without_propagation_first(monkeypatch, attr):
    """A Constant node's long 1-D value is data propagation could materialize: the plain run decides first."""
    long = np.arange(70000, dtype=np.int64)
    value = onnx.numpy_helper.from_array(long) if attr == "value" else long.tolist()
    nodes = [helper.make_node("Constant", [], ["c"], **{attr: value}),
             helper.make_node("Concat", ["c", "x"], ["y"], axis=0)]
    model = make_model(nodes, [("x", TensorProto.INT64, [2])], [("y", TensorProto.INT64, [70002])])
    assert model_for_inference(model).long_io
    calls = inference_calls(monkeypatch)
    graph = modelio.import_graph(model)
    assert ShapeRefresher().seed(graph, model) and calls == [False]
    assert shapes_of(graph)["y"] == [70002]


def _long_value_node(kind: str) -> onnx.NodeProto:
    """A Constant node holding a 70,001-element 1-D value in the fewest bytes each storage allows."""
    n = 70001
    if kind == "int4":
        value = helper.make_tensor("v", TensorProto.INT4, [n], np.zeros(n, dtype=np.int8).tolist())
    elif kind == "external":
        value = TensorProto(name="v", data_type=TensorProto.INT8, dims=[n], data_location=TensorProto.EXTERNAL)
        value.external_data.add(key="location", value="w.bin")
    elif kind == "sparse":
        return helper.make_node("Constant", [], ["c"], sparse_value=helper.make_sparse_tensor(
            helper.make_tensor("v", TensorProto.INT64, [1], [5]), helper.make_tensor("i", TensorProto.INT64, [1], [3]),
            [n]))
    else:
        value = onnx.numpy_helper.from_array(np.zeros(n, dtype=np.uint8))
    return helper.make_node("Constant", [], ["c"], value=value)


@pytest.mark.parametrize("kind", ["uint8", "int4", "external", "sparse"])
def test_the_byte_screen_passes_every_long_constant_node_to_the_exact_test(kind):
    """model_for_inference reads a Constant node's value only when its bytes may hold a long one: each
    storage's smallest long value gets through the screen, and the exact test finds it long."""
    node = _long_value_node(kind)
    assert shapes._may_be_long(node.SerializeToString()) and shapes._long_constant(node)
    short = helper.make_node("Constant", [], ["c"], value=onnx.numpy_helper.from_array(np.arange(4, dtype=np.int64)))
    assert not shapes._may_be_long(short.SerializeToString())


def test_repeated_fields_join_like_one_field_at_a_time():
    payloads = [b"", b"a" * 127, b"b" * 128, b"c" * 300, b"d" * 128, b"e" * 2**14]
    assert b"".join(shapes._repeated_field(1, payloads)) == b"".join(shapes.field(1, p) for p in payloads)
    graph = onnx.GraphProto.FromString(b"".join(shapes._repeated_field(5, [t.SerializeToString() for t in (
        helper.make_tensor("a", TensorProto.FLOAT, [2], [1, 2]), helper.make_tensor("b", TensorProto.INT64, [], [3]))])))
    assert [t.name for t in graph.initializer] == ["a", "b"]


@pytest.mark.parametrize("length", [5, 70000])
def test_inferred_types_find_a_long_intermediate_as_the_full_check_does(length):
    nodes = [helper.make_node("ConstantOfShape", ["n"], ["c"]),
             helper.make_node("ReduceSum", ["c"], ["y"], keepdims=0)]
    model = make_model(nodes, [], [("y", TensorProto.FLOAT, [])], {"n": np.array([length], np.int64)})
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True).graph
    view = shapes.inferred_types(inferred)
    assert view.long == shapes._has_long_vector(inferred) == (length > shapes.DATA_PROP_MAX_LEN)
    assert set(view.types) == {"c", "y"} and len(view.protos) == 2
    by_graph, by_view = modelio.import_graph(model), modelio.import_graph(model)
    shapes.apply_shapes(by_graph, inferred)
    shapes.apply_shapes(by_view, view)
    assert shapes_of(by_graph) == shapes_of(by_view) and shapes_of(by_view)["c"] == [length]
