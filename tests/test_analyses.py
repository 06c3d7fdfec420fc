"""Analyses managed by the run (``pipeline/analyses.py``): kept while they hold, dropped by what a pass does
not declare preserved, told of the edits the graph-editing helpers make, and never shared between runs."""
from __future__ import annotations

import threading

import numpy as np
import onnx_graphsurgeon as gs

from k3opt.graph.ir import as_constant, replace_uses, set_output, watching_edits
from k3opt.graph.symbolic.dims import Dims
from k3opt.pipeline.analyses import Analysis, AnalysisManager, DimAnalysis, Shapes
from k3opt.pipeline.manager import PassManager
from k3opt.pipeline.pass_base import Pass, PassContext
from tests.test_fold_shape_memo import reshaped_graph


def _seven() -> gs.Constant:
    return as_constant("seven", np.array(7, dtype=np.int64))


def _elements(graph: gs.Graph, ctx: PassContext) -> list:
    """The Reshape target's elements, as a pass asks for them."""
    return ctx.dims(graph).elements(graph.tensors()["target"])[0]


class _Recorder(Pass):
    """Asks for the target's elements at every run; records them and the dims analysis it got."""

    name = "test-ask-dims"

    def __init__(self, seen: list) -> None:
        self.seen = seen

    def run(self, graph, ctx):
        self.seen.append((_elements(graph, ctx), ctx.dims(graph)))
        return 0


def test_a_rewiring_pass_that_declares_nothing_sees_fresh_dims():
    """A pass that asks, rewires through the editing helpers, then asks again gets the new answer: no pass
    tells the analysis anything."""
    seen = []

    class RewireThenAsk(Pass):
        name = "test-rewire-then-ask"

        def run(self, graph, ctx):
            if "seven" in graph.tensors():
                return 0
            before = _elements(graph, ctx)
            replace_uses(graph, graph.tensors()["n"], _seven())
            seen.append((before, _elements(graph, ctx)))
            return 1

    PassManager([RewireThenAsk()]).run(reshaped_graph(), PassContext(opset=17))
    assert seen == [(["N", -1], [7, -1])]


def test_an_edit_the_helpers_do_not_see_is_dropped_after_the_pass():
    """An edit made on gs's objects directly is not heard while the pass runs; the manager drops the
    analysis after it (nothing declared preserved), so the next pass gets fresh dims."""
    seen: list = []

    class RewireDirectly(Pass):
        name = "test-rewire-directly"

        def run(self, graph, ctx):
            unsqueeze = next(node for node in graph.nodes if node.op == "Unsqueeze")
            if unsqueeze.inputs[0].name == "seven":
                return 0
            _elements(graph, ctx)  # remembered
            unsqueeze.inputs[0] = _seven()  # gs's own link update: no editing helper
            return 1

    PassManager([RewireDirectly(), _Recorder(seen)]).run(reshaped_graph(), PassContext(opset=17))
    assert seen[0][0] == [7, -1]


def test_preserved_analyses_are_kept_and_the_others_dropped():
    seen: list = []

    class Rewrite(Pass):
        name = "test-rewrite-once"
        done = False

        def run(self, graph, ctx):
            if self.done:
                return 0
            self.done = True
            return 1

    class KeepsDims(Rewrite):
        name = "test-rewrite-keeping-dims"
        preserves = frozenset({DimAnalysis})

    for rewrite, kept in ((Rewrite, False), (KeepsDims, True)):
        seen.clear()
        PassManager([_Recorder(seen), rewrite()]).run(reshaped_graph(), PassContext(opset=17))
        assert len(seen) == 2  # round 1, then round 2 after the rewrite
        assert (seen[0][1] is seen[1][1]) is kept


def test_an_idle_pass_leaves_the_analyses_to_the_next():
    """A pass that made no rewrite changed nothing: the next pass reuses what it computed."""
    seen: list = []
    PassManager([_Recorder(seen), _Recorder(seen)]).run(reshaped_graph(), PassContext(opset=17))
    assert len(seen) == 2 and seen[0][1] is seen[1][1]


