"""eliminate-common-subexpressions: compute each value once.

Two nodes with the same op, domain, attributes and inputs (the same tensor
objects, in order; an empty optional input is absent, as are trailing ones, so ``Clip(x, lo)`` and
``Clip(x, lo, "")`` are equal) compute the same outputs; the later one's readers read
the earlier one's outputs. Equal constants are merged first, so nodes that
read equal weights become equal too; constants are grouped by dtype and
shape so that only candidates are read, then compared by their first bytes
(all of them for short values), and only those whose first bytes another
one shares by a hash of all their bytes; they are never read when they live
in external data or exceed ``cse_max_const_bytes`` (default 1 MiB).

Refused: random ops (two draws are not one), nodes with subgraphs, nodes in
custom domains (their semantics are unknown), and merges that would make two
graph outputs one tensor: there the later node becomes an ``Identity`` of the
earlier one's output, computed once, both names kept.

Inside If/Loop/Scan bodies, equal nodes of one body merge the same way (a
run of a body sees one value per input); a body's node is never merged
into a node of another graph, and constants merge in the main graph only.
"""
from __future__ import annotations

import hashlib
import math
import sys
from collections import Counter
from typing import Callable, Hashable, Optional

import numpy as np
from ... import graph as gs
from google.protobuf.message import Message
from onnx import TensorProto
from ...graph import LazyValues, dtypes

from ...graph.ir import Graph, Node, Tensor, is_graph_output, peek, replace_uses, stored_values
from ...pipeline.analyses import Shapes
from ...pipeline.option_values import byte_size
from ...pipeline.pass_base import Hints, Pass, PassContext
from .._rewire import can_replace, detach_all, remove
from .._shared.op_kinds import RANDOM_OPS

DEFAULT_MAX_CONST_BYTES = 1 << 20
_DOMAINS = ("", "ai.onnx", "ai.onnx.ml")


#: Item size of the types whose ``raw_data`` is exactly the bytes of the array onnx reads from it (not
#: bit-packed) on a little-endian machine: a constant of these is compared from the proto, without building the array.
_RAW_AS_ARRAY = {
    t: dtypes.numpy_dtype(t).itemsize
    for t in (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.BOOL,
              TensorProto.INT8, TensorProto.INT16, TensorProto.INT32, TensorProto.INT64,
              TensorProto.UINT8, TensorProto.UINT16, TensorProto.UINT32, TensorProto.UINT64)
} if sys.byteorder == "little" else {}


#: Values up to this many bytes are compared by their bytes; longer ones by this many first bytes, then (when
#: another one starts alike) by a hash of all their bytes. Distinct weights differ early: most are never hashed.
_HEAD_BYTES = 64


def _value_key(data: bytes) -> Hashable:
    """An exact stand-in for a value's bytes: the bytes when short, else their SHA-1."""
    return data if len(data) <= _HEAD_BYTES else hashlib.sha1(data).hexdigest()


def _array_bytes(value: np.ndarray) -> bytes:
    """The array's bytes; for strings (an object array's ``tobytes()`` is the addresses of its items, which
    a freed value's successor may reuse: unequal strings compared equal) the repr of its values."""
    if value.dtype == object:
        return repr(value.reshape(-1).tolist()).encode()
    return np.ascontiguousarray(value).tobytes()


def _digest(value: np.ndarray) -> Hashable:
    """:func:`_value_key` of an array's bytes."""
    return _value_key(_array_bytes(value))


