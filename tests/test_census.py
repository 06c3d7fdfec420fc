"""The op census (PassContext.nodes_of / graphs / ops_in): the same answers as a scan, shared by the passes of
one graph version, never stale; and rule sweeps skipped where a rule's pattern needs an op the graph lacks."""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto as T, helper

import k3opt
from k3opt.graph import ir
from k3opt.pipeline import manager
from k3opt.pipeline.op_census import OpCensus
from k3opt.pipeline.pass_base import Hints, Pass, PassContext
from k3opt.passes.cleanup.remove_identity import RemoveIdentity
from k3opt.passes.fusion.fuse_layernorm import RULES as LAYERNORM_RULES
from k3opt.pipeline.manager import PassManager
from k3opt.patterns import Rule
from k3opt.patterns.rule import RuleApplier
from k3opt.patterns.rule_pass import possible, required_links, required_ops, sweep
from tests.helpers import make_model
from tests.zoo import zoo_model

F = T.FLOAT


def _body(name: str, inner: list) -> onnx.GraphProto:
    nodes = [helper.make_node("Identity", ["x"], [f"{name}_i"]), helper.make_node("Relu", [f"{name}_i"], [f"{name}_y"])]
    return helper.make_graph(nodes + inner, name, [], [helper.make_tensor_value_info(f"{name}_y", F, [2])])


def nested_graph() -> gs.Graph:
    """Identity/Relu/Neg at the top and in nested If bodies (an If inside a then-branch)."""
    inner_if = helper.make_node("If", ["c"], ["n_y"], then_branch=_body("t2", []), else_branch=_body("e2", []))
    nodes = [helper.make_node("Identity", ["x"], ["a"]), helper.make_node("Neg", ["a"], ["n"]),
             helper.make_node("If", ["c"], ["b"], then_branch=_body("t1", [inner_if]), else_branch=_body("e1", [])),
             helper.make_node("Relu", ["b"], ["r"]), helper.make_node("Identity", ["r"], ["d"])]
    model = make_model(nodes, [("x", F, [2]), ("c", T.BOOL, [])], [("n", F, [2]), ("d", F, [2])])
    return gs.import_onnx(model)


def scan(graph: gs.Graph, ops) -> list:
    return [n for n in graph.nodes if n.op in ops]


@pytest.mark.parametrize("census", [None, OpCensus()], ids=["scan", "census"])
def test_answers_equal_a_scan(census):
    graph = nested_graph()
    ctx = PassContext(opset=17, census=census)
    graphs = ctx.graphs(graph)
    assert [id(g) for g in graphs] == [id(g) for g in ir.all_graphs(graph)] and len(graphs) == 5
    for g in graphs:
        for ops in ({"Identity"}, ("Relu", "Identity", "Relu"), ["Neg", "If", "Identity"], (), {"Conv"}):
            assert [id(n) for n in ctx.nodes_of(g, ops)] == [id(n) for n in scan(g, ops)]
        assert ctx.ops_in(g) == {n.op for n in g.nodes}


def test_a_replaced_or_resized_node_list_is_indexed_again():
    """Even without changed(): a pass that reassigns or grows a node list never gets the old answer."""
    graph = nested_graph()
    ctx = PassContext(opset=17, census=OpCensus())
    assert len(ctx.nodes_of(graph, {"Identity"})) == 2 and len(ctx.graphs(graph)) == 5
    graph.nodes = list(reversed(graph.nodes))  # a reorder (merge-equal-dims' toposort, returning 0)
    ops = {"Identity", "Neg"}
    assert [id(n) for n in ctx.nodes_of(graph, ops)] == [id(n) for n in scan(graph, ops)]
    graph.nodes = [n for n in graph.nodes if n.op != "If"]
    assert len(ctx.graphs(graph)) == 1 and "If" not in ctx.ops_in(graph)
    graph.nodes.append(gs.Node("Identity", "late", inputs=[graph.outputs[0]], outputs=[gs.Variable("late_y")]))
    assert [n.name for n in ctx.nodes_of(graph, {"Identity"})][-1] == "late"
    body = ctx.graphs(nested_graph())[1]  # another graph altogether: its own census entry
    assert [n.op for n in ctx.nodes_of(body, {"Identity"})] == ["Identity"]


