"""The Pass abstraction, the context passes run in, and the pass registry.

One pass, one job (LLVM/MLIR style). A pass declares what it needs (shapes,
a minimum opset, a target); the pass manager honours that and keeps the
statistics. Built-in passes are found in their modules (:func:`discover_passes`); plugins and code
register passes with :func:`register_pass`, into the current :class:`~k3opt.pipeline.registry.PassRegistry`.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
from typing import Any, Callable, ClassVar, Collection, Optional, Type

from . import registry
from ..graph.ir import Graph, Node, NameScope, all_graphs
from .analyses import A, AnalysisManager, DimAnalysis
from .op_census import OpCensus
from .target_traits import STANDARD, TargetTraits


@dataclasses.dataclass
class PassContext:
    """What a pass may know about the run: opset, target, options, and a place for notes.

    ``opset`` is the graph's opset while the passes run (what to match);
    ``output_opset`` the lower one it is converted down to after them, if
    any. What a pass emits must exist in both: see :attr:`emit_opset`.
    ``notes`` end up in the report ("skipped X because ..."): a pass that
    declines work for a reason a user would want to know records it here.
    """

    opset: int
    #: The run's target (a :class:`k3opt.targets.Target`; standard ONNX's traits when none is given): passes read
    #: its traits (``ctx.target.fuses_to_standard_ops``...), never its name (it compares equal to its name).
    target: TargetTraits = STANDARD
    output_opset: Optional[int] = None
    shapes_available: bool = False
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    names: Optional[NameScope] = None
    # Free-form per-pass counters beyond "rewrites" (e.g. rmsnorm_found).
    counters: dict[str, int] = dataclasses.field(default_factory=dict)
    #: Set by the pass manager while it runs (see :meth:`nodes_of`); None: every question scans the graph.
    census: Optional[OpCensus] = dataclasses.field(default=None, repr=False, compare=False)
    #: The pass running now (set by the pass manager): :meth:`site` and :meth:`note` records name it.
    current_pass: Optional[str] = None
    #: The running pass's ``Hints.adds_bodies`` (set by the pass manager; True outside a pass).
    pass_adds_bodies: bool = dataclasses.field(default=True, repr=False, compare=False)
    #: What happened at each fusion candidate, keyed (pass, rule, site): see :meth:`site`.
    sites: dict[tuple[str, str, str], dict[str, str]] = dataclasses.field(default_factory=dict)
    #: The pass that recorded each note (notes recorded outside a pass are absent).
    note_passes: dict[str, str] = dataclasses.field(default_factory=dict)
    #: The analyses of this run (see :meth:`analysis`).
    analyses: AnalysisManager = dataclasses.field(default_factory=AnalysisManager, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.target, TargetTraits):  # pipeline sits below the targets: it cannot look names up
            raise TypeError(f"PassContext(target={self.target!r}): a Target, e.g. k3opt.targets.get_target(name)")

    def forget_graph(self) -> None:
        """Drop what refers to the graph the passes ran on (its names, census, analyses): the run keeps this
        context for its notes and bisection, and the graph's constants would keep the input's weights alive."""
        self.names = None
        self.census = None
        self.analyses = AnalysisManager()

    @property
    def emit_opset(self) -> int:
        """The newest opset an emitted op may need: the graph's, or the output's when that is lower."""
        return min(self.opset, self.output_opset or self.opset)

    def note(self, message: str) -> None:
        """Record a report note once (passes run repeatedly to a fixed point)."""
        if message not in self.notes:
            self.notes.append(message)
        if self.current_pass is not None:
            self.note_passes.setdefault(message, self.current_pass)

    def site(self, site: str, status: str, reason: str = "", rule: str = "") -> None:
        """Record the outcome at one fusion candidate for the report: "applied", or "declined" with the reason.

        Rounds repeat candidates: the first reason a site was declined for is kept, and "applied" wins.
        """
        key = (self.current_pass or "", rule, site)
        if key not in self.sites or status == "applied":
            self.sites[key] = {"pass": key[0], "rule": rule, "site": site, "status": status, "reason": reason}

    def site_records(self) -> list[dict[str, str]]:
        """The report's ``sites``: each candidate's outcome (a site a pass fused is not also listed as declined
        by it), then each note with the pass that made it (status "note")."""
        applied = {(r["pass"], r["site"]) for r in self.sites.values() if r["status"] == "applied"}
        records = [r for r in self.sites.values() if r["status"] == "applied" or (r["pass"], r["site"]) not in applied]
        return records + [{"pass": self.note_passes[n], "rule": "", "site": "", "status": "note", "reason": n}
                          for n in self.notes if n in self.note_passes]

    def fresh_name(self, base: str) -> str:
        """A deterministic tensor/node name not yet used in the graph."""
        assert self.names is not None, "PassContext.names is set by the pass manager"
        return self.names.fresh(base)

    def count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    def nodes_of(self, graph: Graph, ops: Collection[str]) -> list[Node]:
        """The nodes of ``graph`` (not of its bodies) whose op type is in ``ops``, in graph order.

        Under the pass manager the answer comes from the :class:`OpCensus` every pass at this graph
        version shares. A pass that asks again after rewriting within the same run calls
        :meth:`changed` first.
        """
        if self.census is None:
            return [n for n in graph.nodes if n.op in ops]
        return self.census.nodes_of(graph, ops)

    def ops_in(self, graph: Graph) -> set[str]:
        """The op types of the nodes of ``graph`` (not of its bodies): a pass may skip work needing one absent."""
        return {n.op for n in graph.nodes} if self.census is None else self.census.ops_in(graph)

    def owns(self, graph: Graph, node: Node) -> bool:
        """``node`` is one of ``graph``'s own nodes, not of an enclosing graph (whose values a body reads).

        A rewrite that merges a producer into its reader must not reach into the enclosing graph: the
        producer would be detached there but stay in that graph's node list.
        """
        if self.census is None:
            return any(n is node for n in graph.nodes)
        return self.census.owns(graph, node)

    def graphs(self, graph: Graph) -> list[Graph]:
        """``graph`` and every body nested in it, outermost first (``list(ir.all_graphs(graph))``)."""
        return list(all_graphs(graph)) if self.census is None else self.census.graphs(graph)

    def analysis(self, cls: Type[A], graph: Graph) -> A:
        """The ``cls`` analysis of ``graph`` (e.g. ``DimAnalysis``): kept by the run until a pass changes
        the graph without declaring it preserved (:attr:`Pass.preserves`)."""
        return self.analyses.get(cls, graph)

    def dims(self, graph: Graph) -> DimAnalysis:
        """The run's traced dims and shape values of ``graph`` (``dims.at(t, i)``, ``dims.elements(t)``...):
        ``analysis(DimAnalysis, graph)``."""
        return self.analyses.get(DimAnalysis, graph)

    def changed(self, bodies_added: Optional[bool] = None) -> None:
        """The graph was rewritten: later :meth:`nodes_of`/:meth:`graphs` answers look at it afresh.
        ``bodies_added``: whether the rewrites may have given a graph bodies (default: what the running
        pass promises, :attr:`Hints.adds_bodies`)."""
        if self.census is not None:
            self.census.clear(self.pass_adds_bodies if bodies_added is None else bodies_added)


@dataclasses.dataclass(frozen=True)
class Hints:
    """What one of k3opt's own passes promises the run so that it can skip work: performance, not meaning, and
    not part of the pass API (a wrong promise makes the run miss a new body or a Constant node), so a plugin's
    pass keeps these safe defaults. A built-in pass sets ``_hints = Hints(...)``."""

    #: The pass may give a graph an If/Loop/Scan body it did not hold (it builds a graph attribute). False
    #: lets the run go on knowing that a body-free graph holds none, instead of walking every node's
    #: attributes again after each rewrite.
    adds_bodies: bool = True
    #: The pass's run starts by turning the graph's Constant nodes into initializers of the same name
    #: (fold-constants): when it runs first, the run lifts the ones it can on the model before the import
    #: (:func:`k3opt.modelio.lift_constant_nodes`) and credits them to the pass's statistics.
    lifts_constant_nodes: bool = False


class Pass:
    """A graph transformation. Subclasses set the class attributes and implement :meth:`run`.

    ``run`` mutates the graph in place and returns how many rewrites it made
    (0 means "nothing to do": the pass manager's fixed point is reached when
    a whole round returns 0 everywhere).
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    #: Position in the default pipeline (lower runs first); plugins default to the end.
    order: ClassVar[float] = 1000.0
    #: Run shape inference before this pass if the graph changed since the last one.
    needs_shapes: ClassVar[bool] = False
    #: The analyses (:mod:`k3opt.pipeline.analyses` classes) the pass's rewrites leave true, as MLIR's
    #: preserved set: the manager drops every other one after a run that rewrote. With ``Shapes``, the
    #: next pass that needs shapes does not get them re-inferred. Empty (drop all) is always safe.
    preserves: ClassVar[frozenset[type]] = frozenset()
    #: The pass is skipped (with a note) when the graph's or the output's default-domain opset is below this.
    min_opset: ClassVar[int] = 1
    #: Op types every rewrite of the pass starts from: when a model holds none, the pass cannot apply
    #: (:meth:`could_apply`). None: any graph may be rewritten.
    anchor_ops: ClassVar[Optional[frozenset[str]]] = None
    #: Targets the pass applies to; None means every target.
    targets: ClassVar[Optional[tuple[str, ...]]] = None
    #: A target lowering (e.g. to NPU ops for cann): runs in a second pass-manager run, after the other
    #: passes reached their fixed point and were verified in onnxruntime (which may not run what it emits).
    lowering: ClassVar[bool] = False
    #: In the default pipeline? (False: only when selected with --passes.)
    default: ClassVar[bool] = True
    #: Name of the plugin that registered the pass, None for built-ins.
    plugin: ClassVar[Optional[str]] = None
    #: Keys the pass reads from ``PassContext.options`` -> one-line help (with the default).
    #: ``k3opt passes`` lists them; ``--pass-option KEY=VALUE`` sets them.
    options: ClassVar[dict[str, str]] = {}
    #: Option key -> parser (k3opt/pipeline/option_values.py): values are parsed and range-checked before
    #: any work, and the passes read the parsed value. An option without one is handed over as given.
    option_values: ClassVar[dict[str, Callable[[Any], Any]]] = {}
    # What k3opt's own passes promise the run (:class:`Hints`): not the pass API, a plugin keeps the safe defaults.
    _hints: ClassVar[Hints] = Hints()

    def run(self, graph: Graph, ctx: PassContext) -> int:  # pragma: no cover - interface
        raise NotImplementedError

    def skip_reason(self, ctx: PassContext) -> Optional[str]:
        """Why the pass does not run in ``ctx`` beyond opset and target (e.g. an option rules it out), else None."""
        return None

    @classmethod
    def could_apply(cls, ops: Collection[str]) -> bool:
        """Whether the pass may rewrite a model holding the op types ``ops`` (from :attr:`anchor_ops`): the run
        raises a model's opset for a pass with a higher :attr:`min_opset` only when it could apply."""
        return cls.anchor_ops is None or not cls.anchor_ops.isdisjoint(ops)

    def finish(self, graph: Graph, ctx: PassContext) -> None:
        """Called once on the final graph, after the fixed point: analysis that only the final graph's
        answer matters for (counts and notes for the report), kept out of the rounds. Must not change
        the graph. Default: nothing."""

    def end_run(self) -> None:
        """Called when the manager's run ends (finished or cut short): let go of what the pass kept across
        rounds that refers to the graph (its nodes, its constants): the pass outlives the graph, whose
        constants would keep the input model's weights in memory. Default: nothing."""


