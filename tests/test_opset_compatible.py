"""Nodes onnx's version converter gives back unchanged (k3opt/modelio/opset_compatible.py) make no sub-model:
every entry of the table is onnx's converter's own behaviour, and a conversion that keeps them as they are
gives the very bytes (and notes) of the conversion that sends them through the converter."""
from __future__ import annotations

from unittest import mock

import onnx
import pytest
from onnx import TensorProto, helper, version_converter

from k3opt.modelio import opset as opsets, opset_nodes
from k3opt.modelio.opset_compatible import COMPATIBLE_UP, compatible_steps, passes_through
from k3opt.targets import get_target
from tests.helpers import make_model
from tests.zoo import zoo_model

F, I64, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
_A = onnx.AttributeProto
_SAMPLES = {_A.INT: 1, _A.INTS: [1, 2], _A.STRING: "x", _A.STRINGS: ["x", "y"]}


def _sample_node(op: str, version: int) -> onnx.NodeProto:
    """``op`` at opset ``version`` with its fewest inputs and outputs and every attribute of a plain kind the
    op still has one version on (a sample value; the converter's inference may refuse it, which it ignores)."""
    schema = onnx.defs.get_schema(op, version, "")
    later = onnx.defs.get_schema(op, version + 1, "").attributes
    attrs = {name: _SAMPLES[a.type] for name, a in schema.attributes.items() if a.type in _SAMPLES and name in later}
    return helper.make_node(op, [f"in{i}" for i in range(schema.min_input)],
                            [f"out{i}" for i in range(max(schema.min_output, 1))], name=f"{op}_node", **attrs)


def _convert_with_onnx(node: onnx.NodeProto, version: int, target: int) -> onnx.NodeProto:
    graph = helper.make_graph([node], "g", [helper.make_value_info(i, onnx.TypeProto()) for i in node.input],
                              [helper.make_value_info(o, onnx.TypeProto()) for o in node.output])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", version)])
    (converted,) = version_converter.convert_version(model, target).graph.node
    return converted


STEPS = sorted((op, step) for op, steps in COMPATIBLE_UP.items() for step in steps)


@pytest.mark.parametrize("op,step", STEPS, ids=[f"{op}-{step}" for op, step in STEPS])
def test_every_compatible_step_gives_the_node_back_unchanged(op, step):
    assert onnx.defs.get_schema(op, step, "").since_version == step  # a schema change is where the step is
    node = _sample_node(op, step - 1)
    assert compatible_steps(op, step - 1, step)
    assert passes_through(node, step - 1, step) == all(a.type in _SAMPLES for a in node.attribute)
    assert _convert_with_onnx(node, step - 1, step) == node


def _kept_and_converted(model: onnx.ModelProto, opset=None, target="onnx") -> tuple[tuple, tuple]:
    """(bytes, notes) of ``opsets.convert`` as it is, and with every graph sent to onnx's converter."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    out, notes = opsets.convert(model, opset, target=get_target(target))
    with mock.patch.object(opset_nodes, "kept_as_they_are", lambda *args: False):
        plain, plain_notes = opsets.convert(copy, opset, target=get_target(target))
    return (out.SerializeToString(), notes), (plain.SerializeToString(), plain_notes)


def _llama_like(opset: int = 14) -> onnx.ModelProto:
    """The ops whose schema changes from 14 to 17 in a TorchScript Llama export, all of compatible steps."""
    nodes = [helper.make_node("Shape", ["x"], ["s"], name="shape"),
             helper.make_node("Identity", ["x"], ["i"], name="identity"),
             helper.make_node("Pow", ["i", "two"], ["p"], name="pow"),
             helper.make_node("LessOrEqual", ["p", "two"], ["le"], name="le"),
             helper.make_node("Where", ["le", "p", "x"], ["y"], name="where")]
    two = helper.make_tensor("two", F, [], [2.0])
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["n", 3])],
                              [helper.make_tensor_value_info("y", F, ["n", 3]),
                               helper.make_tensor_value_info("s", I64, [2])], [two])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def test_compatible_nodes_stay_as_they_are_and_equal_the_converters_result():
    model = _llama_like()
    before = list(model.graph.node)
    kept, converted = _kept_and_converted(model)
    assert kept == converted
    assert list(model.graph.node) == before and opsets.model_opset(model) == 17
    onnx.checker.check_model(model, full_check=True)


def test_no_scope_is_made_when_every_changed_node_stays():
    with mock.patch.object(opset_nodes, "ModelScope", side_effect=AssertionError("scope made")):
        opsets.convert(_llama_like())


def test_plain_attributes_stay_too():
    """Concat's axis (an INT) from 10 to 17: steps 11 and 13, both compatible."""
    concat = helper.make_node("Concat", ["a", "b"], ["y"], axis=1, name="concat")
    model = make_model([concat], [("a", F, [1, 2]), ("b", F, [1, 3])], [("y", F, [1, 5])], opset=10)
    assert passes_through(model.graph.node[0], 10, 17)
    kept, converted = _kept_and_converted(model)
    assert kept == converted


