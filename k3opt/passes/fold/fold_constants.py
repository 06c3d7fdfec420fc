"""fold-constants: evaluate at compile time everything that does not depend on the model's inputs.

One run repeats three sweeps until nothing changes:

1. ``Constant`` nodes become initializers (except those feeding a graph
   output directly, which must stay nodes to keep the output a node output;
   when this pass runs first, the run has lifted the small ones already, on
   the model before its import: :mod:`k3opt.modelio.constant_nodes`);
2. shape computations fold from inferred shapes (:mod:`k3opt.graph.symbolic.dims`), so a
   model exported with static input shapes loses its shape subgraphs;
3. nodes whose inputs are all constant are grouped into connected subgraphs
   and each group is evaluated in one onnxruntime session; if that fails,
   node by node in onnxruntime, then in ``onnx.reference``; a node that
   still fails is left as it is (and not retried). A group computing in
   float16/bfloat16 folds only the values its float32 twin agrees with
   (:mod:`._low_precision`: onnxruntime computes such runs in float32).

Refused: DequantizeLinear (folding it would store a quantized weight back in
float, 4-8x its size), random ops, training-mode Dropout, ops of custom domains, ops that
grow the model past the size guard (:mod:`.fold_guard`), graph inputs that
have a default initializer (the user may override them), and values
onnxruntime returns as sequences or optionals (no initializer can hold
them). Only initializers feeding foldable nodes are read, so weights of
external-data models stay on disk.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
from ... import graph as gs

from ...graph.ir import (
    Graph, Node, Tensor, as_constant, const_value, constant_in_place, is_graph_output, node_subgraphs, outer_refs,
    producer, replace_uses, set_output,
)
from ...pipeline.option_values import byte_size, count
from ...pipeline.pass_base import Hints, Pass, PassContext
from .._rewire import detach, is_used, remove
from .._shared.op_kinds import RANDOM_OPS
from ..fold._eval import EvalError, as_array, run_ort, run_reference
from ..fold._guard import too_big
from ..fold._low_precision import disagreeing
from ...graph.small_constants import remember_value
from ...graph.symbolic.dims import Dims
from ..fold._starts import is_constant, start_nodes, still_in

FOLDABLE_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml", "ai.onnx.preview.training", "com.microsoft"})
SHAPE_OPS = frozenset({"Shape", "Size", "Gather", "Slice", "Equal"})
MAX_SWEEPS = 32


class FoldConstants(Pass):
    name = "fold-constants"
    description = "Evaluate constant subgraphs and statically known shape computations at compile time."
    order = 100
    _hints = Hints(adds_bodies=False, lifts_constant_nodes=True)  # _constant_nodes: the first step of a run
    options = {
        "fold_max_bytes": "largest Expand/Tile/ConstantOfShape/Range result folded, in bytes (default 1 MiB)",
        "fold_max_elements": "largest such result folded, in elements (default 1Mi)",
    }
    option_values = {"fold_max_bytes": byte_size, "fold_max_elements": count}
    needs_shapes = True

    def __init__(self) -> None:
        # Nodes that failed to evaluate with every evaluator (kept alive so ids stay unique).
        self._failed: dict[int, Node] = {}

    def end_run(self) -> None:
        self._failed.clear()

    def run(self, graph: Graph, ctx: PassContext) -> int:
        """Fold ``graph``, then each body of the nodes it still holds (If/Loop/Scan), outermost first."""
        # One dims analysis for every sweep and graph: the editing helpers tell it what each change rewired
        # (traces are re-walked only there); the symbols the main graph declares are not traced.
        dims = ctx.dims(graph)
        if len(ctx.graphs(graph)) == 1:
            return self._fold_graph(graph, ctx, dims)
        total, pending = 0, [graph]
        while pending:
            g = pending.pop(0)
            n = self._fold_graph(g, ctx, dims)
            if n:
                ctx.changed()  # the census answers for the next graph must see this one's rewrites
            total += n
            pending += [body for holder in _holders(g) for body in node_subgraphs(holder)]
        return total

    def _fold_graph(self, graph: Graph, ctx: PassContext, dims: Dims) -> int:
        """The sweeps over one graph (not its bodies)."""
        # The census is asked before any rewrite (the manager drops it after a run that rewrote). No sweep
        # adds a shape op, so each sweep's candidates are those of the sweep before still in the graph.
        shape_nodes = ctx.nodes_of(graph, SHAPE_OPS)
        total = self._constant_nodes(graph, ctx)
        none_foldable = False  # the last value sweep found no foldable node, and left the graph as it was
        starts: Optional[list[Node]] = None  # the value walk's start nodes at its last sweep
        installed: list[tuple[Tensor, Tensor]] = []  # (tensor, constant) installed since
        for _ in range(MAX_SWEEPS):
            shape_nodes = still_in(graph, shape_nodes)
            n, touched = self._fold_shapes(graph, ctx, dims, shape_nodes, installed)
            if none_foldable and not touched:
                break  # the graph is as that sweep saw it: no node is foldable still (n is 0)
            starts = start_nodes(graph, starts, installed)
            installed.clear()
            order = self._foldable(graph, ctx, starts)
            none_foldable = not order
            n += self._fold_values(graph, ctx, order, installed)
            if not n:
                break
            total += n
        return total

    # -- sweep 1 -----------------------------------------------------------
    def _constant_nodes(self, graph: Graph, ctx: PassContext) -> int:
        """Turn ``Constant`` nodes into initializers (their output names are kept)."""
        dead: list[Node] = []
        for node in ctx.nodes_of(graph, ("Constant",)):
            if (node.domain or "") not in FOLDABLE_DOMAINS or len(node.outputs) != 1:
                continue
            out = node.outputs[0]
            if is_graph_output(graph, out) or not out.outputs:
                continue
            if constant_in_place(node):  # no inputs, its output now the constant: nothing else to unlink
                dead.append(node)
        remove(graph, dead)
        return len(dead)

    # -- sweep 2 -----------------------------------------------------------
    def _fold_shapes(self, graph: Graph, ctx: PassContext, dims: Dims, nodes: list[Node],
                     made: list) -> tuple[int, bool]:
        """Fold the shape computations among ``nodes`` (the graph's, in graph order), adding to ``made`` what
        is installed; returns (nodes removed, whether the graph changed at all)."""
        folded: list[Node] = []
        installed: list = []
        for node in nodes:
            if (node.domain or "") in ("", "ai.onnx") and is_used(graph, node.outputs[0]):
                value = dims.fold(node)
                if value is not None and _install(graph, ctx, node.outputs[0], value, installed):
                    folded.append(node)
        n = _drop_dead(graph, folded)
        made += installed
        _take_names(installed)
        return n, bool(folded)

    # -- sweep 3 -----------------------------------------------------------
    def _fold_values(self, graph: Graph, ctx: PassContext, order: list[Node], made: list) -> int:
        """Evaluate ``order`` (:meth:`_foldable`'s answer) and install what it hands to the rest of the graph,
        adding it to ``made``."""
        if not order:
            return 0
        changed = 0
        dead: list[Node] = []
        installed: list = []
        groups = _groups(order)
        everything = self._evaluate_all(graph, order) if len(groups) > 1 else None
        for group in groups:
            members = {id(n) for n in group}
            values = everything if everything is not None else self._evaluate(graph, group)
            handed_on = {t.name: values.get(t.name) for node in group for t in node.outputs
                         if t.name and _escapes(graph, t, members)}
            refused = disagreeing(graph, group, handed_on)
            for node in group:
                for t in node.outputs:
                    if t.name in refused:  # onnxruntime computes it otherwise: left to the runtime, not retried
                        self._failed[id(node)] = node
                        continue
                    arr = as_array(values.get(t.name)) if t.name else None
                    if arr is not None and _escapes(graph, t, members) and _install(graph, ctx, t, arr, installed):
                        changed += 1
            dead.extend(reversed(group))
        if not changed:
            return 0
        changed += _drop_dead(graph, dead)
        made += installed
        _take_names(installed)
        return changed

    def _foldable(self, graph: Graph, ctx: PassContext, starts: list[Node]) -> list[Node]:
        """Foldable nodes in topological order (a worklist from ``starts``, the nodes with constant inputs)."""
        overridable = {id(t) for t in graph.inputs}
        in_graph = {id(n) for n in graph.nodes}
        pending: set[int] = set()
        chosen: list[Node] = []
        seen: set[int] = set()

        def ready(t: Tensor) -> bool:
            return not t.name or id(t) in pending or is_constant(t, overridable)

        def value(t: Tensor) -> Optional[np.ndarray]:
            return None if id(t) in pending else const_value(t)

        # Depth-first from constant-fed nodes, no recursion limit. Only nodes whose inputs are all constant now
        # start a walk: any other node is reached (and decided, in the same state) as a reader of the last of
        # its inputs to become pending, before the walk comes back to where it would start.
        stack = starts[::-1]
        holders: Optional[list[Node]] = None
        while stack:
            node = stack.pop()
            # Cheapest test first: most nodes read a non-constant input.
            if id(node) in seen or not all(map(ready, node.inputs)) or id(node) not in in_graph:
                continue
            if not self._eligible(graph, node) or not all(ready(t) for t in outer_refs(node)):
                continue
            if too_big(node, value, ctx.options):
                continue
            seen.add(id(node))
            chosen.append(node)
            pending.update(id(t) for t in node.outputs)
            for t in node.outputs:
                for c in t.outputs:
                    if id(c) in in_graph:
                        stack.append(c)
                    else:  # read inside a body: the nodes holding bodies are candidates
                        holders = _holders(graph) if holders is None else holders
                        stack.extend(holders)
        return chosen

    def _eligible(self, graph: Graph, node: Node) -> bool:
        if node.op == "Constant" or (node.domain or "") not in FOLDABLE_DOMAINS or node.op in RANDOM_OPS:
            return False
        if node.op == "DequantizeLinear":  # a quantized weight stays quantized (k3opt quantize's output)
            return False
        if id(node) in self._failed or not any(is_used(graph, t) for t in node.outputs):
            return False
        if node.op == "Dropout" and len(node.inputs) > 2 and node.inputs[2].name:
            mode = const_value(node.inputs[2])
            return mode is not None and not bool(np.asarray(mode))
        return True

    @staticmethod
    def _evaluate_all(graph: Graph, order: list[Node]) -> Optional[dict[str, object]]:
        """The outputs ``order`` hands to the rest of the graph, in one onnxruntime session; None on failure."""
        members = {id(n) for n in order}
        wanted = [t.name for n in order for t in n.outputs if t.name and _escapes(graph, t, members)]
        try:
            return run_ort(graph, order, wanted, {})
        except EvalError:
            return None

    def _evaluate(self, graph: Graph, group: list[Node]) -> dict[str, object]:
        """Values of the group's outputs: one session, else node by node with fallbacks."""
        values = self._evaluate_all(graph, group)
        if values is not None:
            return values
        known: dict[str, object] = {}
        for node in group:
            if any(t.name and t.name not in known and not _is_static(t) for t in node.inputs + outer_refs(node)):
                continue
            outs = [t.name for t in node.outputs if t.name]
            try:
                got = run_ort(graph, [node], outs, _arrays(known))
            except EvalError:
                try:
                    got = run_reference(graph, node, _arrays(known))
                except EvalError:
                    self._failed[id(node)] = node
                    continue
            known.update(got)
        return known


def _holders(graph: Graph) -> list[Node]:
    """Nodes with subgraphs: a reader inside a body makes them candidates."""
    return [n for n in graph.nodes if any(isinstance(a, gs.Graph) for a in n.attrs.values())]


def _is_static(t: Tensor) -> bool:
    p = producer(t)
    return isinstance(t, gs.Constant) or (p is not None and p.op == "Constant")


def _arrays(known: dict[str, object]) -> dict[str, np.ndarray]:
    return {k: a for k, v in known.items() if (a := as_array(v)) is not None}


def _escapes(graph: Graph, t: Tensor, members: set[int]) -> bool:
    """True when ``t`` is needed outside the group (a graph output or read by a non-member)."""
    return is_graph_output(graph, t) or any(id(c) not in members for c in t.outputs)


def _install(graph: Graph, ctx: PassContext, t: Tensor, value: np.ndarray, installed: list) -> Optional[gs.Constant]:
    """Make ``t``'s readers read the constant ``value``.

    A graph output gets a ``Constant`` node producing it under its own name
    (an initializer as graph output is legal ONNX but not every runtime takes
    it); other readers read a new initializer, returned so that it can take
    ``t``'s name once ``t`` is gone. Either way ``(t, const)`` is added to
    ``installed``. Returns None (graph untouched) when ``value`` cannot be
    stored as a tensor.
    """
    try:
        const = as_constant(ctx.fresh_name(t.name), value)
    except Exception:  # e.g. an object array onnx cannot encode: leave the node
        return None
    remember_value(const, value)
    if is_graph_output(graph, t):
        p = producer(t)
        if p is not None:
            set_output(p, [i for i, o in enumerate(p.outputs) if o is t][0], gs.Variable(ctx.fresh_name(t.name)))
        graph.nodes.insert(0, gs.Node("Constant", ctx.fresh_name(t.name + "_const"), {"value": const}, [], [t]))
        installed.append((t, const))  # t keeps its name (and its new producer)
        return const
    replace_uses(graph, t, const)
    installed.append((t, const))
    return const


def _take_names(installed: list[tuple[Tensor, gs.Constant]]) -> None:
    """Folded constants whose tensor lost its producer inherit its name (readable, stable output)."""
    for t, const in installed:
        if not t.inputs and not t.outputs:
            const.name = t.name
    installed.clear()


def _drop_dead(graph: Graph, nodes: list[Node]) -> int:
    """Remove the given nodes that no longer feed anything, in the order given; returns how many."""
    dead: list[Node] = []
    for node in nodes:
        if not any(is_used(graph, t) for t in node.outputs):
            detach(node, dead)
    remove(graph, dead)
    return len(dead)


def _groups(order: list[Node]) -> list[list[Node]]:
    """Split topologically ordered foldable nodes into connected groups (each still in order)."""
    parent = list(range(len(order)))
    index = {id(n): i for i, n in enumerate(order)}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, node in enumerate(order):
        for t in list(node.inputs) + outer_refs(node):
            p = producer(t)
            if p is not None and id(p) in index:
                parent[find(i)] = find(index[id(p)])
    groups: dict[int, list[Node]] = {}
    for i, node in enumerate(order):
        groups.setdefault(find(i), []).append(node)
    return list(groups.values())