def test_changed_drops_the_census():
    graph = nested_graph()
    ctx = PassContext(opset=17, census=OpCensus())
    first = ctx.nodes_of(graph, {"Identity"})[0]
    first.op = "Relu"  # in place: only changed() tells
    assert ctx.nodes_of(graph, {"Identity"})[0] is first
    ctx.changed()
    assert ctx.nodes_of(graph, {"Identity"})[0] is not first


class Asker(Pass):
    """Asks for Identity nodes and rewrites nothing (or renames one Identity to Relu when ``rename``)."""

    name = "test-asker"

    def __init__(self, rename: bool = False):
        self.rename, self.seen = rename, []

    def run(self, graph, ctx) -> int:
        found = ctx.nodes_of(graph, {"Identity"})
        self.seen.append(len(found))
        if self.rename and found:
            found[0].op = "Relu"
            return 1
        return 0


def test_the_manager_shares_one_census_per_graph_version(monkeypatch):
    built = []
    original = OpCensus._entry

    def entry(self, graph):
        if id(graph) not in self._index:
            built.append(id(graph))
        return original(self, graph)

    monkeypatch.setattr(OpCensus, "_entry", entry)
    graph = nested_graph()
    ctx = PassContext(opset=17)
    first, renamer, after = Asker(), Asker(rename=True), Asker()
    renamer.name, after.name = "test-renamer", "test-asker-after"
    PassManager([first, renamer, after]).run(graph, ctx)
    # Each rename is a new graph version: the next question indexes the graph again, and every pass
    # asking at that version (the next round's first two included) shares that index.
    assert (first.seen, renamer.seen, after.seen) == ([2, 1, 0], [2, 1, 0], [1, 0])
    assert len(built) == 3
    assert ctx.census is None  # only while the manager runs


def test_the_census_is_gone_after_a_failing_pass():
    class Boom(Pass):
        name = "test-boom"

        def run(self, graph, ctx) -> int:
            ctx.nodes_of(graph, {"Identity"})
            raise RuntimeError("boom")

    ctx = PassContext(opset=17)
    with pytest.raises(RuntimeError):
        PassManager([Boom()]).run(nested_graph(), ctx)
    assert ctx.census is None


def test_candidates_without_a_context_scan():
    graph = nested_graph()
    found = RemoveIdentity()._candidates(graph, PassContext(opset=17))
    shared = RemoveIdentity()._candidates(graph, PassContext(opset=17, census=OpCensus()))
    assert [(id(g), [id(n) for n in c]) for g, c in found] == [(id(g), [id(n) for n in c]) for g, c in shared]


class CheckedCensus(OpCensus):
    """Every answer compared with a scan of the graph as it is now."""

    def nodes_of(self, graph, ops):
        got = super().nodes_of(graph, ops)
        assert [id(n) for n in got] == [id(n) for n in scan(graph, ops)]
        return got

    def graphs(self, graph):
        got = super().graphs(graph)
        assert [id(g) for g in got] == [id(g) for g in ir.all_graphs(graph)]
        return got

    def ops_in(self, graph):
        got = super().ops_in(graph)
        assert got == {n.op for n in graph.nodes}
        return got


WHOLE_RUNS = [("bert", "torchscript", "onnx"), ("llama", "dynamo", "onnx"), ("deepseek_v3", "torchscript", "onnx"),
              ("llama", "torchscript", "cann")]


