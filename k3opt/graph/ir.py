"""Small helpers over onnx-graphsurgeon's graph, shared by every pass.

Reading a constant goes through one set of functions here: :func:`const_tensor` (the constant behind a
tensor: its ``shape`` and ``dtype`` without loading any data), :func:`is_const`, :func:`const_shape`,
:func:`const_value` / :func:`peek` (the value, never cached), :func:`const_scalar` and :func:`int_list`;
an element type is ``k3opt.graph.dtypes.onnx_type(t.dtype)``.

onnx-graphsurgeon (``gs``) is k3opt's in-memory graph (see docs/design.md).
It keeps producer/consumer links on every tensor (``tensor.inputs`` are the
producing nodes, ``tensor.outputs`` the consuming ones), so passes never
rescan the graph to find uses.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

import numpy as np
import onnx_graphsurgeon as gs
from onnx import numpy_helper
from onnx_graphsurgeon.logger import G_LOGGER
from onnx_graphsurgeon.ir.tensor import LazyValues
from onnx_graphsurgeon.util.misc import SynchronizedList

from ..errors import InputError
from .lifetime import note_links

Tensor = gs.Tensor
Node = gs.Node
Graph = gs.Graph

#: The onnx-graphsurgeon release whose objects k3opt builds and writes itself (gs_import.py, gs_export.py, the
#: constructors below, toposort and cleanup: checked against gs's own object for object and byte for byte by
#: tests/test_fast_edges.py). setup.cfg pins it; any other release is refused at import rather than half-served.
GS_RELEASE = "0.6."
if not gs.__version__.startswith(GS_RELEASE):
    raise ImportError(f"k3opt needs onnx-graphsurgeon {GS_RELEASE}x (installed: {gs.__version__}): "
                      f"pip install 'onnx-graphsurgeon>=0.6,<0.7'")


_new = object.__new__


def gs_links(owner: object, field: str) -> SynchronizedList:
    """An empty gs link list (``SynchronizedList(owner, field, [])`` without its ``__init__``)."""
    links = SynchronizedList.__new__(SynchronizedList)
    d = links.__dict__
    d["parent_obj"] = owner
    d["field_name"] = field
    note_links(links)
    return links


def new_constant(name: str, values: object, data_location: Optional[int] = None) -> gs.Constant:
    """``gs.Constant(name, values, data_location)``, built without gs's constructor (its hooks cost several times
    the object: fold-constants makes one per Constant node, thousands on a deep model)."""
    return _bare(gs.Constant, name, _values=values, data_location=data_location, _export_dtype=None)


def new_variable(name: str) -> gs.Variable:
    """``gs.Variable(name)``, built without gs's constructor (the import makes one per tensor)."""
    return _bare(gs.Variable, name, dtype=None, shape=None, type="tensor_type")


def _bare(cls: type, name: str, **fields: object) -> Tensor:
    """A gs tensor of ``cls`` with ``name``, empty links and ``fields``, set without its constructor."""
    t = _new(cls)
    d = t.__dict__
    d["name"] = name
    d["inputs"] = gs_links(t, "outputs")
    d["outputs"] = gs_links(t, "inputs")
    d.update(fields)
    return t


def producer(t: Tensor) -> Optional[Node]:
    """The node computing ``t``, or None for graph inputs and constants."""
    return t.inputs[0] if t.inputs else None


def consumers(t: Tensor) -> list[Node]:
    """Nodes reading ``t`` (in this graph and in subgraphs that see it)."""
    return list(t.outputs)


def is_graph_output(graph: Graph, t: Tensor) -> bool:
    """True when ``t`` is one of the graph's outputs (compared by identity)."""
    return any(o is t for o in graph.outputs)


def declared_symbols(graph: Graph) -> frozenset[str]:
    """The symbolic dims (``dim_param``) the graph's inputs and outputs declare: sizes chosen at run time."""
    return frozenset(d for t in [*graph.inputs, *graph.outputs] for d in (t.shape or ()) if isinstance(d, str))


