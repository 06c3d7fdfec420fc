"""The pass manager and registry: fixed point, statistics, skip/select, opset/target gating, determinism."""
from __future__ import annotations

import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper

import k3opt
from k3opt.errors import PluginError, UsageError
from k3opt.pipeline.analyses import Shapes
from k3opt.pipeline.pass_base import Pass, PassContext
from k3opt.plugins import build_pipeline
from k3opt.pipeline.manager import PassManager
from tests.conftest import Crash, DropOneIdentity
from tests.helpers import assert_equivalent, make_model, op_counts


def identity_chain(n: int = 3):
    """x -> Identity x n -> Relu -> y."""
    nodes, prev = [], "x"
    for i in range(n):
        nodes.append(helper.make_node("Identity", [prev], [f"i{i}"], name=f"id{i}"))
        prev = f"i{i}"
    nodes.append(helper.make_node("Relu", [prev], ["y"], name="relu"))
    return make_model(nodes, [("x", TensorProto.FLOAT, [2, 3])], [("y", TensorProto.FLOAT, [2, 3])])


def run(model, passes, **ctx_kwargs):
    graph = gs.import_onnx(model)
    ctx = PassContext(opset=17, **ctx_kwargs)
    pm = PassManager(passes)
    total = pm.run(graph, ctx)
    return graph, pm, ctx, total


def test_runs_to_fixed_point_and_counts():
    graph, pm, _, total = run(identity_chain(3), [DropOneIdentity()])
    assert total == 3
    assert pm.rounds == 4  # three rounds with a rewrite, one that confirms the fixed point
    st = pm.stats["test-drop-one-identity"]
    assert (st.runs, st.rewrites, st.nodes_before, st.nodes_after) == (4, 3, 4, 1)
    assert st.time_s >= 0
    assert [s.rewrites for s in pm.steps] == [1, 1, 1, 0]
    assert [n.op for n in graph.nodes] == ["Relu"]


def test_max_rounds_bounds_the_run():
    graph = gs.import_onnx(identity_chain(5))
    pm = PassManager([DropOneIdentity()], max_rounds=2)
    assert pm.run(graph, PassContext(opset=17)) == 2
    assert pm.rounds == 2


def test_max_steps_stops_early():
    graph = gs.import_onnx(identity_chain(3))
    pm = PassManager([DropOneIdentity()])
    assert pm.run(graph, PassContext(opset=17), max_steps=2) == 2
    assert len(pm.steps) == 2


def test_min_opset_and_target_gate_passes_with_a_note():
    class NeedsNew(DropOneIdentity):
        name = "test-needs-new"
        min_opset = 99

    class CannOnly(DropOneIdentity):
        name = "test-cann-only"
        targets = ("cann",)

    _, pm, ctx, total = run(identity_chain(1), [NeedsNew(), CannOnly()])
    assert total == 0
    assert pm.stats["test-needs-new"].skipped == "needs opset 99, model has 17"
    assert "cann" in pm.stats["test-cann-only"].skipped
    assert any("test-needs-new skipped" in n for n in ctx.notes)


class NeedsShapes(Pass):
    name = "test-needs-shapes"
    needs_shapes = True

    def run(self, graph, ctx):
        return 0


class DropKeepingShapes(DropOneIdentity):
    name = "test-drop-keeping-shapes"
    preserves = frozenset({Shapes})


def refreshes(passes, model) -> int:
    """How many times the manager re-infers shapes while running ``passes`` on ``model``."""
    calls = []
    PassManager(passes, shape_inference=lambda g: calls.append(1) or True).run(
        gs.import_onnx(model), PassContext(opset=17))
    return len(calls)


def test_shapes_refreshed_only_when_graph_changed():
    # rounds 1 and 2 change the graph (refresh each), round 3 changes nothing (no refresh)
    assert refreshes([DropOneIdentity(), NeedsShapes()], identity_chain(2)) == 2


