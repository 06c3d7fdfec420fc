"""All-or-nothing rewrites, broken rules (raising, invalid), rules as registered passes, and the debug mode."""
from __future__ import annotations

import logging
import re

import numpy as np
import onnx
import onnx.reference
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto as TP
from onnx import helper

from k3opt.errors import PluginError, UsageError
from k3opt.pipeline.pass_base import PassContext, unregister_pass
from k3opt.plugins import build_pipeline, registered_passes
from k3opt.pipeline.manager import PassManager
from k3opt.patterns import Rule, RuleError, RuleSetPass, register_rules, rule, rules_pass
from tests.helpers import assert_equivalent, export_graph, import_graph, make_model, op_counts, run_passes

F = TP.FLOAT


def relu_chain(n: int = 2) -> onnx.ModelProto:
    """x -> Neg -> Relu -> Neg -> Relu ... (n Neg/Relu pairs), each pair a match site."""
    nodes = []
    for i in range(n):
        nodes += [helper.make_node("Neg", [f"t{2 * i}"], [f"t{2 * i + 1}"]),
                  helper.make_node("Relu", [f"t{2 * i + 1}"], [f"t{2 * i + 2}"])]
    return make_model(nodes, [("t0", F, [4])], [(f"t{2 * n}", F, [4])])


def relu_neg(op, x):
    return op.Relu(op.Neg(x, _name="neg"))


def run_graph(model: onnx.ModelProto, p) -> tuple[gs.Graph, PassManager]:
    graph = gs.import_onnx(model)
    pm = PassManager([p])
    pm.run(graph, PassContext(opset=17))
    return graph, pm


def snapshot(graph: gs.Graph) -> list:
    """Everything a rewrite could disturb: nodes with their inputs/outputs, and every tensor's consumers."""
    nodes = [(n.name, n.op, [t.name for t in n.inputs], [t.name for t in n.outputs]) for n in graph.nodes]
    uses = sorted((name, sorted(c.name for c in t.outputs)) for name, t in graph.tensors().items())
    return [nodes, uses, [t.name for t in graph.outputs]]


def _raise_after_staging(op, m):
    op.Min(m["x"], 0.0)
    raise ValueError("boom")


@pytest.mark.parametrize("rewrite,message", [
    (_raise_after_staging, "rewrite raised ValueError: boom"),
    (lambda op, m: op.NotAnOp(m["x"]), "NotAnOp is not an ONNX operator"),
    (lambda op, m: op.Relu(m["x"], alpha=1.0), "has no attribute 'alpha'"),
    (lambda op, m: op.Relu(m["x"], m["x"]), "takes 1..1 inputs"),
    (lambda op, m: (op.Relu(m["x"]), op.Relu(m["x"])), "returned 2 value(s) for 1"),
    (lambda op, m: "x", "not a tensor"),
    (lambda op, m: m.outputs[0], "returned the value it replaces"),
])
def test_broken_rewrite_names_rule_and_leaves_graph_untouched(rewrite, message):
    graph = gs.import_onnx(relu_chain(1))
    before = snapshot(graph)
    with pytest.raises(RuleError, match="rule 'broken'.*" + re.escape(message)):
        PassManager([RuleSetPass([Rule("broken", relu_neg, rewrite)], name="p")]).run(graph, PassContext(opset=17))
    assert snapshot(graph) == before


def test_check_that_raises_is_reported():
    def check(m):
        raise KeyError("w")

    with pytest.raises(RuleError, match="rule 'c': check raised KeyError"):
        run_graph(relu_chain(1), RuleSetPass([Rule("c", relu_neg, lambda op, m: op.Neg(m["x"]), check)], name="p"))


def test_earlier_rewrites_of_a_failing_run_stay_valid():
    calls = []

    def rewrite(op, m):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("second site")
        return op.Neg(op.Min(m["x"], 0.0))  # relu(-x) == -min(x, 0)

    model = relu_chain(2)
    graph = import_graph(model)
    with pytest.raises(RuleError):
        PassManager([RuleSetPass([Rule("r", relu_neg, rewrite)], name="p")]).run(graph, PassContext(opset=17))
    out = export_graph(graph, model)
    onnx.checker.check_model(out)
    assert op_counts(out) == {"Min": 1, "Neg": 2, "Relu": 1}
    assert_equivalent(model, out)