@pytest.mark.parametrize("node,why", [
    (helper.make_node("LeakyRelu", ["x"], ["y"], alpha=0.5), "a float attribute"),
    (helper.make_node("Relu", ["x"], ["y"], doc_string="doc"), "a doc string"),
    (helper.make_node("Relu", ["x"], ["y"], domain="com.other"), "another domain"),
    (helper.make_node("ReduceSum", ["x"], ["y"], axes=[1]), "a step that is not compatible"),
])
def test_nodes_the_converter_may_change_go_through_it(node, why):
    assert not passes_through(node, 12, 17), why


def test_a_graph_with_another_changed_node_goes_to_the_converter_whole():
    """Relu (compatible) and ReduceSum (axes move to an input at 13) at 12: one sub-model, as before."""
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("ReduceSum", ["r"], ["y"], axes=[1], keepdims=1, name="reduce")]
    model = make_model(nodes, [("x", F, [2, 3])], [("y", F, [2, 1])], opset=12)
    assert passes_through(model.graph.node[0], 12, 17)
    kept, converted = _kept_and_converted(model)
    assert kept == converted
    assert [n.op_type for n in model.graph.node] == ["Relu", "Constant", "ReduceSum"]


def test_an_output_declared_without_element_type_goes_to_the_converter():
    """The converter's inference may type it, which would count as a changed interface: the converter
    decides, as before."""
    model = _llama_like()
    vi = model.graph.value_info.add(name="p")
    vi.type.tensor_type.shape.dim.add().dim_param = "n"
    untyped = opset_nodes._untyped([model.graph])
    assert untyped == {"p"} and not opset_nodes.kept_as_they_are(model.graph, [0, 1, 2, 3, 4], 14, 17, untyped)
    kept, converted = _kept_and_converted(model)
    assert kept == converted


def test_an_unchanged_nodes_body_with_compatible_nodes_stays():
    body = helper.make_graph([helper.make_node("Identity", ["x"], ["out"], name="inner")], "then", [],
                             [helper.make_tensor_value_info("out", F, [2])])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["neg"], name="neg")], "else", [],
                              [helper.make_tensor_value_info("neg", F, [2])])
    iff = helper.make_node("If", ["c"], ["y"], then_branch=body, else_branch=other, name="if")
    model = make_model([iff], [("c", B, []), ("x", F, [2])], [("y", F, [2])], opset=16)
    kept, converted = _kept_and_converted(model, 17)
    assert kept == converted


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "bert", "gpt2"])
@pytest.mark.parametrize("opset,target", [(None, "onnx"), (23, "onnx"), (None, "cann")])
def test_zoo_conversions_equal_the_converters(name, opset, target):
    model = onnx.load(str(zoo_model(name)), load_external_data=False)
    assert opsets.model_opset(model) == 14
    kept, converted = _kept_and_converted(model, opset, target)
    assert kept == converted
