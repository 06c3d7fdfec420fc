"""Matcher semantics of k3opt.patterns on hand-made graphs: every variant and every refusal, checked numerically."""
from __future__ import annotations

import time

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto as TP
from onnx import helper

from k3opt.patterns import Rule, RuleSetPass, explain
from k3opt.patterns.matcher import Matcher
from tests.helpers import assert_equivalent, make_model, op_counts, run_passes

F = TP.FLOAT
node = helper.make_node


def apply(model: onnx.ModelProto, *rules: Rule) -> tuple[onnx.ModelProto, int]:
    """Run the rules as one pass; returns the optimized model (checked equivalent) and the rewrite count."""
    out, pm, _ = run_passes(model, [RuleSetPass(list(rules), name="test-rules")])
    onnx.checker.check_model(out)
    assert_equivalent(model, out)
    return out, pm.stats["test-rules"].rewrites


# --- rules used below -------------------------------------------------------------------------

def _gemm_pattern(op, x, w, b):
    return op.Add(op.MatMul(x, w, _name="mm"), b)


def _gemm_check(m):
    if not m.is_const("w"):
        return m.fail("weight is not constant")
    if m.rank("x") != 2 or m.shape("b") is None or len(m.shape("b")) > 1:
        return m.fail("needs a 2-D input and a 1-D bias")
    return True


def _gemm_rewrite(op, m):
    return op.Gemm(m["x"], m["w"], m["b"])


GEMM = Rule("gemm", _gemm_pattern, _gemm_rewrite, check=_gemm_check)
DOUBLE = Rule("double", lambda op, x: op.Mul(x, op.Constant(2.0)), lambda op, m: op.Add(m["x"], m["x"]))


def _square_pattern(op, x):
    return op.Or(op.Pow(x, 2.0), op.Mul(x, x), _name="sq")


SQUARE_TO_ABS_MUL = Rule("square", lambda op, x: op.Sqrt(_square_pattern(op, x)), lambda op, m: op.Abs(m["x"]))


def gemm_model(add_inputs=("mm", "b"), extra_nodes=(), extra_outputs=()):
    nodes = [node("MatMul", ["x", "w"], ["mm"]), node("Add", list(add_inputs), ["y"]), *extra_nodes]
    outputs = [("y", F, [3, 5]), *extra_outputs]
    inits = {"w": np.random.default_rng(1).standard_normal((4, 5)).astype(np.float32),
             "b": np.arange(5, dtype=np.float32)}
    return make_model(nodes, [("x", F, [3, 4])], outputs, inits)


# --- basic matching and operand order -----------------------------------------------------------

@pytest.mark.parametrize("order", [("mm", "b"), ("b", "mm")])
def test_commutative_operand_orders(order):
    out, n = apply(gemm_model(order), GEMM)
    assert n == 1 and op_counts(out) == {"Gemm": 1}


def test_check_refuses_non_constant_weight():
    model = make_model([node("MatMul", ["x", "w"], ["mm"]), node("Add", ["mm", "b"], ["y"])],
                       [("x", F, [3, 4]), ("w", F, [4, 5]), ("b", F, [5])], [("y", F, [3, 5])])
    out, n = apply(model, GEMM)
    assert n == 0 and op_counts(out) == {"MatMul": 1, "Add": 1}
    assert "weight is not constant" in explain(GEMM, model)[0]


def test_shared_intermediate_refused():
    model = gemm_model(extra_nodes=[node("Relu", ["mm"], ["r"])], extra_outputs=[("r", F, [3, 5])])
    out, n = apply(model, GEMM)
    assert n == 0 and "MatMul" in op_counts(out)
    assert "also used by node" in explain(GEMM, model)[0]


def test_intermediate_graph_output_refused():
    model = gemm_model(extra_outputs=[("mm", F, [3, 5])])
    out, n = apply(model, GEMM)
    assert n == 0 and "MatMul" in op_counts(out)
    assert "graph output" in explain(GEMM, model)[0]


def test_allow_escaping_keeps_shared_intermediate():
    rule = Rule("gemm-esc", _gemm_pattern, _gemm_rewrite, check=_gemm_check, allow_escaping=True)
    model = gemm_model(extra_nodes=[node("Relu", ["mm"], ["r"])], extra_outputs=[("r", F, [3, 5])])
    out, n = apply(model, rule)
    assert n == 1 and op_counts(out) == {"MatMul": 1, "Relu": 1, "Gemm": 1}