def test_two_runs_are_independent():
    """Each run keeps its own analyses (on its context) and drops them when it ends."""
    seen: list = []
    graph = reshaped_graph()
    first, second = PassContext(opset=17), PassContext(opset=17)
    PassManager([_Recorder(seen)]).run(graph, first)
    PassManager([_Recorder(seen)]).run(graph, second)
    assert seen[0][1] is not seen[1][1]
    assert not first.analyses.holds(DimAnalysis, graph) and not second.analyses.holds(DimAnalysis, graph)
    assert seen[0][1].memo is not seen[1][1].memo


def test_what_dims_answer_depends_on_the_object_asked_not_on_the_context():
    """Two runs at once (threads) each trace with their own memo, and give the same answers; a Dims naming
    unknown dims answers so while a plain one, asked at the same time, does not (no hidden context)."""
    graph = reshaped_graph()
    y = graph.tensors()["y"]
    y.shape = ["unk__1", 6]  # traced: remembered by the Dims asked only
    mine, other = DimAnalysis(graph), DimAnalysis(graph)
    answers: list = []
    assert mine.at(y, 0) == "N"
    thread = threading.Thread(target=lambda: answers.append(other.at(y, 0)))
    thread.start()
    thread.join()
    assert answers == ["N"] and mine.memo._results and other.memo._results
    assert mine.memo._results is not other.memo._results
    x = graph.tensors()["x"]
    x.shape = [None, 6]
    named = Dims(graph, name_unknown=True)
    assert named.at(x, 0) == f"<{id(x)}:0>" and Dims(graph).at(x, 0) is None and named.at(x, 1) == 6


def test_the_editing_helpers_tell_the_watcher():
    graph = reshaped_graph()
    tensors = graph.tensors()
    heard: list = []
    with watching_edits(lambda ts: heard.append(sorted(t.name for t in ts))):
        replace_uses(graph, tensors["n"], _seven())
        shape = tensors["s"].inputs[0]
        set_output(shape, 0, gs.Variable("s2"))
    assert heard == [["n", "n1", "seven"], ["s", "s2"]]  # a replaced value's readers are told with it


def test_manager_keeps_gets_and_drops():
    graph, manager = reshaped_graph(), AnalysisManager()
    dims = manager.get(DimAnalysis, graph)
    assert manager.get(DimAnalysis, graph) is dims and manager.holds(DimAnalysis, graph)
    manager.put(Shapes(graph))
    manager.edited([graph.tensors()["n"]])  # dims follow edits; an analysis that cannot is dropped
    lost = manager.get(Analysis, graph)
    manager.edited([graph.tensors()["n"]])
    assert manager.holds(DimAnalysis, graph) and manager.holds(Shapes, graph) and not manager.holds(Analysis, graph)
    assert manager.get(Analysis, graph) is not lost
    manager.invalidate({Shapes})
    assert manager.holds(Shapes, graph) and not manager.holds(DimAnalysis, graph)


def test_sharpen_marks_the_kept_shapes_only():
    graph, manager = reshaped_graph(), AnalysisManager()
    manager.sharpen_shapes(graph)  # none kept: nothing to mark, none made up
    assert not manager.holds(Shapes, graph)
    manager.put(Shapes(graph))
    assert not manager.get(Shapes, graph).sharpened
    manager.sharpen_shapes(graph)
    assert manager.get(Shapes, graph).sharpened
    manager.put(Shapes(graph))  # inferred again: what inference knows is what the tensors say
    assert not manager.get(Shapes, graph).sharpened


def test_a_watcher_hears_only_its_own_threads_edits():
    """Two runs editing in threads at once: each run's analyses hear of its own edits, never the other's."""
    graphs = [reshaped_graph(), reshaped_graph()]
    heard: list[list] = [[], []]
    watching, edited = threading.Barrier(2, timeout=30), threading.Barrier(2, timeout=30)

    def edit(i: int) -> None:
        with watching_edits(lambda ts: heard[i].extend(t.name for t in ts)):
            watching.wait()  # both watchers are set before either edits
            tensors = graphs[i].tensors()
            set_output(tensors["s"].inputs[0], 0, gs.Variable(f"s_{i}"))
            edited.wait()

    threads = [threading.Thread(target=edit, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert heard == [["s", "s_0"], ["s", "s_1"]]