def test_rewrite_returning_none_declines():
    graph, pm = run_graph(relu_chain(1), RuleSetPass([Rule("n", relu_neg, lambda op, m: None)], name="p"))
    assert pm.stats["p"].rewrites == 0 and [n.op for n in graph.nodes] == ["Neg", "Relu"]


def test_plugin_rule_failure_is_plugin_error_naming_plugin_and_rule():
    cls = rules_pass("plug-rules", [Rule("bad", relu_neg, _raise_after_staging)], register=False, plugin="acme")
    with pytest.raises(PluginError, match="plugin 'acme', pass 'plug-rules', rule 'bad'"):
        run_graph(relu_chain(1), cls())


# --- rules registered as passes ----------------------------------------------------------------------

NEG_RELU = Rule("neg-relu", relu_neg, lambda op, m: op.Neg(op.Min(m["x"], 0.0)), description="relu(-x) as -min(x,0)")


@pytest.fixture
def cleanup_registry():
    before = set(registered_passes())
    yield
    for name in set(registered_passes()) - before:
        unregister_pass(name)


def test_rules_pass_registers_and_runs_in_pipeline(cleanup_registry):
    cls = rules_pass("t-neg-relu", [NEG_RELU], order=1500)
    assert registered_passes()["t-neg-relu"] is cls and cls.description == "relu(-x) as -min(x,0)"
    pipeline = build_pipeline(passes=["t-neg-relu"])
    out, pm, _ = run_passes(relu_chain(3), pipeline)
    assert pm.stats["t-neg-relu"].rewrites == 3 and "Relu" not in op_counts(out)
    assert_equivalent(relu_chain(3), out)
    assert "t-neg-relu" not in [p.name for p in build_pipeline(skip=["t-neg-relu"])]


def test_register_rules_and_decorator(cleanup_registry):
    register_rules(NEG_RELU, name="t-set")

    @rule(pass_name="t-set")
    class DoubleNeg:
        """-(-x) is x."""

        def pattern(op, x):
            return op.Neg(op.Neg(x))

        def rewrite(op, m):
            return op.Identity(m["x"])

    cls = registered_passes()["t-set"]
    assert [r.name for r in cls.rules] == ["neg-relu", "double-neg"] and DoubleNeg.description == "-(-x) is x."

    @rule(after="t-set")
    class ReluRelu:
        def pattern(op, x):
            return op.Relu(op.Relu(x))

        def rewrite(op, m):
            return op.Relu(m["x"])

    names = list(registered_passes())
    assert names.index("relu-relu") == names.index("t-set") + 1


# --- debug mode -----------------------------------------------------------------------------------------

MINUS = Rule("minus", lambda op, x: op.Relu(op.Neg(x, _name="neg"), _name="relu"), lambda op, m: op.Neg(m["x"]),
             check=lambda m: m.fail("never"))


def test_debug_env_var_explains_closest_candidate(monkeypatch, caplog):
    monkeypatch.setenv("K3OPT_DEBUG_RULES", "other,minus")
    model = make_model([helper.make_node("Abs", ["x"], ["a"], name="abs0"),
                        helper.make_node("Relu", ["a"], ["r"], name="relu0"),
                        helper.make_node("Neg", ["x"], ["n"], name="neg1"),
                        helper.make_node("Relu", ["n"], ["y"], name="relu1")],
                       [("x", F, [4])], [("y", F, [4]), ("r", F, [4])])
    with caplog.at_level(logging.WARNING, logger="k3opt.patterns"):
        _, _, ctx = run_passes(model, [RuleSetPass([MINUS], name="p")])
    note = next(n for n in ctx.notes if "minus" in n)
    assert "closest at node 'relu1' (Relu): pattern matched, then refused: check declined: never" in note
    assert note in caplog.text