def _const_bytes(c: gs.Constant, limit: Optional[int] = None) -> bytes:
    """The bytes of the constant's array (the first ``limit`` of them when given); from its ``raw_data`` when
    that is the same bytes, so the array is not built."""
    values = stored_values(c)
    proto = getattr(values, "tensor", None) if type(values) is LazyValues else None
    itemsize = _RAW_AS_ARRAY.get(proto.data_type) if isinstance(proto, TensorProto) else None
    if itemsize and proto.HasField("raw_data") and not proto.HasField("segment") \
            and proto.data_location != TensorProto.EXTERNAL:
        raw = proto.raw_data
        if len(raw) == itemsize * math.prod(proto.dims):
            return raw if limit is None else raw[:limit]
    value = np.asarray(peek(c))
    if limit is not None and value.dtype != object:  # enough leading elements for ``limit`` bytes
        value = value.reshape(-1)[:-(-limit // max(value.itemsize, 1))]
    return _array_bytes(value)[:limit]


def _head(c: gs.Constant) -> bytes:
    """The constant's first bytes: all of them when it has at most :data:`_HEAD_BYTES` (one more otherwise)."""
    return _const_bytes(c, _HEAD_BYTES + 1)


def _const_digest(c: gs.Constant) -> Hashable:
    """:func:`_digest` of the constant's value."""
    return _value_key(_const_bytes(c))


def _attr_key(value: object) -> Optional[Hashable]:
    """A hashable, exact stand-in for an attribute value; None when it cannot be compared."""
    if type(value) is int or type(value) is str:  # the common case, first
        return (type(value).__name__, value)
    if isinstance(value, gs.Graph):
        return None
    if isinstance(value, gs.Constant):
        v = np.asarray(peek(value))
        return ("tensor", str(v.dtype), v.shape, _digest(v))
    if isinstance(value, (list, tuple)):
        items = [_attr_key(v) for v in value]
        return None if any(i is None for i in items) else tuple(items)
    if isinstance(value, np.ndarray):
        return ("array", str(value.dtype), value.shape, _digest(value))
    if isinstance(value, Message):  # e.g. Optional's TypeProto, kept as a proto by gs_roundtrip
        return (type(value).__name__, value.SerializeToString(deterministic=True))
    if isinstance(value, float):
        return ("float", np.float64(value).tobytes())  # NaN == NaN, 0.0 != -0.0
    try:
        hash(value)
    except TypeError:
        return None
    return (type(value).__name__, value)


def _node_head(node: Node) -> Optional[Hashable]:
    """What two equal nodes share besides their attributes (op, domain, the input objects, the output
    count); None for a node never merged."""
    if (node.domain or "") not in _DOMAINS or node.op in RANDOM_OPS or not node.outputs:
        return None
    ins = node.inputs
    if ins and not all(t.name for t in ins):  # an empty optional input is absent: one key, none trailing
        key = [id(t) if t.name else 0 for t in ins]
        while key and not key[-1]:
            key.pop()
        return (node.op, node.domain or "", tuple(key), len(node.outputs))
    return (node.op, node.domain or "", tuple(map(id, ins)), len(node.outputs))


def _attrs_key(node: Node) -> Optional[Hashable]:
    """The node's attributes as a key (:func:`_attr_key`, by name); None when one cannot be compared."""
    attrs = []
    if node.attrs:
        for k in sorted(node.attrs):
            key = _attr_key(node.attrs[k])
            if key is None:
                return None
            attrs.append((k, key))
    return tuple(attrs)


#: No node had this head yet (see ``_nodes``).
_UNSEEN = object()


def _external(values: object) -> bool:
    """Whether a constant's values (:func:`~k3opt.graph.ir.stored_values`) live in external data."""
    proto = getattr(values, "tensor", None)
    return isinstance(proto, TensorProto) and proto.data_location == TensorProto.EXTERNAL


class EliminateCommonSubexpressions(Pass):
    name = "eliminate-common-subexpressions"
    description = "Merge nodes with the same op, attributes and inputs, and equal constants."
    order = 300
    _hints = Hints(adds_bodies=False)
    preserves = frozenset({Shapes})
    options = {"cse_max_const_bytes": "largest constant compared by value, in bytes (default 1 MiB)"}
    option_values = {"cse_max_const_bytes": byte_size}

    def __init__(self) -> None:
        # First bytes and digest of each constant already read, by identity (kept alive so ids stay unique):
        # later fixed-point rounds read only new constants.
        self._heads: dict[int, tuple[gs.Constant, bytes]] = {}
        self._digests: dict[int, tuple[gs.Constant, Hashable]] = {}

    def end_run(self) -> None:
        self._heads.clear()
        self._digests.clear()

    def run(self, graph: Graph, ctx: PassContext) -> int:
        limit = int(ctx.options.get("cse_max_const_bytes", DEFAULT_MAX_CONST_BYTES))
        merged = self._constants(graph, limit)
        # Bodies: equal nodes within one body (one run of it sees one value per input). Constants are merged in
        # the main graph only: a constant read by two graphs must stay visible to both.
        for g in ctx.graphs(graph):
            twins: list[tuple[Node, Tensor]] = []
            merged += self._nodes(g, twins) + self._identities(g, twins, ctx)
        return merged

    @staticmethod
    def _identities(graph: Graph, twins: list[tuple[Node, Tensor]], ctx: PassContext) -> int:
        """Each ``(dup, kept)``: ``dup`` equals the node computing ``kept`` but both give graph outputs, so its
        readers cannot read ``kept``: it becomes ``Identity(kept)`` (computed once, its output name kept)."""
        if not twins:
            return 0
        outs = [dup.outputs[0] for dup, _ in twins]
        dead: list[Node] = []
        detach_all([dup for dup, _ in twins], dead)
        remove(graph, dead)
        for (dup, kept), out in zip(twins, outs):
            graph.nodes.append(gs.Node("Identity", ctx.fresh_name(f"{dup.name or dup.op}_twin"), {}, [kept], [out]))
        return len(twins)

    @staticmethod
    def _remembered(cache: dict, c: gs.Constant, compute: Callable[[gs.Constant], Hashable]) -> Hashable:
        hit = cache.get(id(c))
        if hit is None or hit[0] is not c:
            hit = cache[id(c)] = (c, compute(c))
        return hit[1]

    def _value_keys(self, group: list[gs.Constant]) -> list[Optional[Hashable]]:
        """Each constant's value key (:func:`_const_digest`), None for one whose first bytes no other shares
        (it equals none of them: its bytes are not hashed)."""
        heads = [self._remembered(self._heads, c, _head) for c in group]
        counts = Counter(heads)
        return [None if counts[h] == 1 else h if len(h) <= _HEAD_BYTES  # a short value's head is all of it
                else self._remembered(self._digests, c, _const_digest) for c, h in zip(group, heads)]

    def _constants(self, graph: Graph, limit: int) -> int:
        seen = {id(t) for t in graph.inputs}  # overridable: never merged
        groups: dict[tuple, dict[int, gs.Constant]] = {}
        for node in graph.nodes:
            for t in node.inputs:
                if id(t) not in seen and isinstance(t, gs.Constant):
                    seen.add(id(t))
                    values = stored_values(t)  # what Constant.dtype and .shape read, read once
                    if values.nbytes <= limit and not _external(values):
                        groups.setdefault((values.dtype, tuple(values.shape)), {})[id(t)] = t
        merged = 0
        for group in groups.values():
            if len(group) < 2:
                continue
            first: dict[Hashable, Tensor] = {}
            members = sorted(group.values(), key=lambda c: c.name)
            for c, key in zip(members, self._value_keys(members)):
                if key is None:
                    continue
                keep = first.setdefault(key, c)
                if keep is not c and can_replace(graph, c, keep):
                    replace_uses(graph, c, keep)
                    merged += 1
        return merged

    def _nodes(self, graph: Graph, twins: Optional[list[tuple[Node, Tensor]]] = None) -> int:
        """Merge each node into the first one equal to it (same head and attributes).

        A node's attributes are keyed only once a second node shares its head (most heads are unique:
        keying every node's attributes was a third of this walk); the head is taken when the node is
        visited, as merges rewire the inputs of the nodes after it, and attributes do not change here.
        """
        seen: dict[Hashable, Node] = {}
        alone: dict[Hashable, Optional[Node]] = {}  # head -> its only node so far (None: there were more)
        merged: list[Node] = []
        for node in list(graph.nodes):
            head = _node_head(node)
            if head is None:
                continue
            first = alone.get(head, _UNSEEN)
            if first is _UNSEEN:
                alone[head] = node
                continue
            if first is not None:
                alone[head] = None
                attrs = _attrs_key(first)
                if attrs is not None:
                    seen.setdefault((head, attrs), first)
            attrs = _attrs_key(node)
            if attrs is None:
                continue
            keep = seen.setdefault((head, attrs), node)
            if keep is node:
                continue
            if not self._merge(graph, node, keep):
                if twins is not None and len(node.outputs) == 1 and node.op != "Identity":
                    twins.append((node, keep.outputs[0]))  # both give graph outputs (see _identities)
                continue
            merged.append(node)  # nothing reads its outputs any more; unlinked from its inputs below, all at once
        dead: list[Node] = []
        detach_all(merged, dead)
        remove(graph, dead)
        return len(dead)

    @staticmethod
    def _merge(graph: Graph, dup: Node, keep: Node) -> bool:
        """Point readers of ``dup``'s outputs to ``keep``'s; False (nothing done) if outputs would clash."""
        pairs = list(zip(dup.outputs, keep.outputs))
        for old, new in pairs:
            if is_graph_output(graph, old) and is_graph_output(graph, new):
                return False
        for old, new in pairs:
            if is_graph_output(graph, old) or old.outputs:
                replace_uses(graph, old, new)
        return True