@pytest.mark.parametrize("name,exporter,target", WHOLE_RUNS)
def test_every_census_answer_in_a_whole_run_equals_a_scan(monkeypatch, name, exporter, target):
    """No built-in pass changes the graph in place and then reports no rewrite (or asks again without
    changed()); merge-equal-dims' toposort, which may reorder and return 0, gives a new node list.
    Nor does one give a body-free graph a body (``Hints(adds_bodies=False)``): the census's kept "no body"
    answer is checked against a walk after every rewrite, the cann lowerings' included."""
    model = onnx.load(str(zoo_model(name, exporter)))
    monkeypatch.setattr(manager, "OpCensus", CheckedCensus)
    checked = k3opt.optimize(model, target=target)
    monkeypatch.undo()
    assert checked.SerializeToString() == k3opt.optimize(model, target=target).SerializeToString()


def _body_free_graph() -> gs.Graph:
    nodes = [helper.make_node("Identity", ["x"], ["a"]), helper.make_node("Identity", ["a"], ["b"]),
             helper.make_node("Relu", ["b"], ["y"])]
    return gs.import_onnx(make_model(nodes, [("x", F, [2])], [("y", F, [2])]))


class BodyCounter(Pass):
    """Records how many graphs ``ctx.graphs`` names at each run; rewrites nothing."""

    name = "test-body-counter"
    _hints = Hints(adds_bodies=False)

    def __init__(self):
        self.seen = []

    def run(self, graph, ctx) -> int:
        self.seen.append(len(ctx.graphs(graph)))
        return 0


class IfAdder(Pass):
    """Puts an If with two one-node bodies after the graph's last node, once (a plugin-like pass: it
    declares nothing, so it may add bodies)."""

    name = "test-if-adder"

    def run(self, graph, ctx) -> int:
        if any(n.op == "If" for n in graph.nodes):
            return 0
        cond = gs.Constant("k3_cond", np.array(True))
        branches = []
        for side in ("then", "else"):
            out = gs.Variable(f"{side}_y", dtype=np.float32, shape=[2])
            branches.append(gs.Graph(nodes=[gs.Node("Neg", f"{side}_neg", inputs=[graph.outputs[0]], outputs=[out])],
                                     outputs=[out], name=side))
        graph.nodes.append(gs.Node("If", "k3_if", {"then_branch": branches[0], "else_branch": branches[1]},
                                   inputs=[cond], outputs=[gs.Variable("if_y")]))
        return 1


def test_a_body_free_graph_is_walked_for_bodies_once(monkeypatch):
    """Rewrites by passes that add no body keep the census's "no body" answer: no walk after them."""
    from k3opt.pipeline import op_census

    walks = []
    monkeypatch.setattr(op_census, "all_graphs", lambda g: walks.append(g) or ir.all_graphs(g))
    counter = BodyCounter()
    graph = _body_free_graph()
    PassManager([RemoveIdentity(), counter]).run(graph, PassContext(opset=17))
    assert counter.seen == [1] and len(walks) == 1 and [n.op for n in graph.nodes] == ["Relu"]
    walks.clear()  # told by the caller (loading saw no body): no walk at all
    graph = _body_free_graph()
    PassManager([RemoveIdentity(), BodyCounter()]).run(graph, PassContext(opset=17), graphs=[graph])
    assert walks == []


@pytest.mark.parametrize("declared", [True, False])
def test_bodies_a_pass_may_add_are_found(declared):
    """A pass that may add bodies (the default, a plugin's) gets the graph walked again after it rewrote:
    the next pass sees the If's two bodies. One that wrongly declares it adds none leaves the census
    answering "no body": the declaration is what the census trusts."""
    adder, counter = IfAdder(), BodyCounter()
    adder._hints = Hints(adds_bodies=declared)
    graph = _body_free_graph()
    PassManager([counter, adder, BodyCounter()]).run(graph, PassContext(opset=17), graphs=[graph])
    assert counter.seen == ([1, 3] if declared else [1, 1])
    assert len(list(ir.all_graphs(graph))) == 3