def test_debug_flag_reports_missing_anchor_and_structural_failure():
    model = make_model([helper.make_node("Abs", ["x"], ["a"], name="abs0"),
                        helper.make_node("Relu", ["a"], ["y"], name="relu0")], [("x", F, [4])], [("y", F, [4])])
    rule_ = Rule("dbg", relu_neg, lambda op, m: op.Neg(m["x"]), debug=True)
    _, _, ctx = run_passes(model, [RuleSetPass([rule_], name="p")])
    assert any("node 'abs0' (Abs): expected op Neg" in n for n in ctx.notes)
    no_anchor = Rule("dbg2", lambda op, x: op.Gelu(x), lambda op, m: m["x"], debug=True)
    _, _, ctx = run_passes(model, [RuleSetPass([no_anchor], name="p")])
    assert ctx.notes == ["rule 'dbg2': no candidate: no Gelu node in the graph"]


def test_number_in_rewrite_takes_the_dtype_of_the_other_inputs():
    model = make_model([helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Relu", ["n"], ["y"])],
                       [("x", TP.FLOAT16, [4])], [("y", TP.FLOAT16, [4])])
    out, _, _ = run_passes(model, [RuleSetPass([NEG_RELU], name="p")])
    onnx.checker.check_model(out, full_check=True)
    assert out.graph.initializer[0].data_type == TP.FLOAT16
    assert_equivalent(model, out, rtol=1e-3, atol=1e-3)


def test_number_in_rewrite_takes_a_type_numpy_lacks():
    """gs keeps bfloat16 (a type numpy lacks) as an ONNX enum: the constant still gets it (it came out float32)."""
    elem_type = TP.BFLOAT16
    twice = Rule("twice", lambda op, x: op.Add(x, x), lambda op, m: op.Mul(m["x"], 2.0))
    model = make_model([helper.make_node("Add", ["x", "x"], ["y"])], [("x", elem_type, [4])], [("y", elem_type, [4])],
                       opset=21)
    out, _, _ = run_passes(model, [RuleSetPass([twice], name="p")])
    onnx.checker.check_model(out, full_check=True)
    assert op_counts(out) == {"Mul": 1} and out.graph.initializer[0].data_type == elem_type
    x = onnx.numpy_helper.to_array(helper.make_tensor("x", elem_type, [4], [0.5, -1.0, 2.0, 3.0]))
    ref = onnx.reference.ReferenceEvaluator
    np.testing.assert_array_equal(ref(out).run(None, {"x": x})[0].astype(np.float32),
                                  ref(model).run(None, {"x": x})[0].astype(np.float32))


def test_debug_is_silent_once_the_rule_has_matched_and_counts_matches(monkeypatch):
    monkeypatch.setenv("K3OPT_DEBUG_RULES", "all")
    _, pm, ctx = run_passes(relu_chain(2), [RuleSetPass([NEG_RELU], name="p")])
    assert pm.rounds == 2 and ctx.counters["rule:neg-relu"] == 2 and not ctx.notes


def test_match_api():
    seen = {}

    def check(m):
        seen.update(x=m["x"].name, has=("x" in m, "nope" in m), get=m.get("nope", 7), neg=m.node("neg").op,
                    nodes=sorted(n.op for n in m.nodes), outputs=[t.name for t in m.outputs],
                    const=m.const("x"), is_const=m.is_const("x"), shape=m.shape("x"), rank=m.rank("x"))
        with pytest.raises(KeyError, match="bound: \\['x'\\]"):
            m["nope"]
        with pytest.raises(KeyError, match="labels: \\['neg'\\]"):
            m.node("nope")
        return True

    run_graph(relu_chain(1), RuleSetPass([Rule("api", relu_neg, lambda op, m: None, check)], name="p"))
    assert seen == dict(x="t0", has=(True, False), get=7, neg="Neg", nodes=["Neg", "Relu"], outputs=["t2"],
                        const=None, is_const=False, shape=(4,), rank=1)


def test_register_rules_never_extends_a_pass_it_did_not_make(cleanup_registry):
    rules_pass("t-builtin-like", [NEG_RELU])
    with pytest.raises(UsageError, match="already registered"):
        register_rules(NEG_RELU, name="t-builtin-like")


def _body(name: str, inner: list) -> onnx.GraphProto:
    """A one-output body computing Relu of an outer tensor, plus ``inner`` nodes."""
    return helper.make_graph([helper.make_node("Relu", ["x"], [f"{name}_y"])] + inner, name, [],
                             [helper.make_tensor_value_info(f"{name}_y", TP.FLOAT, [2])])


def test_bodies_are_gs_subgraphs_in_gs_order():
    """``bodies`` (which skips nodes without a body) yields what gs's recursive subgraphs yields, in its order."""
    from k3opt.patterns.rule_pass import bodies

    nested_if = helper.make_node("If", ["c"], ["n_y"], then_branch=_body("t2", []), else_branch=_body("e2", []))
    deep_if = helper.make_node("If", ["c"], ["d_y"], then_branch=_body("t3", [nested_if]), else_branch=_body("e3", []))
    nodes = [helper.make_node("Relu", ["x"], ["a"]),
             helper.make_node("If", ["c"], ["b"], then_branch=_body("t1", [deep_if]), else_branch=_body("e1", [])),
             helper.make_node("If", ["c"], ["d"], then_branch=_body("t4", []), else_branch=_body("e4", [nested_if]))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, [2]),
                                           helper.make_tensor_value_info("c", TP.BOOL, [])],
                              [helper.make_tensor_value_info(n, TP.FLOAT, [2]) for n in ("a", "b", "d")])
    g = gs.import_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    expected = list(g.subgraphs(recursive=True))
    assert len(expected) == 10 and {b.name for b in expected} == {"t1", "e1", "t2", "e2", "t3", "e3", "t4", "e4"}
    assert [id(b) for b in bodies(g)] == [id(b) for b in expected]


