"""Opset conversion of only the nodes whose schema changes between two opsets.

onnx's version converter imports, rewrites and exports every node of the model; between two opsets
most ops keep their schema (the same ``since_version`` at both), and such a node means the same at
either opset: it needs nothing but the model's opset import. The nodes whose schema does change are
copied into a small sub-model (their inputs typed where the model knows the type, small constant inputs
included, so adapters that move an input into an attribute see its value), converted there, and the
result is spliced back in place of the originals. A node with subgraphs whose own schema changes goes
into the sub-model whole (the converter converts its bodies too); otherwise its bodies are converted the
same way, graph by graph. A graph whose changed nodes the converter would all give back unchanged
(:func:`.opset_compatible.passes_through`) makes no sub-model: its nodes stay as they are.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import onnx
from onnx.external_data_helper import uses_external_data

from .external import weights_as_inputs
from .opset_compatible import passes_through

#: The sub-models' least IR version: the first where an initializer need not be a graph input.
MIN_SUB_MODEL_IR = 4
#: Constant inputs up to this size are copied into the sub-model (adapters read axes, pads, scales...).
SMALL_CONSTANT_BYTES = 4096
_DEFAULT_DOMAINS = ("", "ai.onnx")


@functools.lru_cache(maxsize=None)  # of onnx's built-in schemas: shared by runs and threads, never changes
def schema_changes(op: str, current: int, wanted: int) -> bool:
    """Does default-domain ``op`` have another schema at opset ``wanted`` than at ``current``?
    (True when it does not exist at one of them: the converter then decides.)"""
    try:
        return (onnx.defs.get_schema(op, current, "").since_version
                != onnx.defs.get_schema(op, wanted, "").since_version)
    except onnx.defs.SchemaError:
        return True


@dataclass
class _Splice:
    """One graph's changed nodes and what the converter made of them."""

    graph: onnx.GraphProto
    nodes: list[int]  # positions in graph.node
    converted: onnx.GraphProto


def convert_changed_nodes(model: onnx.ModelProto, current: int, wanted: int,
                          convert: Callable[[onnx.ModelProto, int], onnx.ModelProto],
                          scope: Optional["ModelScope"] = None,
                          check_kept: Callable[[list[onnx.NodeProto]], None] = lambda nodes: None,
                          bodies: bool = True) -> int:
    """Convert the nodes of ``model`` whose schema changes from opset ``current`` to ``wanted`` with
    ``convert`` (a sub-model at ``current`` -> at ``wanted``), in place; returns how many were converted.

    ``model`` is changed only when every sub-model converted: an exception leaves it as it was. The
    caller sets the opset import. A sub-model that fails is tried once more with the types onnx's
    shape inference finds for its inputs. The changed nodes of a graph that :func:`kept_as_they_are`
    makes no sub-model of; ``check_kept`` gets them (what ``convert`` checks of a converted node).
    ``scope``: made when first needed unless given. ``bodies=False``: no node holds a body (the caller
    knows), so no node's attributes are searched for one.
    """
    splices = []
    kept: list[onnx.NodeProto] = []
    others = [o for o in model.opset_import if o.domain not in _DEFAULT_DOMAINS]
    graphs: list[onnx.GraphProto] = []
    changed = list(_changed(model.graph, current, wanted, graphs, bodies))
    untyped = _untyped(graphs) if changed else set()
    for graph, nodes in changed:
        if kept_as_they_are(graph, nodes, current, wanted, untyped):
            kept += [graph.node[k] for k in nodes]
            continue
        scope = scope or ModelScope(model)
        try:
            converted = convert(scope.sub_model(graph, nodes, current, others), wanted)
        except Exception:  # an adapter may need its inputs' types (OptionalHasElement 18 -> 17): once more with them
            scope.infer_types()
            converted = convert(scope.sub_model(graph, nodes, current, others), wanted)
        splices.append(_Splice(graph, nodes, converted.graph))
    check_kept(kept)
    plans = [_plan(splice, scope) for splice in splices]  # may raise: nothing is changed yet
    for splice, (groups, initializers) in zip(splices, plans):
        splice.graph.initializer.extend(initializers)
        _splice(splice, groups)
    if scope is not None:
        scope.drop_unused_constants({i for s in splices for n in s.converted.node for i in _used_names(n)})
    return sum(len(s.nodes) for s in splices) + len(kept)