def test_name_scope_takes_the_graphs_it_is_given():
    """NameScope(graph, tensors, graphs): the names of the graphs given, not walked for."""
    graph = nested_graph()
    assert ir.NameScope(graph, graphs=[graph]).fresh("t1_y") == "t1_y"  # a body's name: not seen
    assert ir.NameScope(graph).fresh("t1_y") == "t1_y_1"


# -- rules skipped where they cannot match ---------------------------------------------------------------------

def test_required_ops_follow_alternatives_and_ignore_constants():
    def pattern(op, x, w):
        y = op.Or(op.Div(op.Sqrt(x), 2.0), op.Mul(op.Sqrt(x), op.AnyConstant("c")))
        return op.Add(op.MatMul(y, w), op.Constant(1.0))

    rule = Rule("t", pattern, lambda op, m: None)
    assert required_ops(rule.pattern.outputs) == {"Add", "MatMul", "Sqrt"}
    assert sorted(required_ops(LAYERNORM_RULES[-1].pattern.outputs)) == ["Add", "ReduceMean", "Sub"]
    assert not possible(rule, {"Add", "MatMul"}) and possible(rule, {"Add", "MatMul", "Sqrt", "Div"})
    rule.debug = True  # a rule being debugged always tries, to explain itself
    assert possible(rule, set())


def test_required_links_follow_alternatives():
    """Each pattern edge is a required (producer op, consumer op) link; an ``op.Or`` operand gives what all its
    alternatives give (here none: Neg vs Mul), a variable or constant operand none."""
    def pattern(op, x, w):
        y = op.Or(op.Neg(op.Sqrt(x)), op.Mul(op.Sqrt(x), 2.0))
        return op.Add(op.MatMul(y, w), op.Constant(1.0))

    rule = Rule("t", pattern, lambda op, m: None)
    assert required_links(rule.pattern.outputs) == {("MatMul", "Add")}
    nested = Rule("n", lambda op, x: op.Relu(op.Or(op.Neg(op.Sqrt(x)), op.Abs(op.Sqrt(x)))), lambda op, m: None)
    assert required_links(nested.pattern.outputs) == set()
    chain = Rule("c", lambda op, x: op.Relu(op.Sqrt(op.Abs(x))), lambda op, m: None)
    assert required_links(chain.pattern.outputs) == {("Sqrt", "Relu"), ("Abs", "Sqrt")}
    ops = {"Relu", "Sqrt", "Abs"}
    assert possible(chain, ops, lambda a, b: True) and not possible(chain, ops, lambda a, b: (a, b) != ("Abs", "Sqrt"))
    chain.debug = True
    assert possible(chain, ops, lambda a, b: False)


@pytest.mark.parametrize("linked", [True, False])
def test_a_sweep_skipped_for_a_missing_link_finds_what_a_full_sweep_finds(monkeypatch, linked):
    """Relu(Sqrt(x)) where the graph holds both ops: linked, the sweep rewrites it; not linked (Relu and Sqrt
    apart), it tries no anchor, and a sweep over every node (the plain path) finds nothing either."""
    rule = Rule("relu-sqrt", lambda op, x: op.Relu(op.Sqrt(x)), lambda op, m: op.Sqrt(m["x"]))
    nodes = [helper.make_node("Sqrt", ["x"], ["s"]), helper.make_node("Relu", ["s" if linked else "x"], ["y"]),
             helper.make_node("Add", ["s" if not linked else "x", "y"], ["z"])]
    model = make_model(nodes, [("x", F, [4])], [("z", F, [4])])
    plain = RuleApplier(gs.import_onnx(model), PassContext(opset=17), [rule], dry_run=True)
    plain.run()
    tried = []
    real = RuleApplier._try
    monkeypatch.setattr(RuleApplier, "_try", lambda self, *a: tried.append(a[-1].op) or real(self, *a))
    graph = gs.import_onnx(model)
    ctx = PassContext(opset=17, census=OpCensus())
    ctx.names = ir.NameScope(graph)
    assert sweep(graph, ctx, [rule]) == plain.matched[rule.name] == int(linked)
    assert tried == (["Relu"] if linked else []) and ctx.counters == {"rule:relu-sqrt": int(linked)}


