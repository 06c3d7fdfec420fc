"""fold-constants' walk starts only from nodes whose inputs are all constant, and still chooses exactly
the nodes, in exactly the order, of a walk that starts from every node (the order names folded tensors)."""
from __future__ import annotations

from typing import Optional

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto as T, helper

import k3opt
from k3opt.report import Report
from k3opt.graph.ir import Graph, Node, Tensor, const_value, outer_refs, producer
from k3opt.pipeline.pass_base import PassContext
from k3opt.pipeline.manager import PassManager
from k3opt.passes.fold.fold_constants import FoldConstants, _holders
from k3opt.passes.fold._guard import too_big
from tests.helpers import make_model
from tests.zoo import needs_torch, zoo_model

F = T.FLOAT


def _walk_from_every_node(fold_pass: FoldConstants, graph: Graph, ctx: PassContext) -> list[Node]:
    """The reference: the same depth-first walk with every node of the graph on the starting stack."""
    overridable = {id(t) for t in graph.inputs}
    in_graph = {id(n) for n in graph.nodes}
    pending: set[int] = set()
    chosen: list[Node] = []

    def ready(t: Tensor) -> bool:
        if not t.name or id(t) in pending:
            return True
        p = producer(t)
        return id(t) not in overridable and (isinstance(t, gs.Constant) or (p is not None and p.op == "Constant"))

    def value(t: Tensor) -> Optional[np.ndarray]:
        return None if id(t) in pending else const_value(t)

    stack = list(reversed(graph.nodes))
    while stack:
        node = stack.pop()
        if any(n is node for n in chosen) or not all(ready(t) for t in node.inputs) or id(node) not in in_graph:
            continue
        if not fold_pass._eligible(graph, node) or not all(ready(t) for t in outer_refs(node)):
            continue
        if too_big(node, value, ctx.options):
            continue
        chosen.append(node)
        pending.update(id(t) for t in node.outputs)
        for t in node.outputs:
            for c in t.outputs:
                stack.extend([c] if id(c) in in_graph else _holders(graph))
    return chosen


@pytest.fixture
def compared_walks(monkeypatch) -> list:
    """Every ``_foldable`` call is compared with the reference walk; yields the node counts chosen."""
    sizes: list = []
    real = FoldConstants._foldable

    def foldable(self, graph, ctx, starts):
        got = real(self, graph, ctx, starts)
        want = _walk_from_every_node(self, graph, ctx)
        assert [id(n) for n in got] == [id(n) for n in want]
        sizes.append(len(got))
        return got

    monkeypatch.setattr(FoldConstants, "_foldable", foldable)
    return sizes