def stored_values(c: gs.Constant) -> Any:
    """What gs constant ``c`` holds, not loaded: a numpy array, or a lazy loader (``LazyValues``, k3opt's
    external or spilled values) with ``dtype``, ``shape`` and ``nbytes``, and ``tensor`` for a model's own."""
    return c._values


def store_values(c: gs.Constant, values: Any) -> None:
    """Make ``values`` (an array, or a lazy loader as :func:`stored_values` returns) what ``c`` holds."""
    c._values = values


def peek(c: gs.Constant) -> np.ndarray:
    """The value of gs constant ``c``, read without caching it in ``c``.

    ``gs.Constant.values`` keeps what it loads: the weight then stays in
    memory and gs re-encodes it on export from numpy, which loses strings,
    4-bit and other dtypes numpy lacks. Reading through the lazy loader
    leaves the original TensorProto to be exported untouched.
    """
    v = c._values
    if not isinstance(v, LazyValues):
        return v
    try:
        return v.load()
    except ValueError as exc:
        if type(v) is LazyValues:  # a model's own tensor (k3opt's lazy values are its own business)
            raise bad_data(c, exc) from None
        raise


def bad_data(c: gs.Constant, exc: Exception) -> InputError:
    """The error for a model tensor whose stored bytes do not fit its type and dims (say, short raw_data):
    a fault of the input, named as such, not a crash of the pass that read it."""
    return InputError(f"tensor '{c.name}': its data does not fit its type and shape ({exc})")


def as_constant(name: str, value: np.ndarray) -> gs.Constant:
    """A gs constant holding ``value`` exactly (dtype included) as a ready-made TensorProto."""
    return new_constant(name, LazyValues(numpy_helper.from_array(np.asarray(value), name)))


def constant_node_value(node: Node) -> Optional[gs.Constant]:
    """The value of a ``Constant`` node as a gs constant, or None (sparse or unknown attribute)."""
    attrs = node.attrs
    if isinstance(attrs.get("value"), gs.Constant):
        return new_constant(node.outputs[0].name, attrs["value"]._values)
    for key, dtype in (("value_float", np.float32), ("value_floats", np.float32),
                       ("value_int", np.int64), ("value_ints", np.int64),
                       ("value_string", object), ("value_strings", object)):
        if key in attrs:
            return as_constant(node.outputs[0].name, np.array(attrs[key], dtype=dtype))
    return None


def constant_in_place(node: Node) -> bool:
    """Make a ``Constant`` node's output the constant it holds, in place, and disconnect the node (the
    caller removes it); False, nothing changed, where :func:`constant_node_value` gives None.

    The same tensor object becomes what ``constant_node_value`` builds, keeping its name, its readers and
    its place among their inputs: what ``replace_uses`` with that constant (and its name) does, without
    relinking every reader of each of the thousands of Constant nodes a TorchScript export holds.
    """
    value = constant_node_value(node)
    if value is None:
        return False
    out = node.outputs[0]
    edited([out])
    list.clear(node.outputs)
    list.clear(out.inputs)
    d = out.__dict__
    kept = {key: d[key] for key in ("name", "inputs", "outputs")}
    d.clear()
    d.update(value.__dict__)
    d.update(kept)
    out.__class__ = type(value)
    return True


def const_tensor(t: Optional[Tensor]) -> Optional[gs.Constant]:
    """The gs constant behind ``t`` (``t`` itself, or a ``Constant`` node's value), else None.

    Its ``shape`` and ``dtype`` are known without reading any data.
    """
    if t is None or not t.name:
        return None
    if isinstance(t, gs.Constant):
        return t
    p = producer(t)
    if p is not None and p.op == "Constant" and len(p.outputs) == 1:
        return constant_node_value(p)
    return None


