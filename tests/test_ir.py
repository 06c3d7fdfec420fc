"""k3opt.graph.ir helpers: constants are read without being cached in the graph."""
from __future__ import annotations

import onnx_graphsurgeon as gs
from onnx import TensorProto as T, helper

from k3opt.graph import ir
from k3opt.graph.small_constants import small_const_scalar

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


def test_new_constant_is_gs_constant():
    """Built without gs's constructor, the same object as ``gs.Constant`` builds, links that stay in sync included."""
    import numpy as np

    value = np.arange(3)
    made, ref = ir.new_constant("c", value, 1), gs.Constant("c", value, 1)
    assert type(made) is gs.Constant and sorted(made.__dict__) == sorted(ref.__dict__)
    assert all(type(made.__dict__[k]) is type(ref.__dict__[k]) for k in ref.__dict__)
    assert (made.name, made._values, made.data_location, made._export_dtype) == ("c", value, 1, None)
    node = gs.Node("Identity", inputs=[made], outputs=[gs.Variable("y")])
    assert made.outputs == [node] and not made.inputs
    node.inputs.clear()
    assert not made.outputs


def test_new_variable_is_gs_variable():
    made, ref = ir.new_variable("v"), gs.Variable("v")
    assert type(made) is gs.Variable and made.__dict__.keys() == ref.__dict__.keys()
    assert [type(made.__dict__[k]) for k in ref.__dict__] == [type(v) for v in ref.__dict__.values()]
    assert (made.name, made.dtype, made.shape, made.type) == ("v", None, None, "tensor_type")


def test_size_queries_never_load_a_constant(monkeypatch):
    """const_tensor / is_const / const_shape answer from the proto: an external weight stays on disk."""
    model, _ = _int4_model()
    graph = gs.import_onnx(model)
    loads = []
    monkeypatch.setattr(gs.ir.tensor.LazyValues, "load", lambda self: loads.append(self) or None)
    w, s = graph.tensors()["w"], graph.tensors()["s"]
    assert ir.is_const(w) and ir.is_const(s) and not ir.is_const(graph.tensors()["x"])
    assert tuple(ir.const_tensor(w).shape) == (4,) and ir.const_shape(w) == (4,)
    assert tuple(ir.const_tensor(s).shape) == (2,)
    assert loads == []


def test_scalar_and_int_list_readers():
    model, _ = _int4_model()
    graph = gs.import_onnx(model)
    t = graph.tensors()
    assert ir.int_list(t["w"]) == [1, -2, 3, -8] and ir.int_list(t["x"]) is None
    assert ir.const_scalar(t["scale"]) == 0.5 and ir.const_scalar(t["w"]) is None and ir.const_scalar(t["x"]) is None
    for name in ("scale", "w", "x"):  # the cached readers answer as the plain ones
        assert small_const_scalar(t[name]) == ir.const_scalar(t[name])


def test_the_pattern_checks_read_constants_with_the_same_functions():
    """One constant reader: the rule-writing names in k3opt.patterns.checks are the graph's functions."""
    from k3opt.patterns import checks

    assert checks.const_value is ir.const_value and checks.const_scalar is ir.const_scalar
    assert checks.static_shape is ir.const_shape and checks.rank is ir.rank


def test_a_name_scope_holds_every_name_gs_knows():
    """NameScope collects the names itself: exactly the keys of gs's ``tensors()`` of every graph, and the
    node names, bodies and omitted optional tensors ("") included."""
    import onnx
    from k3opt import modelio
    from k3opt.graph.ir import tensor_map
    from tests.zoo import zoo_model

    body = helper.make_graph([helper.make_node("Add", ["x", "k"], ["b"], name="inner")], "then", [],
                             [helper.make_tensor_value_info("b", T.FLOAT, [2])])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["c"])], "else", [],
                              [helper.make_tensor_value_info("c", T.FLOAT, [2])])
    nodes = [helper.make_node("If", ["cond"], ["y0"], then_branch=body, else_branch=other, name="if"),
             helper.make_node("Dropout", ["y0"], ["y", ""], name=""),
             helper.make_node("Clip", ["y", "", "k"], ["z"], name="clip")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT, [2]),
                                           helper.make_tensor_value_info("cond", T.BOOL, []),
                                           helper.make_tensor_value_info("unused", T.FLOAT, [1])],
                              [helper.make_tensor_value_info("z", T.FLOAT, [2])],
                              [helper.make_tensor("k", T.FLOAT, [], [1.0])])
    models = [helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
              onnx.load(str(zoo_model("gpt2")), load_external_data=False)]
    for model in models:
        g = modelio.import_graph(model)
        want = set()
        for sub in ir.all_graphs(g):
            want.update(sub.tensors().keys())
            want.update(n.name for n in sub.nodes if n.name)
        assert ir.NameScope(g)._used == want
        assert ir.NameScope(g, tensor_map(g))._used == want  # the main graph's names read from its tensor map


def _constant_nodes_model():
    """Each form of Constant node, each read twice (one reader reads it at two positions)."""
    forms = {"t": {"value": helper.make_tensor("v", F, [2], [1.5, -2.0])}, "f": {"value_float": 0.25},
             "fs": {"value_floats": [1.0, 2.0]}, "i": {"value_int": 3}, "is": {"value_ints": [4, 5]},
             "s": {"value_string": "a"}, "ss": {"value_strings": ["a", "b"]}}
    nodes = [helper.make_node("Constant", [], [name], **attrs) for name, attrs in forms.items()]
    nodes += [helper.make_node("Concat", [name, name], [f"{name}2"], axis=0) for name in ("t", "fs", "is", "ss")]
    nodes += [helper.make_node("Identity", [name], [f"{name}_id"]) for name in forms]
    outputs = [helper.make_tensor_value_info(n.output[0], T.UNDEFINED, None) for n in nodes[len(forms):]]
    graph = helper.make_graph(nodes, "t", [], outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_constant_in_place_equals_replacing_the_output():
    """The in-place form of a Constant node's value (fold-constants' first sweep) exports exactly as
    replacing the output with constant_node_value's constant; readers keep their positions."""
    from k3opt.graph.gs_roundtrip import export_onnx, import_onnx

    plain, fast = import_onnx(_constant_nodes_model()), import_onnx(_constant_nodes_model())
    for node in [n for n in plain.nodes if n.op == "Constant"]:
        out, value = node.outputs[0], ir.constant_node_value(node)
        ir.replace_uses(plain, out, value)
        value.name = out.name
        ir.disconnect(node)
    plain.nodes = [n for n in plain.nodes if n.op != "Constant"]
    for node in [n for n in fast.nodes if n.op == "Constant"]:
        out = node.outputs[0]
        readers = list(out.outputs)
        assert ir.constant_in_place(node) and isinstance(out, gs.Constant)
        assert not node.outputs and not out.inputs and readers and out.outputs == readers
        assert all(out in r.inputs for r in readers)
    fast.nodes = [n for n in fast.nodes if n.op != "Constant"]
    assert export_onnx(fast).SerializeToString() == export_onnx(plain).SerializeToString()
    concat = next(n for n in fast.nodes if n.op == "Concat")
    assert concat.inputs[0] is concat.inputs[1] and concat.inputs[0].outputs.count(concat) == 2


def test_constant_in_place_declines_a_value_it_cannot_read():
    node = gs.Node("Constant", "c", attrs={"sparse_value": object()}, outputs=[gs.Variable("c_out")])
    assert not ir.constant_in_place(node) and isinstance(node.outputs[0], gs.Variable)