def test_unsorted_graph_with_a_branch_reading_folded_values(compared_walks):
    """A chain fed by two constants, an If body reading a folded value, nodes listed readers first."""
    then_g = helper.make_graph([helper.make_node("Add", ["c2", "x"], ["t"])], "then", [],
                               [helper.make_tensor_value_info("t", F, [2])])
    else_g = helper.make_graph([helper.make_node("Sub", ["x", "c2"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", F, [2])])
    nodes = [
        helper.make_node("Add", ["a", "b"], ["c1"]),
        helper.make_node("Mul", ["c1", "b"], ["c2"]),
        helper.make_node("If", ["cond"], ["y"], then_branch=then_g, else_branch=else_g),
        helper.make_node("Greater", ["c1", "x"], ["g"]),
        helper.make_node("Cast", ["g"], ["g_f"], to=F),
        helper.make_node("ReduceMax", ["g_f"], ["m"], keepdims=0),
        helper.make_node("Add", ["y", "m"], ["out"]),
    ]
    inits = {"a": np.ones(2, np.float32), "b": np.full(2, 2.0, np.float32), "cond": np.array(True)}
    model = make_model(nodes, [("x", F, [2])], [("out", F, [2])], initializers=inits)
    graph = gs.import_onnx(onnx.shape_inference.infer_shapes(model))
    graph.nodes.reverse()
    n = PassManager([FoldConstants()]).run(graph, PassContext(opset=17))
    assert n > 0 and compared_walks[0] == 2  # Add, Mul (the If, reached through its body, reads x)


@needs_torch
@pytest.mark.parametrize("name, exporter", [("llama", "torchscript"), ("llama", "dynamo"), ("gpt2", "torchscript"),
                                            ("bert", "torchscript")])
def test_zoo_walks_match(compared_walks, name, exporter):
    k3opt.optimize(onnx.load(zoo_model(name, exporter)))
    assert sum(compared_walks) > 0


@needs_torch
@pytest.mark.parametrize("name, exporter, skips", [("llama", "torchscript", True), ("gpt2", "torchscript", True),
                                                   ("deepseek_v3", "torchscript", False), ("llama", "dynamo", False)])
def test_skipped_value_walk_changes_nothing(monkeypatch, name, exporter, skips):
    """A value sweep is skipped when the last one found no foldable node and the shape sweep since changed
    nothing; forcing every walk gives the same model and rewrite counts, with more walks."""
    walks: list = []
    real = FoldConstants._foldable

    def foldable(self, graph, ctx, starts):
        walks.append(len(graph.nodes))
        return real(self, graph, ctx, starts)

    monkeypatch.setattr(FoldConstants, "_foldable", foldable)
    model = onnx.load(zoo_model(name, exporter))
    runs = []
    for touched in (None, True):  # None: as the pass says; True: every shape sweep claims a change
        if touched:
            real_shapes = FoldConstants._fold_shapes
            monkeypatch.setattr(FoldConstants, "_fold_shapes", lambda self, *a: (real_shapes(self, *a)[0], True))
        walks.clear()
        report = Report()
        out = k3opt.optimize(model, report=report).SerializeToString()
        runs.append((out, [(p["name"], p["rewrites"]) for p in report.passes], len(walks)))
    (fast, fast_counts, fast_walks), (slow, slow_counts, slow_walks) = runs
    assert fast == slow and fast_counts == slow_counts
    assert (fast_walks < slow_walks) == skips


@needs_torch
@pytest.mark.parametrize("name, exporter", [("llama", "torchscript"), ("gpt2", "torchscript"), ("llama", "dynamo"),
                                            ("vit", "torchscript"), ("bert", "dynamo")])
def test_shape_sweeps_see_every_shape_op_in_order(monkeypatch, name, exporter):
    """Each shape sweep gets the shape ops still in the graph (carried over from the run's first census
    answer): exactly the graph's shape ops, in graph order, as a fresh scan finds them."""
    from k3opt.passes.fold.fold_constants import SHAPE_OPS

    sweeps: list = []
    real = FoldConstants._fold_shapes

    def fold_shapes(self, graph, ctx, dims, nodes, made):
        assert [id(n) for n in nodes] == [id(n) for n in graph.nodes if n.op in SHAPE_OPS]
        sweeps.append(len(nodes))
        return real(self, graph, ctx, dims, nodes, made)

    monkeypatch.setattr(FoldConstants, "_fold_shapes", fold_shapes)
    k3opt.optimize(onnx.load(zoo_model(name, exporter)))
    assert len(sweeps) > 1 and sweeps[0] > 0


@pytest.fixture
def carried_starts(monkeypatch) -> list:
    """Checks every later sweep's start nodes (carried over from the last sweep's and the readers of what
    was installed since) against a scan of every node: the same nodes in graph order. Collects their ops."""
    from k3opt.passes.fold import fold_constants

    carried: list = []
    real = fold_constants.start_nodes

    def starts(graph, last, installed):
        got = real(graph, last, installed)
        if last is not None:
            assert [id(n) for n in got] == [id(n) for n in real(graph, None, [])]
            carried.append([n.op for n in got])
        return got

    monkeypatch.setattr(fold_constants, "start_nodes", starts)
    return carried


@needs_torch
@pytest.mark.parametrize("name, exporter", [("llama", "torchscript"), ("gpt2", "torchscript"), ("llama", "dynamo"),
                                            ("deepseek_v3", "torchscript"), ("bert", "dynamo")])
def test_start_nodes_carried_over_match_a_scan(carried_starts, name, exporter):
    """A later sweep's start nodes are exactly those a scan of every node finds, in graph order."""
    k3opt.optimize(onnx.load(zoo_model(name, exporter)))
    assert carried_starts


def test_start_nodes_carried_over_include_a_graph_output_s_new_constant_node(carried_starts):
    """A folded graph output gets a Constant node: a scan counts it as a start node (no inputs), so the
    carried-over start nodes must too, or the next sweep's starts differ from a scan's."""
    c = np.arange(4, dtype=np.float32)
    model = make_model([helper.make_node("Add", ["a", "b"], ["y"]), helper.make_node("Relu", ["x"], ["z"])],
                       [("x", F, [4])], [("y", F, [4]), ("z", F, [4])], {"a": c, "b": c})
    out = k3opt.optimize(model, passes=["fold-constants"])
    assert [n.op_type for n in out.graph.node] == ["Constant", "Relu"]
    assert carried_starts == [["Constant"]]