def const_value(t: Optional[Tensor]) -> Optional[np.ndarray]:
    """The value of ``t`` when it is a constant (initializer or Constant node), else None.

    Read through the lazy loader and never cached (see :func:`peek`), so a
    weight read here is freed after use; still, call it only when the value
    matters to the rewrite and look at sizes first (:func:`const_tensor`,
    :func:`const_shape`).
    """
    c = const_tensor(t)
    return None if c is None else peek(c)


def const_scalar(t: Optional[Tensor]) -> Optional[float]:
    """The single value of a size-1 constant as a float, else None."""
    return as_scalar(const_value(t))


def as_scalar(value: Optional[np.ndarray]) -> Optional[float]:
    """The single element of a size-1 array as a float; None for None or any other size."""
    return float(value.reshape(-1)[0]) if value is not None and value.size == 1 else None


def int_list(t: Optional[Tensor]) -> Optional[list[int]]:
    """A constant's value as a flat list of ints (axes, pads, a shape target...), else None."""
    return as_int_list(const_value(t))


def as_int_list(value: object) -> Optional[list[int]]:
    """``value`` (an array, a number, or None) as a flat list of ints; None for None."""
    return None if value is None else [int(x) for x in np.asarray(value).ravel()]


def is_const(t: Optional[Tensor]) -> bool:
    """True when ``t`` has a value known at optimization time (without loading it)."""
    if t is None:
        return False
    if isinstance(t, gs.Constant):
        return True
    p = producer(t)
    return p is not None and p.op == "Constant"


def const_shape(t: Tensor) -> Optional[tuple]:
    """Static shape of ``t`` when every dim is a known int, else None (never loads data)."""
    shape = t.shape
    if shape is None or any(not isinstance(d, (int, np.integer)) or d < 0 for d in shape):
        return None
    return tuple(int(d) for d in shape)


def rank(t: Tensor) -> Optional[int]:
    """Rank of ``t`` when known."""
    return None if t.shape is None else len(t.shape)


def tensor_map(graph: Graph) -> dict[str, Tensor]:
    """``graph.tensors()``: named tensors in gs's order (a repeated name keeps its first place, its last
    tensor), without gs's warnings about distinct tensors sharing a name."""
    found: dict[str, Tensor] = {}
    for t in graph.inputs:
        if t.name:
            found[t.name] = t
    for node in graph.nodes:
        for t in node.inputs:
            if t.name:
                found[t.name] = t
        for t in node.outputs:
            if t.name:
                found[t.name] = t
    for t in graph.outputs:
        if t.name:
            found[t.name] = t
    return found


class NameScope:
    """Deterministic fresh names: ``base``, ``base_1``, ``base_2``... never clashing.

    One scope per graph optimization run, seeded with every tensor and node
    name in the graph, so the same input always yields the same names.
    """

    def __init__(self, graph: Graph, tensors: Optional[Mapping[str, Tensor]] = None,
                 graphs: Optional[list[Graph]] = None):
        """``tensors``: :func:`tensor_map` of ``graph``, ``graphs``: ``list(all_graphs(graph))``, when the
        caller has them (not walked again)."""
        used: set[str] = set()
        for g in all_graphs(graph) if graphs is None else graphs:  # each g.tensors()'s keys, and the node names
            used.update(tensors if g is graph and tensors is not None else tensor_map(g))
            used.update([n.name for n in g.nodes if n.name])
        self._used = used
        self._next: dict[str, int] = {}

    def reserve(self, names: Iterable[str]) -> None:
        """Never hand out ``names`` (those of nodes the run removed before it began: lifted Constant nodes)."""
        self._used.update(names)

    def fresh(self, base: str) -> str:
        base = base or "k3opt"
        if base not in self._used:
            self._used.add(base)
            return base
        i = self._next.get(base, 1)
        while f"{base}_{i}" in self._used:
            i += 1
        self._next[base] = i + 1
        name = f"{base}_{i}"
        self._used.add(name)
        return name


