"""remove-identity, remove-dropout, remove-noop-ops: each removal and each refusal, checked with onnxruntime."""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto as T, helper

from k3opt.graph import ir
from k3opt.pipeline.pass_base import Pass, PassContext
from k3opt.passes.cleanup.remove_dropout import RemoveDropout
from k3opt.passes.cleanup.remove_identity import RemoveIdentity
from k3opt.passes.cleanup.remove_noop_ops import RemoveNoopOps
from k3opt.pipeline.manager import PassManager
from tests.helpers import assert_equivalent, make_model, op_counts, run_passes

F = T.FLOAT


def apply(model: onnx.ModelProto, *passes: Pass) -> tuple[onnx.ModelProto, int]:
    """Infer shapes, run ``passes`` to a fixed point; returns (model, total rewrites)."""
    model = onnx.shape_inference.infer_shapes(model)
    out, pm, _ = run_passes(model, list(passes))
    return out, sum(s.rewrites for s in pm.stats.values())


def check(model: onnx.ModelProto, pass_: Pass, removed: bool, op: str) -> onnx.ModelProto:
    """Run ``pass_``; ``op`` must be gone (``removed``) or untouched, outputs unchanged either way."""
    out, n = apply(model, pass_)
    assert (op not in op_counts(out)) == removed, op_counts(out)
    assert (n > 0) == removed
    assert_equivalent(model, out)
    assert apply(out, type(pass_)())[1] == 0  # idempotent
    return out


# -- Identity -----------------------------------------------------------------

def test_identity_between_nodes_is_removed():
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Identity", ["r"], ["i"]),
             helper.make_node("Neg", ["i"], ["y"])]
    check(make_model(nodes, [("x", F, [3])], [("y", F, [3])]), RemoveIdentity(), True, "Identity")


def test_identity_to_graph_output_keeps_output_name():
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Identity", ["r"], ["y"])]
    out = check(make_model(nodes, [("x", F, [3])], [("y", F, [3])]), RemoveIdentity(), True, "Identity")
    assert out.graph.node[0].output[0] == "y"


@pytest.mark.parametrize("case", ["input_to_output", "output_to_output", "initializer_to_output"])
def test_identity_that_keeps_an_output_distinct_is_refused(case):
    if case == "input_to_output":
        model = make_model([helper.make_node("Identity", ["x"], ["y"])], [("x", F, [3])], [("y", F, [3])])
    elif case == "output_to_output":
        nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Identity", ["r"], ["y"])]
        model = make_model(nodes, [("x", F, [3])], [("r", F, [3]), ("y", F, [3])])
    else:
        nodes = [helper.make_node("Identity", ["w"], ["y"]), helper.make_node("Relu", ["x"], ["z"])]
        model = make_model(nodes, [("x", F, [3])], [("y", F, [3]), ("z", F, [3])], {"w": np.float32([1, 2, 3])})
    check(model, RemoveIdentity(), False, "Identity")


