"""eliminate-common-subexpressions: compute each value once.

Two nodes with the same op, domain, attributes and inputs (the same tensor
objects, in order) compute the same outputs; the later one's readers read
the earlier one's outputs. Equal constants are merged first, so nodes that
read equal weights become equal too; constants are compared by a hash of
their bytes, grouped by dtype and shape so that only candidates are read,
and never read when they live in external data or exceed
``cse_max_const_bytes`` (default 1 MiB).

Refused: random ops (two draws are not one), nodes with subgraphs, nodes in
custom domains (their semantics are unknown), and merges that would make two
graph outputs one tensor.
"""
from __future__ import annotations

import hashlib
import math
import sys
from typing import Hashable, Optional

import numpy as np
import onnx_graphsurgeon as gs
from google.protobuf.message import Message
from onnx import TensorProto, helper
from onnx_graphsurgeon.ir.tensor import LazyValues

from ..ir import Graph, Node, Tensor, is_graph_output, peek, replace_uses
from .base import Pass, PassContext, register_pass
from .cleanup_rewire import can_replace, detach_all, remove
from .fold_constants import RANDOM_OPS

DEFAULT_MAX_CONST_BYTES = 1 << 20
_DOMAINS = ("", "ai.onnx", "ai.onnx.ml")


#: Types whose ``raw_data`` is exactly the bytes of the array onnx reads from it (not bit-packed) on a
#: little-endian machine: a constant of these is hashed from the proto, without building the array.
_RAW_AS_ARRAY = frozenset(
    {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.BOOL,
     TensorProto.INT8, TensorProto.INT16, TensorProto.INT32, TensorProto.INT64,
     TensorProto.UINT8, TensorProto.UINT16, TensorProto.UINT32, TensorProto.UINT64}
) if sys.byteorder == "little" else frozenset()


def _digest(value: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(value).tobytes()).hexdigest()


def _const_digest(c: gs.Constant) -> str:
    """:func:`_digest` of the constant's value; from its ``raw_data`` when that is the same bytes."""
    proto = getattr(c._values, "tensor", None) if type(c._values) is LazyValues else None
    if isinstance(proto, TensorProto) and proto.data_type in _RAW_AS_ARRAY and proto.HasField("raw_data") \
            and not proto.HasField("segment") and proto.data_location != TensorProto.EXTERNAL:
        raw = proto.raw_data
        if len(raw) == helper.tensor_dtype_to_np_dtype(proto.data_type).itemsize * math.prod(proto.dims):
            return hashlib.sha1(raw).hexdigest()
    return _digest(np.asarray(peek(c)))


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


def _node_key(node: Node) -> Optional[Hashable]:
    if (node.domain or "") not in _DOMAINS or node.op in RANDOM_OPS or not node.outputs:
        return None
    attrs = []
    if node.attrs:
        for k in sorted(node.attrs):
            key = _attr_key(node.attrs[k])
            if key is None:
                return None
            attrs.append((k, key))
    return (node.op, node.domain or "", tuple(attrs), tuple(map(id, node.inputs)), len(node.outputs))


def _external(c: gs.Constant) -> bool:
    proto = getattr(c._values, "tensor", None)
    return isinstance(proto, TensorProto) and proto.data_location == TensorProto.EXTERNAL


class EliminateCommonSubexpressions(Pass):
    name = "eliminate-common-subexpressions"
    description = "Merge nodes with the same op, attributes and inputs, and equal constants."
    order = 300
    preserves_shapes = True
    options = {"cse_max_const_bytes": "largest constant compared by value, in bytes (default 1 MiB)"}

    def __init__(self) -> None:
        # Digest of each constant already hashed, by identity (kept alive so ids stay unique):
        # later fixed-point rounds hash only new constants.
        self._digests: dict[int, tuple[gs.Constant, str]] = {}

    def run(self, graph: Graph, ctx: PassContext) -> int:
        limit = int(ctx.options.get("cse_max_const_bytes", DEFAULT_MAX_CONST_BYTES))
        return self._constants(graph, limit) + self._nodes(graph)

    def _digest_of(self, c: gs.Constant) -> str:
        hit = self._digests.get(id(c))
        if hit is None or hit[0] is not c:
            hit = self._digests[id(c)] = (c, _const_digest(c))
        return hit[1]

    def _constants(self, graph: Graph, limit: int) -> int:
        seen = {id(t) for t in graph.inputs}  # overridable: never merged
        groups: dict[tuple, dict[int, gs.Constant]] = {}
        for node in graph.nodes:
            for t in node.inputs:
                if id(t) not in seen and isinstance(t, gs.Constant):
                    seen.add(id(t))
                    if t._values.nbytes <= limit and not _external(t):
                        groups.setdefault((t.dtype, tuple(t.shape)), {})[id(t)] = t
        merged = 0
        for group in groups.values():
            if len(group) < 2:
                continue
            first: dict[str, Tensor] = {}
            for c in sorted(group.values(), key=lambda c: c.name):
                keep = first.setdefault(self._digest_of(c), c)
                if keep is not c and can_replace(graph, c, keep):
                    replace_uses(graph, c, keep)
                    merged += 1
        return merged

    def _nodes(self, graph: Graph) -> int:
        seen: dict[Hashable, Node] = {}
        merged: list[Node] = []
        for node in list(graph.nodes):
            key = _node_key(node)
            if key is None:
                continue
            keep = seen.setdefault(key, node)
            if keep is node or not self._merge(graph, node, keep):
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


register_pass(EliminateCommonSubexpressions)