def node_subgraphs(node: Node) -> list[Graph]:
    """The bodies ``node`` holds directly (If branches, Loop/Scan bodies).

    Cheaper than gs's ``Node.subgraphs`` generator, which passes call for
    every node of the graph on every run.
    """
    return [a for a in node.attrs.values() if isinstance(a, gs.Graph)]


def all_graphs(graph: Graph) -> Iterator[Graph]:
    """``graph`` and every body nested in it, outermost first.

    A graph's bodies are found by one comprehension over its nodes, not a call per node: most nodes hold
    no body, and this runs over every node of the graph several times a run.
    """
    yield graph
    for sub in [a for n in graph.nodes if n.attrs for a in n.attrs.values() if isinstance(a, gs.Graph)]:
        yield from all_graphs(sub)


def _unlink(items: list, obj: object) -> None:
    """Remove one occurrence of ``obj`` from gs's link list ``items``, by identity.

    gs's own ``SynchronizedList.remove`` finds the entry with ``Node.__eq__``,
    which compares names, attributes and inputs: slow (quadratic over a
    tensor's readers) and wrong for look-alike nodes such as the duplicate
    that CSE drops, whose twin it may unlink instead.
    """
    for i, item in enumerate(items):
        if item is obj:
            list.__delitem__(items, i)
            return


#: Who hears of the edits made through the helpers below (see :func:`watching_edits`), else None.
#: A context variable, not an argument: the helpers take bare gs nodes and tensors and are called at every
#: edit of every pass and plugin, which have no watcher to hand them; being told without asking is what
#: keeps a kept analysis right. Safe: only :func:`watching_edits` sets it and always resets it in a
#: ``finally``; a thread or asyncio task has its own context (a new thread starts without a watcher, a task
#: with a copy), so a run's analyses hear of its own edits only.
_watcher: ContextVar[Optional[Callable[[Sequence[Tensor]], None]]] = ContextVar("k3opt_edit_watcher", default=None)


@contextmanager
def watching_edits(watcher: Callable[[Sequence[Tensor]], None]) -> Iterator[None]:
    """Within the block, ``watcher(tensors)`` hears of every edit made through :func:`set_input`,
    :func:`set_output`, :func:`disconnect` and :func:`replace_uses`: ``tensors`` may now have another
    producer, a producer reading other values, another name or shape (an enclosing block's watcher too).

    Analyses kept while a pass rewrites (traced dims) forget what read those tensors, so no pass has to
    tell them what it changed. An edit made on gs's objects directly is not heard: the pass manager
    drops such analyses after the pass anyway (``Pass.preserves``).
    """
    outer = _watcher.get()
    both = watcher if outer is None else lambda tensors: (outer(tensors), watcher(tensors))
    token = _watcher.set(both)
    try:
        yield
    finally:
        _watcher.reset(token)


def edited(tensors: Sequence[Tensor]) -> None:
    """Tell the watcher (:func:`watching_edits`) that ``tensors`` changed: for editing helpers that
    change links without :func:`set_input` and the like (a pass calls those helpers instead)."""
    watcher = _watcher.get()
    if watcher is not None:
        watcher(tensors)


def set_input(node: Node, i: int, new: Tensor) -> None:
    """``node.inputs[i] = new``, keeping the consumer links exact and cheap (identity, not ``__eq__``)."""
    old = node.inputs[i]
    if old is new:
        return
    edited(node.outputs)
    _relink_input(node, i, old, new)


def _relink_input(node: Node, i: int, old: Tensor, new: Tensor) -> None:
    """:func:`set_input` once the edit was told: ``node.inputs[i]`` is ``old``, to become ``new``."""
    list.__setitem__(node.inputs, i, new)
    _unlink(old.outputs, node)
    list.append(new.outputs, node)