def kept_as_they_are(graph: onnx.GraphProto, positions: list[int], current: int, wanted: int,
                     untyped: set[str]) -> bool:
    """Would the sub-model of these nodes of ``graph`` come back from onnx's converter as it went in, and
    pass the checks of its interface? True when the converter gives each node back unchanged
    (:func:`.opset_compatible.passes_through`) and no node computes a name of ``untyped``: the converter's
    inference would give such an output the element type it lacks, which counts as a changed interface.

    Then the sub-model is not made: the conversion would leave the graph as it is, and the names an adapter
    makes up (counted over the sub-model's values) are never needed; a graph with any other changed node
    goes to the converter whole, as before.
    """
    nodes = [graph.node[k] for k in positions]
    return (all(passes_through(n, current, wanted) for n in nodes)
            and not any(o in untyped for n in nodes for o in n.output))


def _untyped(graphs: list[onnx.GraphProto]) -> set[str]:
    """Names ``graphs`` declare (input, output, value_info) with a tensor type that has no element type."""
    return {vi.name for g in graphs for vi in (*g.input, *g.output, *g.value_info)
            if vi.type.HasField("tensor_type") and not vi.type.tensor_type.elem_type}


def _changed(graph: onnx.GraphProto, current: int, wanted: int, graphs: list[onnx.GraphProto],
             bodies: bool = True) -> Iterator[tuple[onnx.GraphProto, list[int]]]:
    """(graph, positions of its nodes whose schema changes) for the bodies of ``graph``'s unchanged
    nodes, then for ``graph`` (a body is spliced before the graph holding it is rebuilt); every graph of
    the model (``graph`` and all its bodies) is appended to ``graphs``. ``bodies=False``: there are none
    (no node's attributes are read)."""
    graphs.append(graph)
    nodes = []
    for k, node in enumerate(graph.node):
        if schema_changes(node.op_type, current, wanted) and node.domain in _DEFAULT_DOMAINS:
            nodes.append(k)
            if bodies and node.attribute:
                graphs += [g for sub in _subgraphs(node) for g in all_graphs(sub)]
            continue
        if not bodies:
            continue
        for attr in node.attribute:  # most attributes hold no body: _subgraphs only for a node that has one
            if attr.HasField("g") or attr.graphs:
                for sub in _subgraphs(node):
                    yield from _changed(sub, current, wanted, graphs)
                break
    if nodes:
        yield graph, nodes


def _subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for attr in node.attribute:
        if attr.HasField("g"):
            yield attr.g
        yield from attr.graphs