def test_identity_inside_if_branch_reading_outer_value():
    then_g = helper.make_graph([helper.make_node("Identity", ["r"], ["t0"]), helper.make_node("Neg", ["t0"], ["t"])],
                               "then", [], [helper.make_tensor_value_info("t", F, [2])])
    else_g = helper.make_graph([helper.make_node("Identity", ["r"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", F, [2])])
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)]
    model = make_model(nodes, [("x", F, [2]), ("c", T.BOOL, [])], [("y", F, [2])])
    out, n = apply(model, RemoveIdentity())
    assert n == 1  # the then-branch Identity; the else one is its branch's output and reads an outer value
    for c in (True, False):
        assert_equivalent(model, out, feeds={"x": np.float32([-1, 2]), "c": np.array(c)})


# -- Dropout ------------------------------------------------------------------

def _dropout(opset: int, inputs: list[str], outputs: list[str], inits: dict, graph_outputs=None, **attrs):
    nodes = [helper.make_node("Dropout", inputs, outputs, **attrs), helper.make_node("Neg", ["d"], ["y"])]
    outs = [("y", F, [4])] + [(o, T.BOOL, [4]) for o in graph_outputs or []]
    return make_model(nodes, [("x", F, [4])], outs, inits, opset=opset)


@pytest.mark.parametrize("opset,inputs,outputs,inits", [
    (17, ["x"], ["d"], {}),
    (17, ["x", "ratio"], ["d", "mask"], {"ratio": np.float32(0.3)}),
    (17, ["x", "ratio", "train"], ["d"], {"ratio": np.float32(0.3), "train": np.array(False)}),
    (17, ["x", "ratio", "train"], ["d"], {"ratio": np.float32(0.0), "train": np.array(True)}),
    (11, ["x"], ["d"], {}),
])
def test_inference_dropout_is_removed(opset, inputs, outputs, inits):
    check(_dropout(opset, inputs, outputs, inits), RemoveDropout(), True, "Dropout")


def test_dropout_with_used_mask_is_refused():
    model = _dropout(17, ["x"], ["d", "mask"], {}, graph_outputs=["mask"])
    check(model, RemoveDropout(), False, "Dropout")


def test_training_dropout_is_refused():
    model = _dropout(17, ["x", "ratio", "train"], ["d"], {"ratio": np.float32(0.5), "train": np.array(True)})
    out, n = apply(model, RemoveDropout())
    assert n == 0 and out.graph.node == model.graph.node


# -- no-op nodes ---------------------------------------------------------------

def _unary(op: str, inputs: list[str], x_shape: list, inits: dict, **attrs) -> onnx.ModelProto:
    """``y = Neg(op(x, *inputs))`` with y's shape left to inference."""
    nodes = [helper.make_node(op, ["x"] + inputs, ["o"], **attrs), helper.make_node("Neg", ["o"], ["y"])]
    model = make_model(nodes, [("x", F, x_shape)], [("y", F, [])], inits)
    model.graph.output[0].type.tensor_type.ClearField("shape")
    return model


NOOPS = [
    ("Reshape", ["s"], [2, 3], {"s": np.array([2, 3])}, {}),
    ("Reshape", ["s"], ["N", 3], {"s": np.array([0, 3])}, {}),
    ("Reshape", ["s"], ["N", 3], {"s": np.array([-1, 3])}, {}),
    ("Expand", ["s"], [2, 3], {"s": np.array([1, 3])}, {}),
    ("Expand", ["s"], ["N", 3], {"s": np.array([3])}, {}),
    ("Transpose", [], [2, 3, 4], {}, {"perm": [0, 1, 2]}),
    ("Transpose", [], [5], {}, {}),
    ("Cast", [], [2, 3], {}, {"to": F}),
    ("CastLike", ["like"], [2, 3], {"like": np.float32([0])}, {}),
    ("Slice", ["st", "en"], [2, 3], {"st": np.array([0]), "en": np.array([np.iinfo(np.int64).max])}, {}),
    ("Slice", ["st", "en", "ax"], ["N", 3], {"st": np.array([0]), "en": np.array([3]), "ax": np.array([1])}, {}),
    ("Concat", [], [2, 3], {}, {"axis": 0}),
    ("Add", ["c"], [2, 3], {"c": np.zeros(3, np.float32)}, {}),
    ("Sub", ["c"], ["N", 3], {"c": np.zeros((1, 1), np.float32)}, {}),
    ("Mul", ["c"], [2, 3], {"c": np.float32(1)}, {}),
    ("Div", ["c"], [2, 3], {"c": np.ones((2, 3), np.float32)}, {}),
]


@pytest.mark.parametrize("op,inputs,shape,inits,attrs", NOOPS)
def test_noop_is_removed(op, inputs, shape, inits, attrs):
    check(_unary(op, inputs, shape, inits, **attrs), RemoveNoopOps(), True, op)


def test_add_zero_on_the_left_is_removed():
    nodes = [helper.make_node("Add", ["c", "x"], ["a"]), helper.make_node("Neg", ["a"], ["y"])]
    check(make_model(nodes, [("x", F, [2, 3])], [("y", F, [2, 3])], {"c": np.zeros(3, np.float32)}),
          RemoveNoopOps(), True, "Add")


NOT_NOOPS = [
    ("Reshape", ["s"], [2, 3], {"s": np.array([3, 2])}, {}),
    ("Reshape", ["s"], ["N", 3], {"s": np.array([0, 0])}, {"allowzero": 1}),
    ("Reshape", ["s"], ["N", "M"], {"s": np.array([-1, 3])}, {}),  # M unknown
    ("Expand", ["s"], [1, 3], {"s": np.array([2, 3])}, {}),
    ("Expand", ["s"], ["N", 3], {"s": np.array([2, 3])}, {}),  # N may be 1
    ("Expand", ["s"], [3], {"s": np.array([1, 3])}, {}),  # rank grows
    ("Transpose", [], [2, 3], {}, {"perm": [1, 0]}),
    ("Cast", [], [2, 3], {}, {"to": T.DOUBLE}),
    ("Slice", ["st", "en"], [2, 3], {"st": np.array([1]), "en": np.array([2])}, {}),
    ("Slice", ["st", "en"], ["N", 3], {"st": np.array([0]), "en": np.array([100])}, {}),  # N unknown
    ("Add", ["c"], [2, 3], {"c": np.zeros((2, 2, 3), np.float32)}, {}),  # broadcast adds a dim
    ("Add", ["c"], [1, 3], {"c": np.zeros((2, 3), np.float32)}, {}),  # broadcast grows a dim
    ("Add", ["c"], [2, 3], {"c": np.float32([0, 1, 0])}, {}),
    ("Mul", ["c"], [2, 3], {"c": np.zeros(3, np.float32)}, {}),
    ("Add", ["c"], [70_000], {"c": np.zeros(70_000, np.float32)}, {}),  # too big to read for a no-op check
]


@pytest.mark.parametrize("op,inputs,shape,inits,attrs", NOT_NOOPS)
def test_non_noop_is_refused(op, inputs, shape, inits, attrs):
    model = _unary(op, inputs, shape, inits, **attrs)
    out, n = apply(model, RemoveNoopOps())
    assert n == 0 and out.graph.node == model.graph.node  # untouched, so outputs are the original's


def test_sub_and_div_with_constant_on_the_left_are_refused():
    for op, c in (("Sub", np.zeros(3, np.float32)), ("Div", np.ones(3, np.float32))):
        model = make_model([helper.make_node(op, ["c", "x"], ["y"])], [("x", F, [2, 3])], [("y", F, [2, 3])], {"c": c})
        out, n = apply(model, RemoveNoopOps())
        assert n == 0 and out.graph.node == model.graph.node


def test_noop_feeding_output_from_input_is_refused():
    model = make_model([helper.make_node("Transpose", ["x"], ["y"], perm=[0, 1])], [("x", F, [2, 3])],
                       [("y", F, [2, 3])])
    check(model, RemoveNoopOps(), False, "Transpose")


def test_cast_between_float8_variants_is_not_a_noop():
    """gs maps float8e4m3fnuz to float8e4m3fn; the no-op check must not believe it."""
    nodes = [helper.make_node("Cast", ["x"], ["a"], to=T.FLOAT8E4M3FNUZ),
             helper.make_node("Cast", ["a"], ["b"], to=T.FLOAT8E4M3FN), helper.make_node("Cast", ["b"], ["y"], to=F)]
    model = make_model(nodes, [("x", F, [4])], [("y", F, [4])], opset=21)
    graph = gs.import_onnx(model)
    graph.nodes[0].outputs[0].dtype = helper.tensor_dtype_to_np_dtype(T.FLOAT8E4M3FNUZ)  # as a shape refresh sets it
    assert PassManager([RemoveNoopOps()]).run(graph, PassContext(opset=21)) == 0


def test_big_neutral_candidates_are_never_read(monkeypatch):
    """Add/Mul constants are sized up before any read: an 800 MB weight once cost 1.3 GB of peak memory.
    Also for a Constant node's value (its output tensor may have no known shape)."""
    import k3opt.passes.cleanup.remove_noop_ops as noop

    read = []
    value = noop.small_const_value
    monkeypatch.setattr(noop, "small_const_value", lambda c: read.append(c.name) or value(c))
    big = helper.make_tensor("big", F, [70_000], np.zeros(70_000, np.float32).tobytes(), raw=True)
    nodes = [helper.make_node("Constant", [], ["k"], value=big), helper.make_node("Add", ["x", "k"], ["a"]),
             helper.make_node("Mul", ["a", "w"], ["y"])]
    model = make_model(nodes, [("x", F, [70_000])], [("y", F, [70_000])], {"w": np.ones(70_000, np.float32)})
    graph = gs.import_onnx(model)
    assert RemoveNoopOps().run(graph, PassContext(opset=17)) == 0 and read == []


def test_candidates_cover_every_body_in_all_graphs_order():
    """The clean-ups' scan (list comprehensions, bodies looked for only in nodes with attributes) lists the
    graphs ``ir.all_graphs`` yields, in its order, each with its Identity nodes in node order.
    """
    def body(name: str, inner: list) -> onnx.GraphProto:
        nodes = [helper.make_node("Identity", ["x"], [f"{name}_i"]), helper.make_node("Relu", [f"{name}_i"], [f"{name}_y"])]
        return helper.make_graph(nodes + inner, name, [], [helper.make_tensor_value_info(f"{name}_y", F, [2])])

    inner_if = helper.make_node("If", ["c"], ["n_y"], then_branch=body("t2", []), else_branch=body("e2", []))
    nodes = [helper.make_node("Identity", ["x"], ["a"]),
             helper.make_node("If", ["c"], ["b"], then_branch=body("t1", [inner_if]), else_branch=body("e1", [])),
             helper.make_node("Identity", ["b"], ["d"])]
    model = make_model(nodes, [("x", F, [2]), ("c", T.BOOL, [])], [("a", F, [2]), ("d", F, [2])])
    graph = gs.import_onnx(model)
    found = RemoveIdentity()._candidates(graph, PassContext(opset=17))
    assert [id(g) for g, _ in found] == [id(g) for g in ir.all_graphs(graph)] and len(found) == 5
    assert all([id(n) for n in nodes] == [id(n) for n in g.nodes if n.op == "Identity"] for g, nodes in found)


def test_detach_unlinks_exactly_that_node_by_identity(monkeypatch):
    """detach: a node reading a tensor twice leaves its reader list entirely, look-alikes stay, bodies go too."""
    from k3opt.passes._rewire import detach

    x = gs.Variable("x", dtype=np.float32, shape=[2])
    first = gs.Node("Relu", "twin", inputs=[x], outputs=[gs.Variable("a")])
    twice = gs.Node("Add", "add", inputs=[x, x], outputs=[gs.Variable("b")])
    twin = gs.Node("Relu", "twin", inputs=[x], outputs=[gs.Variable("a")])  # first's look-alike
    inner = gs.Node("Neg", "inner", inputs=[x], outputs=[gs.Variable("n")])
    body = gs.Graph(nodes=[inner], outputs=[inner.outputs[0]])
    holder = gs.Node("If", "if", attrs={"then_branch": body, "else_branch": body},
                     inputs=[gs.Variable("c", dtype=bool, shape=[])], outputs=[gs.Variable("y")])
    monkeypatch.setattr(gs.Node, "__eq__", lambda self, other: pytest.fail("structural Node.__eq__ used"))
    dead: list = []
    detach(twice, dead)
    detach(twin, dead)
    detach(holder, dead)
    assert [n.name for n in x.outputs] == ["twin"] and x.outputs[0] is first
    assert dead == [twice, twin, holder]
    assert all(not n.inputs and not n.outputs for n in (twice, twin, holder, inner))
