"""Small helpers over onnx-graphsurgeon's graph, shared by every pass.

onnx-graphsurgeon (``gs``) is k3opt's in-memory graph (see docs/design.md).
It keeps producer/consumer links on every tensor (``tensor.inputs`` are the
producing nodes, ``tensor.outputs`` the consuming ones), so passes never
rescan the graph to find uses.
"""
from __future__ import annotations

from typing import Iterator, Optional

import numpy as np
import onnx_graphsurgeon as gs
from onnx import numpy_helper
from onnx_graphsurgeon.ir.tensor import LazyValues

Tensor = gs.Tensor
Node = gs.Node
Graph = gs.Graph


def producer(t: Tensor) -> Optional[Node]:
    """The node computing ``t``, or None for graph inputs and constants."""
    return t.inputs[0] if t.inputs else None


def consumers(t: Tensor) -> list[Node]:
    """Nodes reading ``t`` (in this graph and in subgraphs that see it)."""
    return list(t.outputs)


def is_graph_output(graph: Graph, t: Tensor) -> bool:
    """True when ``t`` is one of the graph's outputs (compared by identity)."""
    return any(o is t for o in graph.outputs)


def peek(c: gs.Constant) -> np.ndarray:
    """The value of gs constant ``c``, read without caching it in ``c``.

    ``gs.Constant.values`` keeps what it loads: the weight then stays in
    memory and gs re-encodes it on export from numpy, which loses strings,
    4-bit and other dtypes numpy lacks. Reading through the lazy loader
    leaves the original TensorProto to be exported untouched.
    """
    v = c._values
    return v.load() if isinstance(v, LazyValues) else v


def as_constant(name: str, value: np.ndarray) -> gs.Constant:
    """A gs constant holding ``value`` exactly (dtype included) as a ready-made TensorProto."""
    return gs.Constant(name, LazyValues(numpy_helper.from_array(np.asarray(value), name)))


def constant_node_value(node: Node) -> Optional[gs.Constant]:
    """The value of a ``Constant`` node as a gs constant, or None (sparse or unknown attribute)."""
    attrs = node.attrs
    if isinstance(attrs.get("value"), gs.Constant):
        return gs.Constant(node.outputs[0].name, attrs["value"]._values)
    for key, dtype in (("value_float", np.float32), ("value_floats", np.float32),
                       ("value_int", np.int64), ("value_ints", np.int64),
                       ("value_string", object), ("value_strings", object)):
        if key in attrs:
            return as_constant(node.outputs[0].name, np.array(attrs[key], dtype=dtype))
    return None


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


class NameScope:
    """Deterministic fresh names: ``base``, ``base_1``, ``base_2``... never clashing.

    One scope per graph optimization run, seeded with every tensor and node
    name in the graph, so the same input always yields the same names.
    """

    def __init__(self, graph: Graph):
        self._used: set[str] = set()
        for g in all_graphs(graph):
            self._used.update(g.tensors().keys())
            self._used.update(n.name for n in g.nodes if n.name)
        self._next: dict[str, int] = {}

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
    """``graph`` and every body nested in it, outermost first."""
    yield graph
    for node in graph.nodes:
        for sub in node_subgraphs(node):
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


def set_input(node: Node, i: int, new: Tensor) -> None:
    """``node.inputs[i] = new``, keeping the consumer links exact and cheap (identity, not ``__eq__``)."""
    old = node.inputs[i]
    if old is new:
        return
    list.__setitem__(node.inputs, i, new)
    _unlink(old.outputs, node)
    list.append(new.outputs, node)


def disconnect(node: Node) -> None:
    """Unlink ``node`` from every tensor it reads or writes (by identity; see :func:`_unlink`)."""
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
    for node in list(old.outputs):
        for i, inp in enumerate(node.inputs):
            if inp is old:
                set_input(node, i, new)
    for i, out in enumerate(graph.outputs):
        if out is old:
            name = old.name
            old.name = name + "__k3opt_replaced"
            new.name = name
            if new.dtype is None:
                new.dtype = old.dtype
            if new.shape is None:
                new.shape = old.shape
            graph.outputs[i] = new