def all_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every subgraph in it."""
    yield graph
    for node in graph.node:
        if node.attribute:
            for sub in _subgraphs(node):
                yield from all_graphs(sub)


def _used_names(node: onnx.NodeProto) -> Iterator[str]:
    """Names ``node`` reads, its bodies' reads of outer-scope names included (a name local to a body
    nested deeper may be among them: as a sub-model input that nothing reads, it changes nothing)."""
    yield from (i for i in node.input if i)
    for sub in _subgraphs(node):
        local = {t.name for t in sub.initializer} | {i.name for i in sub.input}
        local |= {o for n in sub.node for o in n.output}
        yield from (name for n in sub.node for name in _used_names(n) if name not in local)
        yield from (o.name for o in sub.output if o.name not in local)


class ModelScope:
    """What the model knows about its names: types, small constants, and which names are taken."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.types: dict[str, onnx.TypeProto] = {}
        self.initializers: dict[str, onnx.TensorProto] = {}
        self.constant_nodes: dict[str, onnx.TensorProto] = {}  # Constant node output -> its value
        self._taken: Optional[set[str]] = None
        #: Names defined in more than one graph (sibling bodies may each define ``ax``): which one a node
        #: reads depends on where it stands, so they get no constant value and no type (the conversion
        #: of a node reading one is refused rather than given another graph's value).
        self.ambiguous: set[str] = set()
        defined: set[str] = set()
        for graph in all_graphs(model.graph):
            here = {i.name for i in graph.input} | {t.name for t in graph.initializer}
            here |= {o for n in graph.node for o in n.output if o}
            self.ambiguous |= here & defined
            defined |= here
            for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
                if vi.type.WhichOneof("value") is not None:
                    self.types.setdefault(vi.name, vi.type)
            self.initializers.update((t.name, t) for t in graph.initializer)
            for node in graph.node:
                if node.op_type == "Constant" and node.domain in _DEFAULT_DOMAINS and len(node.attribute) == 1 \
                        and node.attribute[0].name == "value":
                    self.constant_nodes[node.output[0]] = node.attribute[0].t
        self.inferred = False
        self.read: set[str] = set()  # constants a sub-model got: dropped later if nothing reads them any more

    def sub_model(self, graph: onnx.GraphProto, positions: list[int], opset: int,
                  other_imports: list[onnx.OperatorSetIdProto]) -> onnx.ModelProto:
        """A model of the nodes at ``positions`` alone: what they read from outside are its inputs (or
        initializers, for small constants), everything they produce its outputs."""
        nodes = [graph.node[k] for k in positions]
        produced: set[str] = set()
        inputs, initializers, seen = [], [], set()
        for node in nodes:
            for name in _used_names(node):
                if name in produced or name in seen:
                    continue
                seen.add(name)
                constant = self.constant(name)
                if constant is not None:
                    initializers.append(constant)
                    self.read.add(name)
                else:
                    inputs.append(self._value_info(name))
            produced.update(o for o in node.output if o)
        outputs = [self._value_info(o) for node in nodes for o in node.output if o]
        sub = onnx.helper.make_graph([_copy(n) for n in nodes], graph.name or "sub", inputs, outputs, initializers)
        # IR 4 at least: below it an initializer must also be a graph input, and onnx's converter calls
        # the sub-model's constants (copied as initializers only) undefined (IR-3 opset-9 CNN exports)
        return onnx.helper.make_model(sub, opset_imports=[onnx.helper.make_opsetid("", opset)] + other_imports,
                                      ir_version=max(self.model.ir_version, MIN_SUB_MODEL_IR))

    def constant(self, name: str) -> Optional[onnx.TensorProto]:
        """The small constant (initializer or Constant node) named ``name``, else None (also for a name
        several graphs define)."""
        if name in self.ambiguous:
            return None
        t = self.initializers.get(name)
        if t is not None:
            return t if not uses_external_data(t) and t.ByteSize() <= SMALL_CONSTANT_BYTES else None
        value = self.constant_nodes.get(name)
        if value is None or value.ByteSize() > SMALL_CONSTANT_BYTES:
            return None
        t = onnx.TensorProto()
        t.CopyFrom(value)
        t.name = name
        return t

    def infer_types(self) -> None:
        """Add the types onnx's shape inference finds (on a copy without the big weights) to those the
        model declares: some adapters need their inputs' types, an export seldom declares them."""
        if self.inferred:
            return
        self.inferred = True
        light = onnx.shape_inference.infer_shapes(weights_as_inputs(self.model)[0])
        for graph in all_graphs(light.graph):
            for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
                if vi.type.WhichOneof("value") is not None:
                    self.types.setdefault(vi.name, vi.type)

    def rank(self, name: str) -> Optional[int]:
        """The rank of tensor ``name`` if known."""
        t = None if name in self.ambiguous else self.types.get(name)
        if t is None or not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
            return None
        return len(t.tensor_type.shape.dim)

    def _value_info(self, name: str) -> onnx.ValueInfoProto:
        vi = onnx.ValueInfoProto(name=name)
        if name in self.types and name not in self.ambiguous:
            vi.type.CopyFrom(self.types[name])
        return vi

    def fresh(self, name: str) -> str:
        """``name``, or a variant of it no other value of the model has; now taken."""
        if self._taken is None:
            self._taken = set(self.initializers)
            for graph in all_graphs(self.model.graph):
                self._taken.update(i.name for i in graph.input)
                for node in graph.node:
                    self._taken.update(node.output)
        unique, k = name, 0
        while unique in self._taken:
            k += 1
            unique = f"{name}_k3opt{k}"
        self._taken.add(unique)
        return unique

    def drop_unused_constants(self, still_read: set[str]) -> None:
        """Remove the constants the sub-models read that nothing reads any more (an adapter moved them
        into an attribute), unless a graph output names them. ``still_read``: names the converted nodes
        read (when they read all the constants, nothing else needs a look)."""
        if self.read <= still_read:
            return
        used: set[str] = set()
        for graph in all_graphs(self.model.graph):
            used.update(o.name for o in graph.output)
            for node in graph.node:
                used.update(_used_names(node))
        unused = self.read - used
        if not unused:
            return
        for graph in all_graphs(self.model.graph):
            if any(t.name in unused for t in graph.initializer):
                kept = [t for t in graph.initializer if t.name not in unused]
                del graph.initializer[:]
                graph.initializer.extend(kept)
            for node in [n for n in graph.node if n.op_type == "Constant" and n.output[0] in unused]:
                graph.node.remove(node)