# --- constants by value ----------------------------------------------------------------------------

def _mul_model(const_value, as_node=False, first=False, shape=()):
    c = np.full(shape, const_value, dtype=np.float32)
    ins = ["c", "x"] if first else ["x", "c"]
    nodes = [node("Mul", ins, ["y"])]
    inits = {"c": c}
    if as_node:
        nodes.insert(0, node("Constant", [], ["c"], value=onnx.numpy_helper.from_array(c)))
        inits = {}
    return make_model(nodes, [("x", F, [2, 3])], [("y", F, [2, 3])], inits)


@pytest.mark.parametrize("as_node", [False, True])
@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("shape", [(), (1,)])
def test_constant_by_value_initializer_or_node_either_order(as_node, first, shape):
    out, n = apply(_mul_model(2.0, as_node, first, shape), DOUBLE)
    assert n == 1 and op_counts(out) == {"Add": 1}


def test_wrong_constant_refused():
    model = _mul_model(3.0)
    out, n = apply(model, DOUBLE)
    assert n == 0 and op_counts(out) == {"Mul": 1}
    assert "1 pattern node(s) matched, then: constant 'c' is 3, expected 2" in explain(DOUBLE, model)[0]


def test_scalar_constant_that_would_broadcast_rank_refused():
    model = make_model([node("Mul", ["x", "c"], ["y"])], [("x", F, [3])], [("y", F, [1, 3])],
                       {"c": np.full((1, 1), 2.0, np.float32)})
    assert apply(model, DOUBLE)[1] == 0


def test_number_in_pattern_is_a_constant_and_any_constant():
    rule = Rule("any", lambda op, x: op.Sub(x, op.AnyConstant("k")), lambda op, m: op.Add(m["x"], op.Neg(m["k"])))
    out, n = apply(_sub_model(const=True), rule)
    assert n == 1 and op_counts(out) == {"Add": 1, "Neg": 1}
    assert apply(_sub_model(const=False), rule)[1] == 0


def _sub_model(const):
    inputs = [("x", F, [2, 3])] + ([] if const else [("k", F, [3])])
    inits = {"k": np.arange(3, dtype=np.float32)} if const else {}
    return make_model([node("Sub", ["x", "k"], ["y"])], inputs, [("y", F, [2, 3])], inits)


# --- attributes with schema defaults ----------------------------------------------------------------

def _reduce_model(**attrs):
    return make_model([node("ReduceMean", ["x"], ["y"], axes=[-1], **attrs)], [("x", F, [2, 3])],
                      [("y", F, [2] if attrs.get("keepdims") == 0 else [2, 1])], opset=17)


MEAN_KEEP = Rule("mean-keep", lambda op, x: op.ReduceMean(x, keepdims=1, axes=[-1]),
                 lambda op, m: op.ReduceMean(m["x"], axes=[1], keepdims=1))


@pytest.mark.parametrize("attrs,matches", [({}, True), ({"keepdims": 1}, True), ({"keepdims": 0}, False)])
def test_attribute_defaults_filled_from_schema(attrs, matches):
    model = _reduce_model(**attrs)
    out, n = apply(model, MEAN_KEEP)
    assert n == int(matches)
    if not matches:
        assert "attribute keepdims=0, expected 1" in explain(MEAN_KEEP, model)[0]


def test_float_attribute_compared_with_float32_rounding():
    rule = Rule("leaky", lambda op, x: op.LeakyRelu(x, alpha=0.01), lambda op, m: op.Max(m["x"], op.Mul(m["x"], 0.01)))
    model = make_model([node("LeakyRelu", ["x"], ["y"])], [("x", F, [4])], [("y", F, [4])])  # default 0.01
    assert apply(model, rule)[1] == 1
    model = make_model([node("LeakyRelu", ["x"], ["y"], alpha=0.2)], [("x", F, [4])], [("y", F, [4])])
    assert apply(model, rule)[1] == 0


def test_attribute_predicate():
    rule = Rule("last", lambda op, x: op.Softmax(x, axis=lambda a: a in (-1, 1)), lambda op, m: op.Identity(m["x"]))
    for axis, hits in ((1, 1), (-1, 1), (0, 0)):
        model = make_model([node("Softmax", ["x"], ["y"], axis=axis)], [("x", F, [2, 3])], [("y", F, [2, 3])])
        assert explain(rule, model)[0].startswith("rule 'last': matches" if hits else "rule 'last': no match")