def register_pass(
    cls: Type[Pass],
    *,
    before: Optional[str] = None,
    after: Optional[str] = None,
    plugin: Optional[str] = None,
    replace: bool = False,
) -> Type[Pass]:
    """Add a pass class to the current registry (usable as a class decorator): the process's, or while a run
    loads its plugins, the run's (:mod:`k3opt.pipeline.registry`).

    ``before``/``after`` name a registered pass; the new pass's ``order`` is
    set just before/after it. ``plugin`` marks who registered it (shown by
    ``k3opt passes``). Re-registering a name is an error unless ``replace``.
    """
    return registry.current().register(cls, before=before, after=after, plugin=plugin, replace=replace)


def unregister_pass(name: str) -> None:
    """Remove a pass from the current registry (tests and plugin reloads)."""
    registry.current().unregister(name)


def discover_passes(package: str) -> list[Type[Pass]]:
    """The pass classes of ``package``: every :class:`Pass` subclass with a name that a module of the package
    holds under a public name (modules and names starting with ``_`` are helpers), in module order.

    A pass module defines its passes and nothing registers them: adding a pass is adding a module. The api
    layer finds the built-ins this way (``k3opt.passes``, each target's ``passes/``) for the process registry.
    """
    root = importlib.import_module(package)
    depth = package.count(".") + 1
    found: list[Type[Pass]] = []
    for info in sorted(pkgutil.walk_packages(root.__path__, f"{package}."), key=lambda i: i.name):
        if info.ispkg or any(part.startswith("_") for part in info.name.split(".")[depth:]):
            continue
        for attr, value in vars(importlib.import_module(info.name)).items():
            if (not attr.startswith("_") and inspect.isclass(value) and issubclass(value, Pass) and value.name
                    and value not in found):
                found.append(value)
    return found