def _copy(node: onnx.NodeProto) -> onnx.NodeProto:
    out = onnx.NodeProto()
    out.CopyFrom(node)
    return out


def _plan(splice: _Splice, scope: ModelScope) -> tuple[list[list[onnx.NodeProto]], list[onnx.TensorProto]]:
    """What replaces each changed node: the converted node producing its outputs plus the new nodes just
    before it; and the initializers the converter added. New names get fresh ones if taken."""
    owner = {o: k for k, pos in enumerate(splice.nodes) for o in splice.graph.node[pos].output if o}
    originals = set(owner)
    known = originals | {vi.name for vi in splice.converted.input} | {t.name for t in splice.converted.initializer}
    renamed = {}
    for node in splice.converted.node:
        for i, o in enumerate(node.output):
            if o and o not in known:
                renamed[o] = node.output[i] = scope.fresh(o)
    added = []
    for t in splice.converted.initializer:
        if t.name not in originals and t.name not in scope.read:
            renamed[t.name] = t.name = scope.fresh(t.name)
            added.append(t)
    groups: list[list[onnx.NodeProto]] = [[] for _ in splice.nodes]
    pending: list[onnx.NodeProto] = []
    for node in splice.converted.node:
        node.input[:] = [renamed.get(i, i) for i in node.input]
        pending.append(node)
        hits = {owner[o] for o in node.output if o in owner}
        if hits:
            groups[min(hits)].extend(pending)
            pending = []
    if pending:
        raise RuntimeError("the converter left nodes that produce none of the converted nodes' outputs")
    return groups, added


def _splice(splice: _Splice, groups: list[list[onnx.NodeProto]]) -> None:
    """Put each changed node's replacement (``groups``, in the order of ``splice.nodes``) in its place."""
    if all(len(g) == 1 for g in groups):  # one node for one (most adapters): no rebuild of the node list
        for pos, (node,) in zip(splice.nodes, groups):
            if splice.graph.node[pos] != node:
                splice.graph.node[pos].CopyFrom(node)
        return
    group_at = dict(zip(splice.nodes, groups))
    merged = []
    for pos, node in enumerate(splice.graph.node):
        merged.extend(group_at.get(pos, [node]))
    del splice.graph.node[:]
    splice.graph.node.extend(merged)