@pytest.mark.parametrize("name,exporter", [("bert", "torchscript"), ("llama", "dynamo"), ("gpt2", "dynamo")])
def test_a_rule_judged_impossible_matches_nowhere(name, exporter):
    from k3opt.plugins import registered_passes

    graph = gs.import_onnx(onnx.load(str(zoo_model(name, exporter))))
    present = {n.op for n in graph.nodes}
    rules = [r for cls in registered_passes().values() for r in getattr(cls, "rules", ())]
    assert rules
    edges = {(ir.producer(t).op, n.op) for n in graph.nodes for t in n.inputs if ir.producer(t) is not None}
    for rule in rules:
        if not possible(rule, present, lambda a, b: (a, b) in edges):
            applier = RuleApplier(graph, PassContext(opset=18), [rule], dry_run=True)
            applier.run()
            assert applier.matched[rule.name] == 0


def test_layernorm_sweeps_skip_a_graph_without_sub(monkeypatch):
    """fuse-layernorm tries no anchor in a graph without Sub (a norm there would need one), and counts as before."""
    tried = []
    monkeypatch.setattr(RuleApplier, "_try", lambda self, rule, matcher, node: tried.append(node) or False)
    x = np.ones((4,), np.float32)
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], axes=[-1]), helper.make_node("Add", ["m", "eps"], ["a"]),
             helper.make_node("Mul", ["a", "w"], ["y"])]
    model = make_model(nodes, [("x", F, [2, 4])], [("y", F, [2, 1])], {"eps": x[:1], "w": x[:1]})
    from k3opt.passes.fusion.fuse_layernorm import FuseLayerNorm

    ctx = PassContext(opset=17)
    assert FuseLayerNorm().run(gs.import_onnx(model), ctx) == 0
    assert tried == [] and {k: v for k, v in ctx.counters.items()} == {f"rule:{r.name}": 0 for r in LAYERNORM_RULES}


@pytest.mark.parametrize("with_census", [True, False])
def test_owns_answers_for_the_graph_as_it_is_now(with_census):
    """ctx.owns: a node of the graph, not of an enclosing one; a node added to the list is seen at once
    (the census keys its ids to the node list as it was)."""
    x = gs.Variable("x", dtype=np.float32, shape=[2])
    a, b = gs.Variable("a"), gs.Variable("b")
    outer = gs.Node("Relu", "outer", inputs=[x], outputs=[a])
    body = gs.Graph(nodes=[gs.Node("Neg", "inner", inputs=[a], outputs=[b])], inputs=[], outputs=[b])
    graph = gs.Graph(nodes=[outer], inputs=[x], outputs=[a])
    ctx = PassContext(opset=17)
    if with_census:
        ctx.census = OpCensus()
    assert ctx.owns(graph, outer) and not ctx.owns(body, outer) and ctx.owns(body, body.nodes[0])
    late = gs.Node("Identity", "late", inputs=[a], outputs=[gs.Variable("c")])
    graph.nodes.append(late)
    assert ctx.owns(graph, late)


def test_all_graphs_is_gs_own_walk_of_the_bodies():
    """ir.all_graphs (one comprehension per graph) yields what gs's per-node ``subgraphs()`` walk yields."""
    def plain(g: gs.Graph):
        yield g
        for node in g.nodes:
            for sub in node.subgraphs():
                yield from plain(sub)

    graph = nested_graph()
    graph.nodes[0].attrs["note"] = "not a graph"  # attributes of other kinds are passed over
    assert [id(g) for g in ir.all_graphs(graph)] == [id(g) for g in plain(graph)]
    # else before then (attributes by name), a nested body right after the body holding it
    assert [g.name for g in ir.all_graphs(graph)][1:] == ["e1", "t1", "e2", "t2"]