def set_output(node: Node, i: int, new: Tensor) -> None:
    """``node.outputs[i] = new``: the old output loses its producer (by identity, as :func:`set_input`)."""
    old = node.outputs[i]
    if old is new:
        return
    edited([old, new])
    list.__setitem__(node.outputs, i, new)
    _unlink(old.inputs, node)
    list.append(new.inputs, node)


def disconnect(node: Node) -> None:
    """Unlink ``node`` from every tensor it reads or writes (by identity; see :func:`_unlink`)."""
    edited(node.outputs)
    for t in node.inputs:
        _unlink(t.outputs, node)
    for t in node.outputs:
        _unlink(t.inputs, node)
    list.clear(node.inputs)
    list.clear(node.outputs)


def replace_uses(graph: Graph, old: Tensor, new: Tensor) -> None:
    """Make every consumer of ``old`` (and the graph outputs) read ``new`` instead.

    When ``old`` is a graph output, ``new`` takes over its name so the model's
    interface is unchanged.
    """
    readers = [] if old is new else list(old.outputs)
    # new may take old's name and shape, old's readers read another tensor: told at once (each telling costs)
    edited([old, new, *(t for node in readers for t in node.outputs)])
    for node in readers:
        for i, inp in enumerate(node.inputs):
            if inp is old:
                _relink_input(node, i, old, new)
    name = old.name  # read once: a graph listing the output twice must keep its name at both places
    for i, out in enumerate(graph.outputs):
        if out is old:
            old.name = name + "__k3opt_replaced"
            new.name = name
            if new.dtype is None:
                new.dtype = old.dtype
            if new.shape is None:
                new.shape = old.shape
            graph.outputs[i] = new


# --------------------------------------------------------------------------- order and clean-up
#
# gs's ``Graph.toposort`` and ``Graph.cleanup`` recompute tensor maps and walk
# generators per node (tenths of a second on a deep model). These give
# the same result in linear time: same node order (byte-identical export), same
# nodes kept. Graphs with local functions go to gs (it also sorts and cleans those).


def _local_names(graph: Graph) -> set[str]:
    """gs's ``Graph._local_tensors`` names: produced here, graph inputs, and the names whose tensor in
    ``graph.tensors()`` (the last one of that name) is a constant.

    One walk of the graph for both kinds (each walk of a big graph's scattered objects costs more per node
    the bigger the graph: see the speed diary in docs/benchmarks.md).
    """
    own = {t.name for t in graph.inputs}
    last: dict[str, Tensor] = {}
    for t in graph.inputs:
        last[t.name] = t
    for node in graph.nodes:
        for t in node.inputs:
            last[t.name] = t
        for t in node.outputs:
            name = t.name
            last[name] = t
            if name:
                own.add(name)
    for t in graph.outputs:
        last[t.name] = t
    own.update(name for name, t in last.items() if name and isinstance(t, gs.Constant))
    return own


def outer_refs(node: Node) -> list[Tensor]:
    """Non-constant tensors that ``node``'s subgraphs (If/Loop/Scan bodies) read from enclosing scopes.

    What a pass asks (folding, liveness). :func:`_outer_reads` is gs's own list, constants included, in
    gs's order: the one :func:`toposort` and :func:`cleanup` must follow to match gs.
    """
    return _unique(t for attr in node.attrs.values() if isinstance(attr, gs.Graph) for t in _reads_from_outside(attr))


def _reads_from_outside(sub: Graph) -> list[Tensor]:
    """Tensors ``sub`` (nested bodies included) reads but does not define; constants excluded
    (gs exports those inside the body)."""
    local = {id(t) for t in sub.inputs}
    local.update(id(t) for n in sub.nodes for t in n.outputs)
    reads = [t for n in sub.nodes for t in n.inputs]
    reads += [t for n in sub.nodes for a in n.attrs.values() if isinstance(a, gs.Graph) for t in _reads_from_outside(a)]
    reads += list(sub.outputs)
    return _unique(t for t in reads if t.name and not isinstance(t, gs.Constant) and id(t) not in local)