# --- alternatives, variable consistency, DAG patterns ------------------------------------------------

def test_which_of_an_or_the_match_did_not_take_is_unknown():
    """An inner Or tried in an alternative that failed later is no part of the match: which() must not answer."""
    seen = []

    def pattern(op, x, z):
        inner = op.Or(op.Relu(x), op.Sigmoid(x), _name="inner")
        return op.Sub(op.Or(op.Neg(inner), op.Neg(z), _name="outer"), x)

    def check(m):
        seen.append(m.which("outer"))
        with pytest.raises(KeyError):
            m.which("inner")
        return True

    rule = Rule("nested", pattern, lambda op, m: op.Neg(op.Add(m["z"], m["x"])), check=check)
    model = make_model([node("Relu", ["a"], ["r"]), node("Neg", ["r"], ["n"]), node("Sub", ["n", "b"], ["y"])],
                       [("a", F, [5]), ("b", F, [5])], [("y", F, [5])])
    assert apply(model, rule)[1] == 1 and seen == [1]


@pytest.mark.parametrize("inner", ["pow", "mul"])
def test_or_alternatives_and_which(inner):
    seen = []

    def check(m):
        seen.append(m.which("sq"))
        return True

    rule = Rule("square", lambda op, x: op.Sqrt(_square_pattern(op, x)), lambda op, m: op.Abs(m["x"]), check=check)
    inits = {"two": np.array(2.0, np.float32)}
    first = node("Pow", ["x", "two"], ["s"]) if inner == "pow" else node("Mul", ["x", "x"], ["s"])
    model = make_model([first, node("Sqrt", ["s"], ["y"])], [("x", F, [5])], [("y", F, [5])], inits)
    out, n = apply(model, rule)
    assert n == 1 and op_counts(out) == {"Abs": 1} and seen == [0 if inner == "pow" else 1]


@pytest.mark.parametrize("first", ["Pow", "Mul"])
def test_named_alternatives_answer_their_name_and_get_node_the_one_taken(first):
    """``op.Or(name=..., ...)``: ``m.which`` answers the name; ``m.get_node`` is None for a labelled node of the
    alternative not taken (``m.node`` raises for it)."""
    seen = []

    def pattern(op, x):
        return op.Sqrt(op.Or(power=op.Pow(x, 2.0, _name="pow"), product=op.Mul(x, x, _name="mul"), _name="sq"))

    def check(m):
        seen.append((m.which("sq"), m.get_node("pow") is not None, m.get_node("mul") is not None))
        return True

    rule = Rule("named", pattern, lambda op, m: op.Abs(m["x"]), check=check)
    inits = {"two": np.array(2.0, np.float32)}
    made = node("Pow", ["x", "two"], ["s"]) if first == "Pow" else node("Mul", ["x", "x"], ["s"])
    model = make_model([made, node("Sqrt", ["s"], ["y"])], [("x", F, [5])], [("y", F, [5])], inits)
    assert apply(model, rule)[1] == 1
    assert seen == [("power", True, False)] if first == "Pow" else [("product", False, True)]


@pytest.mark.parametrize("call,message", [
    (lambda op, x: op.Or(op.Neg(x), b=op.Abs(x), _name="k"), "all positional or all named"),
    (lambda op, x: op.Or(a=op.Neg(x), b=op.Abs(x)), "needs _name="),
])
def test_named_alternatives_are_all_named_and_the_or_is_named(call, message):
    from k3opt.patterns import PatternError, PatternBuilder

    with pytest.raises(PatternError, match=message):
        call(PatternBuilder(), PatternBuilder().Var("x"))


def test_same_variable_must_be_same_tensor():
    model = make_model([node("Mul", ["x", "z"], ["s"]), node("Sqrt", ["s"], ["y"])],
                       [("x", F, [5]), ("z", F, [5])], [("y", F, [5])])
    assert apply(model, SQUARE_TO_ABS_MUL)[1] == 0
    assert "bound to" in explain(SQUARE_TO_ABS_MUL, model)[0]


def _centered_square(op, x):
    d = op.Sub(x, op.ReduceMean(x, axes=[-1]))
    return op.Mul(d, d)