def test_ordered_sweeps_see_the_nodes_earlier_sweeps_created():
    """apply_rules shares its anchor scan between sweeps only until one rewrites: a later rule anchors
    at nodes an earlier one created, and a rule that rewrote nothing leaves the scan valid for the next.
    """
    from k3opt.graph.ir import NameScope
    from k3opt.patterns import apply_rules

    to_neg = Rule("relu-to-neg", lambda op, x: op.Relu(x), lambda op, m: op.Neg(m["x"]))
    never = Rule("never", lambda op, x: op.Neg(op.Sigmoid(x)), lambda op, m: op.Sigmoid(m["x"]))
    to_abs = Rule("neg-to-abs", lambda op, x: op.Neg(x), lambda op, m: op.Abs(m["x"]))
    graph = gs.import_onnx(relu_chain(3))  # Neg, Relu (x3): 3 Relus become Negs, then all 6 Negs Abs
    assert apply_rules(graph, PassContext(opset=17, names=NameScope(graph)), [to_neg, never, to_abs], bodies=True) == 9
    assert [n.op for n in graph.nodes] == ["Abs"] * 6


def test_matched_nodes_are_unlinked_by_identity(monkeypatch):
    """Detaching a matched node never looks for it with gs's structural ``Node.__eq__`` (slow on a tensor
    with many readers; could unlink a look-alike)."""
    model = make_model([helper.make_node("Sigmoid", ["x"], ["s"]),  # x's first reader: not in the match
                        helper.make_node("Neg", ["x"], ["n"]),
                        helper.make_node("Relu", ["n"], ["r"])],
                       [("x", F, [4])], [("s", F, [4]), ("r", F, [4])])

    def no_structural_compare(self, other):
        raise AssertionError("Node.__eq__ used to unlink a node")

    monkeypatch.setattr(gs.Node, "__eq__", no_structural_compare)
    p = rules_pass("neg-relu-to-min", [Rule("neg-relu", relu_neg, lambda op, m: op.Neg(op.Min(m["x"], 0.0)))],
                   register=False)()
    out, pm, _ = run_passes(model, [p])
    assert op_counts(out) == {"Sigmoid": 1, "Min": 1, "Neg": 1}
    monkeypatch.undo()
    assert_equivalent(model, out)