def _unique(tensors: Iterable[Tensor]) -> list[Tensor]:
    """``tensors`` without repeats (by identity), in first-seen order."""
    seen: set[int] = set()
    out: list[Tensor] = []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _outer_reads(node: Node) -> list[Tensor]:
    """Tensors ``node``'s bodies read from enclosing graphs (gs's ``_foreign_tensors``, in its order)."""
    reads: list[Tensor] = []
    seen: set[int] = set()
    for sub in node_subgraphs(node):
        if id(sub) not in seen:  # gs's Node.subgraphs yields a body once
            seen.add(id(sub))
            reads += list(sub._foreign_tensors().values())
    return reads


def _not_in_graph(node: Node) -> None:
    G_LOGGER.critical(f"Encountered a node not in the graph:\n{node}.\n\n"
                      "To fix this, please append the node to this graph's `nodes` attribute.")


def toposort(graph: Graph) -> Graph:
    """``graph.toposort()`` in linear time, with exactly gs's order; returns ``graph``.

    gs's order: a node's level is one more than the highest level of the nodes
    producing its inputs (or what its bodies read from this graph); nodes are
    sorted by level, ties kept in the order of a depth-first walk that visits
    each node's producers before it. Bodies are sorted first, and each local
    function's nodes; then the functions themselves, each after the functions
    it calls (:func:`_sort_functions`).
    """
    done: set[int] = set()
    for g, holders in [pair for f in graph.functions for pair in _bodies_first(f)] + _bodies_first(graph):
        if id(g) not in done:
            done.add(id(g))
            _sort_nodes(g, holders)
    if graph.functions:
        _sort_functions(graph)
    return graph


def _sort_functions(graph: Graph) -> None:
    """``graph``'s local functions in gs's order: a function's level is one more than the highest level of the
    functions its nodes (bodies included) call; sorted by level, ties in the order of a depth-first walk that
    visits a function's callees before it. (gs 0.6 counts the calls made in the main graph's bodies for every
    function instead of the calls in the function's own bodies: a model whose bodies call local functions may
    get another, also valid, order here.)"""
    graph._merge_subgraph_functions()
    by_id = {f.unique_id: f for f in graph.functions}
    level: dict[tuple, int] = {}
    order: list[tuple] = []  # depth first, callees before their callers: gs's order among equal levels

    def callees(f: Graph) -> list[Graph]:
        called: dict[tuple, Graph] = {}
        for g in all_graphs(f):
            for n in g.nodes:
                if (n.domain, n.op) in by_id:
                    called.setdefault((n.domain, n.op), by_id[(n.domain, n.op)])
        return list(called.values())

    def visit(f: Graph, path: set[tuple]) -> int:
        key = f.unique_id
        if key in level:
            return level[key]
        if key in path:
            G_LOGGER.critical("Cycle detected in function definitions!")
        path.add(key)
        level[key] = max([visit(c, path) for c in callees(f)], default=-1) + 1
        path.discard(key)
        order.append(key)
        return level[key]

    for f in graph.functions:
        visit(f, set())
    graph.functions = [by_id[key] for key in sorted(order, key=level.__getitem__)]


def _bodies_first(graph: Graph) -> list[tuple[Graph, set[int]]]:
    """Every graph nested in ``graph`` (``graph`` last), each after the bodies it holds,
    with the ids of its nodes that hold bodies."""
    out: list[tuple[Graph, set[int]]] = []
    holders: set[int] = set()
    for node in graph.nodes:
        if node.attrs:
            subs = node_subgraphs(node)
            if subs:
                holders.add(id(node))
                for sub in subs:
                    out += _bodies_first(sub)
    out.append((graph, holders))
    return out