def test_pattern_dag_reuses_one_node():
    rule = Rule("csq", _centered_square, lambda op, m: op.Pow(m["x"], 2.0), check=lambda m: False)
    shared = make_model([node("ReduceMean", ["x"], ["m"], axes=[-1]), node("Sub", ["x", "m"], ["d"]),
                         node("Mul", ["d", "d"], ["y"])], [("x", F, [2, 3])], [("y", F, [2, 3])])
    two_subs = make_model([node("ReduceMean", ["x"], ["m"], axes=[-1]), node("Sub", ["x", "m"], ["d"]),
                           node("Sub", ["x", "m"], ["e"]), node("Mul", ["d", "e"], ["y"])],
                          [("x", F, [2, 3])], [("y", F, [2, 3])])
    assert "check returned False" in explain(rule, shared)[0]
    assert "already matched" in explain(rule, two_subs)[0]


def test_multi_output_pattern():
    def pattern(op, x):
        s = op.Sigmoid(x, _name="sig")
        return op.Mul(x, s), s

    def rewrite(op, m):
        return op.Div(m["x"], op.Add(op.Exp(op.Neg(m["x"])), 1.0)), op.Sigmoid(m["x"])

    rule = Rule("silu2", pattern, rewrite)
    model = make_model([node("Sigmoid", ["x"], ["s"]), node("Mul", ["s", "x"], ["y"]), node("Relu", ["s"], ["r"])],
                       [("x", F, [4])], [("y", F, [4]), ("r", F, [4])])
    out, n = apply(model, rule)
    assert n == 1 and op_counts(out) == {"Div": 1, "Add": 1, "Exp": 1, "Neg": 1, "Sigmoid": 1, "Relu": 1}


def test_rewrite_returning_an_input_keeps_output_name():
    rule = Rule("add0", lambda op, x: op.Add(x, 0.0), lambda op, m: m["x"])
    model = make_model([node("Add", ["x", "z"], ["y"])], [("x", F, [4])], [("y", F, [4])],
                       {"z": np.zeros((1,), np.float32)})
    out, n = apply(model, rule)
    assert n == 1 and op_counts(out) == {"Identity": 1}
    assert [o.name for o in out.graph.output] == ["y"] and [i.name for i in out.graph.input] == ["x"]


def test_chain_rewritten_to_fixed_point():
    relu2 = Rule("relu2", lambda op, x: op.Relu(op.Relu(x)), lambda op, m: op.Relu(m["x"]))
    nodes = [node("Relu", [f"t{i}"], [f"t{i + 1}"]) for i in range(6)]
    model = make_model(nodes, [("t0", F, [4])], [("t6", F, [4])])
    out, _ = apply(model, relu2)
    assert op_counts(out) == {"Relu": 1}


def test_optional_inputs_and_absent_pattern_inputs():
    rule = Rule("clip-hi", lambda op, x, hi: op.Clip(x, None, hi), lambda op, m: op.Min(m["x"], m["hi"]))
    hi = {"hi": np.array(0.5, np.float32)}
    model = make_model([node("Clip", ["x", "", "hi"], ["y"])], [("x", F, [4])], [("y", F, [4])], hi)
    assert apply(model, rule)[1] == 1
    model = make_model([node("Clip", ["x", "hi", "hi"], ["y"])], [("x", F, [4])], [("y", F, [4])], hi)
    assert apply(model, rule)[1] == 0


# --- no exponential blow-up ------------------------------------------------------------------------

def _add_tree(op, leaves):
    while len(leaves) > 1:
        leaves = [op.Add(a, b) for a, b in zip(leaves[::2], leaves[1::2])]
    return leaves[0]


@pytest.mark.parametrize("leaf,hits", [(1.0, 1), (2.0, 0)])
def test_commutative_tree_is_not_exponential(leaf, hits):
    depth = 4  # 15 commutative nodes: naive operand-order enumeration is 2**15 tries per anchor

    def pattern(op):
        vs = [op.Var(f"v{i}") for i in range(2 ** depth - 1)]
        return _add_tree(op, vs + [op.Constant(1.0)])

    rule = Rule("tree", pattern, lambda op, m: op.Sum(*[m[f"v{i}"] for i in range(2 ** depth - 1)], op.const(1.0)))
    names = [f"x{i}" for i in range(2 ** depth - 1)]
    nodes, level, k = [], names + ["c"], 0
    while len(level) > 1:
        nxt = []
        for a, b in zip(level[::2], level[1::2]):
            nodes.append(node("Add", [b, a], [f"a{k}"]))  # operands swapped everywhere
            nxt.append(f"a{k}")
            k += 1
        level = nxt
    model = make_model(nodes, [(n, F, [2]) for n in names], [(level[0], F, [2])], {"c": np.array([leaf], np.float32)})
    graph = gs.import_onnx(model)
    matcher = Matcher(rule.pattern, 17)
    first = next(matcher.matches(graph.outputs[0]), None)  # the applier takes the first match its check accepts
    assert (first is not None) == bool(hits)
    assert matcher._steps < 2000  # pattern nodes x graph nodes x 2 orders, not 2**15
    t0 = time.perf_counter()
    out, n = apply(model, rule)
    assert time.perf_counter() - t0 < 5
    assert n == hits


