"""The fast graph edges (ir.toposort, ir.cleanup, the fast importer, the export) give exactly gs's results.

Each helper replaces a gs routine that was slow on a 16k-node model; the
claim is "same result", so every test compares with gs itself: the same
node order, the same nodes kept, the same exported bytes.
"""
from __future__ import annotations

import random

import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto as T, helper
from onnx_graphsurgeon.util.exception import OnnxGraphSurgeonException

from k3opt import gs_roundtrip, io, ir

F = T.FLOAT


def _vi(name: str, shape=(2,)) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, F, list(shape))


def _model(nodes, inputs, outputs, inits=(), opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [_vi(n) for n in inputs], [_vi(n) for n in outputs], list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _branch(name: str, op: str, outer: str, out: str) -> onnx.GraphProto:
    """A body reading ``outer`` from the enclosing graph (plus one dead node)."""
    return helper.make_graph([helper.make_node(op, [outer, outer], [out], name=f"{name}_op"),
                              helper.make_node("Neg", [outer], [f"{name}_dead"], name=f"{name}_dead")],
                             name, [], [_vi(out)])


def _if_model() -> onnx.ModelProto:
    """Outer-scope reads from If branches, a dead node, a duplicate consumer, an unused input,
    an optional empty input, and graph outputs that are an input and a constant."""
    c = helper.make_tensor("c", F, [2], [1.0, 2.0])
    nodes = [
        helper.make_node("ReduceSum", ["x", "c"], ["cond_f"], keepdims=0, name="sum"),
        helper.make_node("Cast", ["cond_f"], ["cond"], to=T.BOOL, name="cast"),
        helper.make_node("If", ["cond"], ["r"], name="if",
                         then_branch=_branch("then", "Add", "a", "t_out"),
                         else_branch=_branch("else", "Mul", "b", "e_out")),
        helper.make_node("Relu", ["x"], ["a"], name="relu"),
        helper.make_node("Sigmoid", ["x"], ["b"], name="sig"),
        helper.make_node("Add", ["r", "r"], ["rr"], name="twice"),
        helper.make_node("Clip", ["rr", "", "c"], ["y"], name="clip"),
        helper.make_node("Exp", ["x"], ["dead"], name="dead"),
    ]
    return _model(nodes, ["x", "unused"], ["y", "x", "c"], [c])


def _loop_model() -> onnx.ModelProto:
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"], name="keep_going"),
         helper.make_node("Add", ["acc", "w"], ["acc_out"], name="step")],
        "body", [helper.make_tensor_value_info("i", T.INT64, []), helper.make_tensor_value_info("cond_in", T.BOOL, []),
                 _vi("acc")], [helper.make_tensor_value_info("cond_out", T.BOOL, []), _vi("acc_out")])
    n = helper.make_tensor("n", T.INT64, [], [3])
    nodes = [helper.make_node("Loop", ["n", "", "x"], ["y"], body=body, name="loop"),
             helper.make_node("Neg", ["x"], ["w"], name="w")]
    return _model(nodes, ["x"], ["y"], [n], opset=17)


def _exported(graph: gs.Graph) -> bytes:
    return gs_roundtrip.export_onnx(graph).SerializeToString()


def _order(graph: gs.Graph) -> list[list[str]]:
    return [[n.name for n in g.nodes] for g in ir.all_graphs(graph)]


MODELS = {"if": _if_model, "loop": _loop_model}


@pytest.mark.parametrize("make", MODELS.values(), ids=list(MODELS))
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_toposort_matches_gs_on_shuffled_graphs(make, seed):
    """The tie order among same-level nodes is gs's too (the export must stay byte-identical)."""
    ours, theirs = gs.import_onnx(make()), gs.import_onnx(make())
    for g1, g2 in zip(ir.all_graphs(ours), ir.all_graphs(theirs)):
        perm = list(range(len(g1.nodes)))
        random.Random(seed).shuffle(perm)
        g1.nodes, g2.nodes = [g1.nodes[i] for i in perm], [g2.nodes[i] for i in perm]
    ir.toposort(ours)
    theirs.toposort()
    assert _order(ours) == _order(theirs)
    assert _exported(ours) == _exported(theirs)