def _sort_nodes(graph: Graph, bodies: set[int]) -> None:
    members = {id(n) for n in graph.nodes}
    names: list[set[str]] = []  # gs's local names, found only if ever needed

    def local(t: Tensor) -> bool:
        """Whether ``t``, which has a producer, has a local name; the usual answer without a walk for the names:
        a named output of a node of this graph is local."""
        if t.name and id(t.inputs[0]) in members:
            return True
        if not names:
            names.append(_local_names(graph))
        return t.name in names[0]

    def producers(node: Node) -> list[Node]:
        found: dict[int, Node] = {}
        for t in (node.inputs if id(node) not in bodies else list(node.inputs) + _outer_reads(node)):
            if t.inputs and local(t):  # only a producer of a local name counts (gs)
                for p in t.inputs:
                    if id(p) not in members:
                        _not_in_graph(p)
                    found[id(p)] = p
        return list(found.values())

    level: dict[int, int] = {}
    order: list[Node] = []
    for root in graph.nodes:
        key = id(root)
        if key in level:
            continue
        if key not in bodies:  # the usual case: its producers are placed already, so is it
            top = -1
            for t in root.inputs:
                if t.inputs and local(t):
                    for p in t.inputs:
                        lv = level.get(id(p), -2)
                        if lv > top:
                            top = lv
                        elif lv == -2:
                            break
                    else:
                        continue
                    break
            else:
                level[key] = top + 1
                order.append(root)
                continue
        stack = [(root, producers(root), 0)]
        on_stack = {key}
        while stack:
            node, inputs, i = stack[-1]
            while i < len(inputs) and id(inputs[i]) in level:
                i += 1
            if i < len(inputs):
                stack[-1] = (node, inputs, i + 1)
                nxt = inputs[i]
                if id(nxt) in on_stack:
                    G_LOGGER.critical("Cycle detected in graph! Are there tensors with duplicate names in the graph?")
                on_stack.add(id(nxt))
                stack.append((nxt, producers(nxt), 0))
                continue
            stack.pop()
            on_stack.discard(id(node))
            level[id(node)] = max((level[id(p)] for p in inputs), default=-1) + 1
            order.append(node)
    graph.nodes = sorted(order, key=lambda n: level[id(n)])


def cleanup(graph: Graph) -> Graph:
    """``graph.cleanup()`` (defaults) in linear time: drops nodes no graph output depends on; returns ``graph``.

    Bodies are cleaned first, graph inputs lose any producer, unused inputs
    stay. Dropped nodes are unlinked by identity (:func:`disconnect`), where
    gs's ``__eq__``-based unlinking could unlink a look-alike twin instead.
    Local functions are cleaned too (each against its own outputs).
    """
    for g, holders in [pair for f in graph.functions for pair in _bodies_first(f)] + _bodies_first(graph):
        _drop_unused(g, holders)
    return graph


def _drop_unused(graph: Graph, holders: set[int]) -> None:
    """gs's clean-up of one graph; ``holders``: the ids of its nodes that hold bodies."""
    for inp in graph.inputs:
        for node in list(inp.inputs):
            _unlink(node.outputs, inp)
        list.clear(inp.inputs)
    local = _local_names(graph)
    members = {id(n) for n in graph.nodes}
    seen: set[str] = set()

    def wanted(t: Tensor) -> bool:  # gs's IgnoreDupAndForeign: by name
        if not t.name:
            return True
        if t.name not in local or t.name in seen:
            return False
        seen.add(t.name)
        return True

    used: set[int] = set()
    todo = [t for t in graph.outputs if wanted(t)]
    for t in todo:  # grows while walking: breadth first, as gs
        for node in t.inputs:
            key = id(node)
            if key not in members:
                _not_in_graph(node)
            used.add(key)
            for r in (node.inputs if key not in holders else list(node.inputs) + _outer_reads(node)):
                name = r.name
                if not name:
                    todo.append(r)
                elif name in local and name not in seen:
                    seen.add(name)
                    todo.append(r)
    kept = []
    for node in graph.nodes:
        if id(node) in used:
            kept.append(node)
        else:
            disconnect(node)
    graph.nodes = kept