def test_rules_apply_inside_control_flow_subgraphs():
    relu2 = Rule("relu2", lambda op, x: op.Relu(op.Relu(x)), lambda op, m: op.Relu(m["x"]))
    then = helper.make_graph([node("Relu", ["x"], ["a"]), node("Relu", ["a"], ["b"])], "then", [],
                             [helper.make_tensor_value_info("b", F, [4])])
    other = helper.make_graph([node("Neg", ["x"], ["c"])], "else", [], [helper.make_tensor_value_info("c", F, [4])])
    model = make_model([node("ReduceSum", ["x"], ["s"], keepdims=0), node("Greater", ["s", "zero"], ["cond"]),
                        node("If", ["cond"], ["y"], then_branch=then, else_branch=other)],
                       [("x", F, [4])], [("y", F, [4])], {"zero": np.array(0.0, np.float32)})
    out, n = apply(model, relu2)
    assert n == 1
    branch = next(a.g for a in out.graph.node[2].attribute if a.name == "then_branch")
    assert [nd.op_type for nd in branch.node] == ["Relu"]
    for seed in (0, 1, 2):
        assert_equivalent(model, out, seed=seed)


def test_pattern_ending_later_claims_nodes_first():
    inner = Rule("neg-abs", lambda op, x: op.Neg(op.Abs(x)), lambda op, m: op.Min(m["x"], op.Neg(m["x"])))
    outer = Rule("relu-neg", lambda op, x: op.Relu(op.Neg(x)), lambda op, m: op.Neg(op.Min(m["x"], 0.0)))
    model = make_model([node("Abs", ["x"], ["a"]), node("Neg", ["a"], ["n"]), node("Relu", ["n"], ["y"])],
                       [("x", F, [4])], [("y", F, [4])])
    out, n = apply(model, inner, outer)
    assert n == 1 and op_counts(out) == {"Abs": 1, "Min": 1, "Neg": 1}


def test_or_at_the_root_anchors_every_alternative_op():
    rule = Rule("act", lambda op, x: op.Neg(op.Or(op.Relu(x), op.Sigmoid(x), _name="act")), lambda op, m: None)
    for act in ("Relu", "Sigmoid", "Tanh"):
        model = make_model([node(act, ["x"], ["a"]), node("Neg", ["a"], ["y"])], [("x", F, [4])], [("y", F, [4])])
        assert explain(rule, model)[0].startswith("rule 'act': matches" if act != "Tanh" else "rule 'act': no match")
    root_or = Rule("root", lambda op, x: op.Or(op.Relu(x), op.Sigmoid(x)), lambda op, m: None)
    assert root_or.pattern.anchors == {"Relu", "Sigmoid"}


def test_pattern_forms_outputs_labels_domain_other_inputs_and_commute():
    def split_pattern(op, x):
        a, b = op.Split(x, _outputs=["a", "b"], axis=0, _allow_other_inputs=True, _name="split")
        return op.Sub(a, b, _commute=False)

    seen = []
    rule = Rule("split-sub", split_pattern, lambda op, m: seen.append((m["a"].name, m["b"].name)))
    model = make_model([node("Split", ["x", "sizes"], ["p", "q"], axis=0), node("Sub", ["p", "q"], ["y"])],
                       [("x", F, [4])], [("y", F, [2])], {"sizes": np.array([2, 2], np.int64)})
    assert explain(rule, model)[0] == "rule 'split-sub': matches at 1 node(s)"
    apply(model, rule)
    assert seen == [("p", "q")]
    swapped = make_model([node("Split", ["x"], ["p", "q"], axis=0, num_outputs=2), node("Sub", ["q", "p"], ["y"])],
                         [("x", F, [4])], [("y", F, [2])], opset=18)
    assert "is not output 0" in explain(rule, swapped)[0]
    custom = Rule("custom", lambda op, x: op.Relu(op.FastGelu(x, _domain="com.microsoft")), lambda op, m: None)
    ms = make_model([node("FastGelu", ["x"], ["g"], domain="com.microsoft"), node("Relu", ["g"], ["y"])],
                    [("x", F, [4])], [("y", F, [4])], extra_opsets=[("com.microsoft", 1)])
    assert explain(custom, ms)[0].endswith("matches at 1 node(s)")