def test_a_pass_that_preserves_shapes_does_not_trigger_a_refresh():
    # the first refresh only: the rewrites since kept every shape
    assert refreshes([DropKeepingShapes(), NeedsShapes()], identity_chain(2)) == 1
    # a pass that does not preserve shapes still makes the next shape-needing pass re-infer:
    # rounds 1 and 2 each drop two Identities, one by the non-preserving pass
    assert refreshes([DropOneIdentity(), DropKeepingShapes(), NeedsShapes()], identity_chain(4)) == 2


class SharpeningDrop(DropKeepingShapes):
    """Drops an Identity keeping every shape, and marks them sharpened (as merge-equal-dims may)."""

    name = "test-sharpening-drop"

    def run(self, graph, ctx):
        n = super().run(graph, ctx)
        if n:
            ctx.analyses.sharpen_shapes(graph)
        return n


def sharpened_run(inferred: list) -> tuple[int, int]:
    """Rounds and shape inferences of a run whose k-th inference sets every computed tensor's shape to
    ``inferred[k]`` (the last one from then on)."""
    calls = []

    def infer(graph):
        shape = inferred[min(len(calls), len(inferred) - 1)]
        calls.append(1)
        for node in graph.nodes:
            for t in node.outputs:
                t.shape = shape
        return True

    pm = PassManager([NeedsShapes(), SharpeningDrop()], shape_inference=infer)
    pm.run(gs.import_onnx(identity_chain(1)), PassContext(opset=17))
    return pm.rounds, len(calls)


def test_sharpened_shapes_are_inferred_again_before_the_run_ends():
    # round 1 drops the Identity (shapes sharpened), round 2 rewrites nothing; inference then knows more,
    # so round 3 looks again, and ends the run (nothing sharpened since)
    assert sharpened_run([None, [2, 3]]) == (3, 2)
    # inference knows nothing more: round 2 was the fixed point
    assert sharpened_run([[2, 3]]) == (2, 2)


def test_builtin_pass_bug_propagates_plugin_bug_is_plugin_error(register):
    with pytest.raises(ValueError, match="boom"):
        run(identity_chain(1), [Crash()])

    class PluginCrash(Crash):
        name = "test-plugin-crash"
        plugin = "acme"

    with pytest.raises(PluginError, match="plugin 'acme', pass 'test-plugin-crash'"):
        run(identity_chain(1), [PluginCrash()])


def test_build_pipeline_select_skip_and_unknown(register):
    register(DropOneIdentity)
    register(Crash)
    assert [p.name for p in build_pipeline(["test-crash", "test-drop-one-identity"])] == [
        "test-crash", "test-drop-one-identity"]
    assert [p.name for p in build_pipeline(["test-crash", "test-drop-one-identity"], skip=["test-crash"])] == [
        "test-drop-one-identity"]
    default = [p.name for p in build_pipeline(None)]
    assert "test-crash" not in default  # default = False
    with pytest.raises(UsageError, match="unknown pass 'nope'; known passes: .*test-crash"):
        build_pipeline(["nope"])
    with pytest.raises(UsageError, match="unknown pass 'nope2'"):
        build_pipeline(None, skip=["nope2"])


def test_register_before_after_and_duplicates(register):
    register(DropOneIdentity)

    class Before(Crash):
        name = "test-before"

    class Clash(Crash):
        name = "test-drop-one-identity"

    register(Before, before="test-drop-one-identity")
    names = list(k3opt.plugins.registered_passes())
    assert names.index("test-before") < names.index("test-drop-one-identity")
    with pytest.raises(UsageError, match="already registered"):
        register(Clash)


def test_select_through_api_is_equivalent_idempotent_and_deterministic(register):
    register(DropOneIdentity)
    model = identity_chain(3)
    once = k3opt.optimize(model, passes=["test-drop-one-identity"], verify=True)
    assert op_counts(once) == {"Relu": 1}
    assert_equivalent(model, once)
    again = k3opt.optimize(model, passes=["test-drop-one-identity"])
    assert once.SerializeToString() == again.SerializeToString()
    report = k3opt.report.Report()
    twice = k3opt.optimize(once, passes=["test-drop-one-identity"], report=report)
    assert report.passes[0]["rewrites"] == 0
    assert twice.SerializeToString() == once.SerializeToString()


