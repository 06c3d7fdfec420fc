"""The pass manager: runs a pipeline to a fixed point and keeps statistics.

A round runs every pass once in order; rounds repeat until one makes no
rewrite (or ``max_rounds`` is reached), and shapes a pass marked sharpened
(:attr:`Shapes.sharpened`) do not change when inferred again. Then each pass's ``finish`` looks at the
final graph once (report-only analysis). A pass that found nothing to do is
not rerun until some other pass has changed the graph. Each pass execution is a "step";
``max_steps`` stops after that many steps, which is how verification
bisects to the first pass whose output diverges.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

from ..errors import K3optError, PluginError
from ..graph.ir import Graph, NameScope, all_graphs, watching_edits
from .analyses import Shapes
from .op_census import OpCensus
from .pass_base import Pass, PassContext


@dataclasses.dataclass
class PassStats:
    """What one pass did over the whole run."""

    name: str
    runs: int = 0
    rewrites: int = 0
    time_s: float = 0.0
    nodes_before: Optional[int] = None
    nodes_after: Optional[int] = None
    skipped: Optional[str] = None
    plugin: Optional[str] = None
    #: What the pass added to ``PassContext.counters`` (e.g. rmsnorm_found), over all its runs.
    counters: dict[str, int] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Step:
    """One pass execution: which round, which pass, how many rewrites."""

    round: int
    name: str
    rewrites: int


def _typed(graph: Graph) -> list[tuple[object, Optional[tuple]]]:
    """Dtype and shape of every tensor the nodes of ``graph`` and its bodies compute, in node order."""
    return [(t.dtype, None if t.shape is None else tuple(t.shape))
            for g in all_graphs(graph) for n in g.nodes for t in n.outputs]


def _skip_reason(p: Pass, ctx: PassContext) -> Optional[str]:
    """Why ``p`` does not run in ``ctx`` (opset, target), else None."""
    if ctx.emit_opset < p.min_opset:
        has = "model has" if ctx.emit_opset == ctx.opset else "output gets"
        return f"needs opset {p.min_opset}, {has} {ctx.emit_opset}"
    if p.targets is not None and ctx.target not in p.targets:
        return f"applies to target(s) {', '.join(p.targets)} only"
    return p.skip_reason(ctx)


class PassManager:
    """Runs passes over a graph to a fixed point.

    ``shape_inference`` is a callable ``(graph) -> bool`` that refreshes the
    tensors' shapes in place and returns False when inference failed; the
    manager calls it before a pass that ``needs_shapes`` whenever a pass that
    does not preserve :class:`Shapes` changed the graph since the last call.
    After a pass that rewrote, the analyses it does not preserve are dropped
    (``Pass.preserves``); while it runs, they hear of its edits.
    """

    def __init__(
        self,
        passes: list[Pass],
        *,
        max_rounds: int = 8,
        shape_inference: Optional[Callable[[Graph], bool]] = None,
        progress: Optional[Callable[[str], None]] = None,
    ):
        self.passes = passes
        self.max_rounds = max_rounds
        self.shape_inference = shape_inference
        self.progress = progress
        self.stats: dict[str, PassStats] = {
            p.name: PassStats(p.name, plugin=p.plugin) for p in passes
        }
        self.steps: list[Step] = []
        self.rounds = 0

    def run(self, graph: Graph, ctx: PassContext, max_steps: Optional[int] = None,
            graphs: Optional[list[Graph]] = None, lifted: int = 0) -> int:
        """Run to a fixed point (or ``max_steps`` pass executions); returns total rewrites.

        ``graphs``: ``list(all_graphs(graph))`` when the caller knows it (``[graph]``: no body), not walked again.
        ``lifted``: Constant nodes the caller lifted into initializers for the first pass (see
        :meth:`lifts_constants_first`), counted as its rewrites and among the nodes it started from.
        """
        if ctx.names is None:
            ctx.names = NameScope(graph, graphs=graphs)
        runnable = [p for p in self.passes if self._applicable(p, ctx)]
        if lifted:
            st = self.stats[runnable[0].name]
            st.rewrites, st.nodes_before = st.rewrites + lifted, len(graph.nodes) + lifted
        outer, ctx.census = ctx.census, OpCensus(graphs)  # shared by the passes of one graph version
        ctx.analyses.invalidate()  # what an earlier run kept is of another graph, or another version
        if ctx.shapes_available:  # the caller inferred them (api: ShapeRefresher.seed)
            ctx.analyses.put(Shapes(graph))
        try:
            total = self._rounds(runnable, graph, ctx, max_steps)
            if max_steps is None:  # a run cut short (bisection) has no final graph to report on
                for p in runnable:
                    self._guarded(p, lambda: p.finish(graph, ctx), ctx)
            return total
        finally:
            ctx.census = outer
            ctx.changed()  # an enclosing run's census (a pass running passes) may no longer hold
            ctx.analyses.invalidate()  # nor its analyses; and the kept ones need not outlive the run
            for p in runnable:
                p.end_run()

    def _rounds(self, runnable: list[Pass], graph: Graph, ctx: PassContext, max_steps: Optional[int]) -> int:
        analyses = ctx.analyses
        total = 0
        # The graph's version bumps with every rewrite; a pass that found nothing
        # to do at the current version would find nothing again, so it is not rerun.
        version = 0
        idle_at: dict[int, int] = {}
        for rnd in range(1, self.max_rounds + 1):
            self.rounds = rnd
            round_rewrites = 0
            for p in runnable:
                if idle_at.get(id(p)) == version:
                    continue
                if max_steps is not None and len(self.steps) >= max_steps:
                    return total
                if p.needs_shapes and self.shape_inference is not None and not analyses.holds(Shapes, graph):
                    ctx.shapes_available = self.shape_inference(graph)
                    analyses.invalidate()  # every other analysis read the old shapes
                    analyses.put(Shapes(graph))
                if self.progress is not None:
                    self.progress(f"round {rnd}: {p.name}")
                n = self._run_one(p, graph, ctx)
                self.steps.append(Step(rnd, p.name, n))
                if n:
                    analyses.invalidate(p.preserves)
                    version += 1
                    ctx.changed(p._hints.adds_bodies)
                else:
                    idle_at[id(p)] = version
                round_rewrites += n
            total += round_rewrites
            if round_rewrites == 0:
                if not self._sharper_shapes(graph, ctx):
                    break
                version += 1  # every pass looks again, at what inference now knows
        return total

    def _sharper_shapes(self, graph: Graph, ctx: PassContext) -> bool:
        """At the end of a round without rewrites: when a pass marked the kept shapes sharpened, infer
        again; True when a tensor's shape or dtype changed (the run is then not at its fixed point)."""
        analyses = ctx.analyses
        if self.shape_inference is None or not analyses.holds(Shapes, graph) or \
                not analyses.get(Shapes, graph).sharpened:
            return False
        before = _typed(graph)
        ctx.shapes_available = self.shape_inference(graph)
        analyses.invalidate()
        analyses.put(Shapes(graph))
        return _typed(graph) != before

    def lifts_constants_first(self, ctx: PassContext) -> bool:
        """Whether the first pass to run promises :attr:`Hints.lifts_constant_nodes`: the caller may then lift
        the model's Constant nodes before the import (``modelio.lift_constant_nodes``) and pass ``lifted``."""
        first = next((p for p in self.passes if _skip_reason(p, ctx) is None), None)
        return first is not None and first._hints.lifts_constant_nodes

    def _applicable(self, p: Pass, ctx: PassContext) -> bool:
        reason = _skip_reason(p, ctx)
        if reason:
            self.stats[p.name].skipped = reason
            ctx.note(f"pass {p.name} skipped: {reason}")
            return False
        return True

    def _run_one(self, p: Pass, graph: Graph, ctx: PassContext) -> int:
        st = self.stats[p.name]
        before = len(graph.nodes)
        if st.nodes_before is None:
            st.nodes_before = before
        n = int(self._guarded(p, lambda: p.run(graph, ctx), ctx) or 0)
        st.runs += 1
        st.rewrites += n
        st.nodes_after = len(graph.nodes)
        return n

    def _guarded(self, p: Pass, call: Callable[[], object], ctx: PassContext) -> object:
        """``call()`` (the pass's run or finish), timed into its stats with the counters it adds; a failure
        names the pass (and plugin)."""
        st = self.stats[p.name]
        counted = dict(ctx.counters)
        outer, ctx.current_pass = ctx.current_pass, p.name
        outer_adds, ctx.pass_adds_bodies = ctx.pass_adds_bodies, p._hints.adds_bodies
        t0 = time.perf_counter()
        try:
            with watching_edits(ctx.analyses.edited):
                result = call()
        except K3optError:
            raise
        except (Exception, SystemExit) as exc:  # a pass bug must name the pass (and plugin); a plugin's exit too
            if p.plugin:
                raise PluginError(
                    f"plugin '{p.plugin}', pass '{p.name}' failed: {type(exc).__name__}: {exc}"
                ) from exc
            raise
        finally:
            st.time_s += time.perf_counter() - t0
            ctx.current_pass, ctx.pass_adds_bodies = outer, outer_adds
        for key, value in ctx.counters.items():
            if value != counted.get(key, 0):
                st.counters[key] = st.counters.get(key, 0) + value - counted.get(key, 0)
        st.counters = {k: v for k, v in st.counters.items() if v}
        return result