@pytest.mark.parametrize("make", MODELS.values(), ids=list(MODELS))
def test_cleanup_matches_gs(make):
    ours, theirs = gs.import_onnx(make()), gs.import_onnx(make())
    ir.cleanup(ours)
    theirs.cleanup()
    assert _order(ours) == _order(theirs)
    assert [t.name for t in ours.inputs] == [t.name for t in theirs.inputs]
    assert _exported(ours) == _exported(theirs)


def test_cleanup_drops_dead_nodes_in_bodies_and_keeps_unused_inputs():
    graph = ir.cleanup(gs.import_onnx(_if_model()))
    names = sum(_order(graph), [])
    assert "dead" not in names and "then_dead" not in names and "then_op" in names
    assert [t.name for t in graph.inputs] == ["x", "unused"]


def test_cleanup_unlinks_what_it_drops_and_graph_input_producers():
    graph = gs.import_onnx(_if_model())
    x = graph.tensors()["x"]
    dead = next(n for n in graph.nodes if n.name == "dead")
    fake = gs.Node("Identity", name="feeds_x", inputs=[graph.tensors()["a"]], outputs=[x])
    graph.nodes.append(fake)
    ir.cleanup(graph)
    assert not x.inputs and not fake.outputs
    assert not dead.inputs and not dead.outputs and all(n is not dead for n in x.outputs)


def test_toposort_refuses_a_cycle_like_gs():
    graph = gs.import_onnx(_model([helper.make_node("Neg", ["z"], ["w"]), helper.make_node("Neg", ["w"], ["z"]),
                                   helper.make_node("Add", ["x", "z"], ["y"])], ["x"], ["y"]))
    with pytest.raises(OnnxGraphSurgeonException, match="Cycle"):
        ir.toposort(graph)


@pytest.mark.parametrize("helper_, method", [(ir.toposort, "toposort"), (ir.cleanup, "cleanup")])
def test_a_producer_outside_the_graph_is_refused_like_gs(helper_, method):
    def graph_with_stray_producer() -> gs.Graph:
        graph = gs.import_onnx(_model([helper.make_node("Neg", ["x"], ["y"]), helper.make_node("Exp", ["y"], ["z"])],
                                      ["x"], ["z"]))
        gs.Node("Exp", name="stray", inputs=[graph.inputs[0]], outputs=[graph.nodes[0].outputs[0]])
        return graph

    with pytest.raises(OnnxGraphSurgeonException, match="not in the graph"):
        getattr(graph_with_stray_producer(), method)()
    with pytest.raises(OnnxGraphSurgeonException, match="not in the graph"):
        helper_(graph_with_stray_producer())


def test_graphs_with_functions_go_to_gs():
    f = helper.make_function("local", "F", ["a"], ["b"], [helper.make_node("Neg", ["a"], ["b"])],
                             [helper.make_opsetid("", 17)])
    model = _model([helper.make_node("F", ["x"], ["y"], domain="local"), helper.make_node("Exp", ["x"], ["d"])],
                   ["x"], ["y"])
    model.functions.append(f)
    model.opset_import.append(helper.make_opsetid("local", 1))
    ours, theirs = gs.import_onnx(model), gs.import_onnx(model)
    ir.toposort(ir.cleanup(ours))
    theirs.cleanup().toposort()
    assert _exported(ours) == _exported(theirs) and len(ours.nodes) == 1


def test_toposort_and_cleanup_match_gs_on_a_zoo_model():
    from tests.zoo import zoo_model

    model = io.load(zoo_model("llama", "torchscript"))
    ours, theirs = io.import_graph(model), io.import_graph(io.load(zoo_model("llama", "torchscript")))
    perm = list(range(len(ours.nodes)))
    random.Random(0).shuffle(perm)
    ours.nodes, theirs.nodes = [ours.nodes[i] for i in perm], [theirs.nodes[i] for i in perm]
    ir.toposort(ir.cleanup(ours))
    theirs.cleanup().toposort()
    assert _order(ours) == _order(theirs)
    assert _exported(ours) == _exported(theirs)