def test_fresh_names_are_deterministic():
    graph = gs.import_onnx(identity_chain(1))
    names = []
    for _ in range(2):
        ctx = PassContext(opset=17)
        PassManager([]).run(graph, ctx)
        names.append([ctx.fresh_name("i0"), ctx.fresh_name("i0"), ctx.fresh_name("new")])
    assert names[0] == names[1] == ["i0_1", "i0_2", "new"]


def test_counters_are_kept_per_pass():
    """Each pass's stats get what it added to ctx.counters; a counter set to its latest value (not summed)
    nets out to that value."""
    class Latest(Pass):
        name = "test-latest"

        def run(self, graph, ctx):
            seen = len(graph.nodes)
            ctx.count("nodes_seen", seen - ctx.counters.get("nodes_seen", 0))
            ctx.count("runs")
            return 0

    class Other(Pass):
        name = "test-other"

        def run(self, graph, ctx):
            ctx.count("runs", 10)
            return 0

    _, pm, ctx, _ = run(identity_chain(2), [DropOneIdentity(), Latest(), Other()])
    # Rounds 1 and 2 each drop an Identity; in round 3 only the dropper reruns (nothing else changed).
    assert ctx.counters == {"nodes_seen": 1, "runs": 2 + 20}
    assert pm.stats["test-latest"].counters == {"nodes_seen": 1, "runs": 2}
    assert pm.stats["test-other"].counters == {"runs": 20}
    assert pm.stats["test-drop-one-identity"].counters == {}


def test_a_pass_that_found_nothing_is_not_rerun_on_an_unchanged_graph():
    """MLIR-style: only a change by another pass can give an idle pass new work."""
    calls = []

    class Idle(Pass):
        name = "test-idle"

        def run(self, graph, ctx):
            calls.append(len(graph.nodes))
            return 0

    _, pm, _, _ = run(identity_chain(3), [Idle(), DropOneIdentity()])
    # Idle runs before each drop (3 changes) and once more after the last one; then nothing changes.
    assert calls == [4, 3, 2, 1]  # 3 Identities + Relu, one Identity fewer each round
    assert pm.stats["test-idle"].runs == 4


class CountsRelus(DropOneIdentity):
    """Drops Identities; counts Relus only in ``finish`` (report-only analysis of the final graph)."""

    name = "test-count-relus"

    def finish(self, graph, ctx):
        ctx.finished = getattr(ctx, "finished", 0) + 1
        ctx.count("relus", sum(n.op == "Relu" for n in graph.nodes) - ctx.counters.get("relus", 0))
        ctx.finished_with = [n.op for n in graph.nodes]


def test_finish_sees_the_final_graph_once_and_its_counters_are_the_passes():
    graph, pm, ctx, total = run(identity_chain(3), [CountsRelus()])
    assert total == 3 and ctx.finished == 1 and ctx.finished_with == ["Relu"]
    assert pm.stats["test-count-relus"].counters == {"relus": 1} and pm.stats["test-count-relus"].runs == 4


def test_finish_is_skipped_when_the_run_is_cut_short():
    graph = gs.import_onnx(identity_chain(3))
    ctx = PassContext(opset=17)
    PassManager([CountsRelus()]).run(graph, ctx, max_steps=2)
    assert not hasattr(ctx, "finished")


def test_a_failing_finish_names_the_plugin_pass():
    class Broken(DropOneIdentity):
        name = "test-broken-finish"
        plugin = "myplugin"

        def finish(self, graph, ctx):
            raise ValueError("boom")

    with pytest.raises(PluginError, match="plugin 'myplugin', pass 'test-broken-finish' failed: ValueError: boom"):
        run(identity_chain(1), [Broken()])
