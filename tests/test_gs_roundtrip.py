"""k3opt.graph.gs_roundtrip: graph inputs with a default initializer and optional-typed tensors survive gs."""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto as T, helper, numpy_helper

import k3opt
from k3opt.graph import gs_roundtrip as rt
from tests.helpers import assert_equivalent, random_feeds

F = T.FLOAT


def _with_default(nodes, extra_inputs=(), outputs=(("y", [3]),)):
    """x (3) and b (3, default 1,2,3) as graph inputs, in that order; ``extra_inputs`` after them."""
    inputs = [helper.make_tensor_value_info("x", F, [3]), helper.make_tensor_value_info("b", F, [3])]
    inputs += [helper.make_tensor_value_info(n, F, [3]) for n in extra_inputs]
    g = helper.make_graph(nodes, "t", inputs, [helper.make_tensor_value_info(n, F, s) for n, s in outputs],
                          [numpy_helper.from_array(np.float32([1, 2, 3]), "b")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def _optimize(model: onnx.ModelProto) -> onnx.ModelProto:
    """The whole k3opt pipeline, which imports and exports through gs_roundtrip."""
    out = k3opt.optimize(model)
    onnx.checker.check_model(out, full_check=True)
    return out


def _feeds(model, **given):
    feeds = random_feeds(model)
    feeds.update(given)
    return feeds


def test_plain_gs_drops_an_input_that_has_a_default():
    """What this module guards against (if gs ever fixes it, the guard can go)."""
    model = _with_default([helper.make_node("Add", ["x", "b"], ["y"])])
    assert [t.name for t in gs.import_onnx(model).inputs] == ["x"]


def test_input_with_default_stays_an_input_and_is_never_folded():
    nodes = [helper.make_node("Mul", ["b", "b"], ["bb"]), helper.make_node("Add", ["x", "bb"], ["y"])]
    model = _with_default(nodes)
    out = _optimize(model)
    assert [i.name for i in out.graph.input] == ["x", "b"]
    assert [i.name for i in out.graph.initializer] == ["b"] and out.graph.initializer[0] == model.graph.initializer[0]
    assert [n.op_type for n in out.graph.node] == ["Mul", "Add"]  # folding b*b would ignore a fed b
    assert_equivalent(model, out)  # with the default
    assert_equivalent(model, out, feeds=_feeds(model, b=np.float32([5, -1, 0.5])))  # overridden


def test_default_only_read_inside_a_branch_or_unused_or_an_output():
    then = helper.make_graph([helper.make_node("Add", ["x", "b"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", F, [3])])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", F, [3])])
    nodes = [helper.make_node("Constant", [], ["zero"], value=numpy_helper.from_array(np.float32(0))),
             helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["c"]),
             helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)]
    model = _with_default(nodes, extra_inputs=["u"], outputs=[("y", [3]), ("b", [3])])
    model.graph.initializer.append(numpy_helper.from_array(np.float32([0, 0, 0]), "u"))
    onnx.checker.check_model(model)
    out = _optimize(model)
    assert [i.name for i in out.graph.input] == ["x", "b", "u"]
    assert {"b", "u"} <= {i.name for i in out.graph.initializer}
    for x in (np.float32([1, 1, 1]), np.float32([-1, -1, -1])):
        assert_equivalent(model, out, feeds={"x": x})
        assert_equivalent(model, out, feeds={"x": x, "b": np.float32([7, 8, 9]), "u": np.float32([1, 1, 1])})


def _optional_model():
    opt = onnx.TypeProto()
    opt.optional_type.elem_type.CopyFrom(helper.make_tensor_type_proto(F, [3]))
    nodes = [helper.make_node("OptionalHasElement", ["o"], ["h"]),
             helper.make_node("Identity", ["o"], ["o2"]), helper.make_node("OptionalHasElement", ["o2"], ["h2"]),
             helper.make_node("And", ["h", "h2"], ["y"])]
    g = helper.make_graph(nodes, "t", [helper.make_value_info("o", opt)], [helper.make_tensor_value_info("y", T.BOOL, [])],
                          value_info=[helper.make_value_info("o2", opt)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model, full_check=True)
    return model


def test_plain_gs_cannot_export_an_optional_input():
    with pytest.raises(UnboundLocalError):
        gs.export_onnx(gs.import_onnx(_optional_model()), do_type_check=False)


def test_optional_input_and_value_info_export_with_their_types():
    model = _optional_model()
    graph = rt.import_onnx(model)
    out = rt.export_onnx(graph)
    onnx.checker.check_model(out, full_check=True)
    assert out.graph.input == model.graph.input
    assert all(vi == model.graph.value_info[0] for vi in out.graph.value_info if vi.name == "o2")  # typed or left out
    assert graph.inputs[0].dtype is not None  # the graph itself is left as it was
    optimized = _optimize(model)
    assert optimized.graph.input == model.graph.input


def _optionals(first: int, second: int) -> onnx.ModelProto:
    """Two empty Optionals whose only difference is their ``type`` attribute, both graph outputs."""
    def opt_type(elem: int) -> onnx.TypeProto:
        return helper.make_optional_type_proto(helper.make_tensor_type_proto(elem, [2]))

    nodes = [helper.make_node("Optional", [], ["a"], type=helper.make_tensor_type_proto(first, [2])),
             helper.make_node("Optional", [], ["b"], type=helper.make_tensor_type_proto(second, [2])),
             helper.make_node("OptionalHasElement", ["a"], ["ha"]),
             helper.make_node("OptionalHasElement", ["b"], ["hb"])]
    g = helper.make_graph(nodes, "t", [], [helper.make_value_info("a", opt_type(first)),
                                           helper.make_value_info("b", opt_type(second)),
                                           helper.make_tensor_value_info("ha", T.BOOL, []),
                                           helper.make_tensor_value_info("hb", T.BOOL, [])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model, full_check=True)
    return model


def test_type_attributes_gs_skips_survive_the_pipeline():
    """gs skips TYPE_PROTO attributes on import: an Optional lost its type and the model became invalid."""
    model = _optionals(T.FLOAT, T.INT64)
    out = _optimize(model)
    types = {n.output[0]: onnx.helper.get_attribute_value(n.attribute[0]) for n in out.graph.node if n.op_type == "Optional"}
    assert types["a"].tensor_type.elem_type == T.FLOAT and types["b"].tensor_type.elem_type == T.INT64


def test_cse_compares_type_attributes_by_value():
    from k3opt.graph.ir import NameScope
    from k3opt.pipeline.pass_base import PassContext
    from k3opt.passes.cleanup.eliminate_common_subexpressions import EliminateCommonSubexpressions

    def merged(first: int, second: int) -> int:
        graph = rt.import_onnx(_optionals(first, second))
        graph.outputs = graph.outputs[2:]  # only the Has results: the Optionals may merge
        ctx = PassContext(opset=18, names=NameScope(graph))  # the Has twins become an Identity: a fresh name
        return EliminateCommonSubexpressions().run(graph, ctx)

    assert merged(T.FLOAT, T.INT64) == 0
    assert merged(T.FLOAT, T.FLOAT) >= 1