def test_constant_of_another_shape_is_refused_without_reading_it(monkeypatch):
    """op.Constant(2.0) against a (64, 64) weight: the shape says no, so the weight is never loaded."""
    import k3opt.patterns.matcher as matcher_module

    reads = []
    real = matcher_module.const_value
    monkeypatch.setattr(matcher_module, "const_value", lambda t: reads.append(t.name) or real(t))
    model = make_model([node("Mul", ["x", "w"], ["y"])], [("x", F, [64, 64])], [("y", F, [64, 64])],
                       {"w": np.full((64, 64), 2.0, np.float32)})
    assert apply(model, DOUBLE)[1] == 0 and reads == []
    model = make_model([node("Mul", ["x", "two"], ["y"])], [("x", F, [4])], [("y", F, [4])],
                       {"two": np.array([2.0], np.float32)})
    assert apply(model, DOUBLE)[1] == 1 and reads == ["two"]



@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", "vit"])
def test_root_prefilter_never_hides_a_match_on_zoo_exports(name):
    """Without tracing, a matcher first checks the anchor's op and operand producers (``_may_root``) and reads
    each initializer once per constant pattern; on real exports (decomposed LayerNorms, RMSNorms, MatMul+Add)
    it must yield exactly the matches of the full, tracing walk.
    """
    from k3opt.passes.fusion import fuse_layernorm as layer_norm
    from k3opt.passes.fusion import matmul_add
    from k3opt.passes.fusion import fuse_rmsnorm as rms_norm
    from tests.zoo import zoo_model

    graph = gs.import_onnx(onnx.load(str(zoo_model(name)), load_external_data=False))
    rules = [*layer_norm.RULES, *rms_norm.RULES, matmul_add.RULE]
    found = refused = 0
    for r in rules:
        fast, full = Matcher(r.pattern, 14), Matcher(r.pattern, 14, trace=lambda depth, reason: None)
        for n in graph.nodes:
            for t in n.outputs:
                want = [(sorted(s.used), sorted(map(id, s.values.values()))) for s in full.matches(t)]
                assert [(sorted(s.used), sorted(map(id, s.values.values()))) for s in fast.matches(t)] == want, \
                    (r.name, n.name)
                found += bool(want)
                refused += not fast._may_root(t)
    assert found and refused


def test_an_initializer_is_read_once_per_constant_pattern(monkeypatch):
    """Ten Pow(x_i, 2) sharing one exponent initializer: one read for the whole sweep, and all ten still match."""
    import k3opt.patterns.matcher as matcher

    reads = []
    real = matcher.const_value
    monkeypatch.setattr(matcher, "const_value", lambda t: reads.append(t.name) or real(t))
    nodes = [node("Pow", [f"x{i}", "two"], [f"y{i}"]) for i in range(10)]
    model = make_model(nodes, [(f"x{i}", F, [2]) for i in range(10)], [(f"y{i}", F, [2]) for i in range(10)],
                       {"two": np.float32(2.0)})
    graph = gs.import_onnx(model)
    m = Matcher(Rule("square", lambda op, x: op.Pow(x, 2.0), lambda op, m: None).pattern, 17)
    assert all(any(True for _ in m.matches(n.outputs[0])) for n in graph.nodes)
    assert reads == ["two"]


def test_a_list_schema_default_is_the_callers_own():
    """Schema defaults are cached per process: changing a list one returned does not change the next answer."""
    from k3opt.patterns.schema import attr_value

    axes = attr_value({}, "MeanVarianceNormalization", "", 17, "axes")
    assert axes == [0, 2, 3]
    axes.append(9)
    assert attr_value({}, "MeanVarianceNormalization", "", 17, "axes") == [0, 2, 3]
