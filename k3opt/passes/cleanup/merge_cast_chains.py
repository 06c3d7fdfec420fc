"""merge-cast-chains: ``Cast(Cast(x, T1), T2)`` becomes ``Cast(x, T2)`` when T1 loses nothing of x.

Exact because the first Cast then yields x's value itself (every value of
x's type is representable in T1), and a Cast depends only on the value.
float32->float64->float32 merges (and then is removed as a same-type Cast);
float32->float16->float32 does not (float16 rounds). Refused when x's type
is unknown or the middle tensor has another reader or is a graph output.
"""
from __future__ import annotations

from onnx import TensorProto as T

from ...graph.ir import Graph, Node, set_input
from ...graph.dtypes import onnx_type
from .._rewire import ChainPass, cast_target, detach

_INTS = {T.INT8: (True, 8), T.UINT8: (False, 8), T.INT16: (True, 16), T.UINT16: (False, 16),
         T.INT32: (True, 32), T.UINT32: (False, 32), T.INT64: (True, 64), T.UINT64: (False, 64)}
# Float types by (exact integer bits of the significand, can hold every value of these floats).
_FLOATS = {T.FLOAT16: 11, T.BFLOAT16: 8, T.FLOAT: 24, T.DOUBLE: 53}
_FLOAT_WIDENS = {T.FLOAT16: {T.FLOAT, T.DOUBLE}, T.BFLOAT16: {T.FLOAT, T.DOUBLE}, T.FLOAT: {T.DOUBLE}}


def lossless(src: int, dst: int) -> bool:
    """True when every value of ONNX type ``src`` is exactly representable in ``dst``."""
    if src == dst:
        return True
    if src == T.BOOL:
        return dst in _INTS or dst in _FLOATS
    if src in _FLOATS:
        return dst in _FLOAT_WIDENS.get(src, set())
    if src in _INTS:
        signed, bits = _INTS[src]
        if dst in _INTS:
            dsigned, dbits = _INTS[dst]
            return (signed == dsigned and dbits >= bits) or (not signed and dsigned and dbits > bits)
        if dst in _FLOATS:
            return bits - signed <= _FLOATS[dst]
    return False


class MergeCastChains(ChainPass):
    name = "merge-cast-chains"
    description = "Merge Cast(Cast(x)) when the middle type holds every value of x's type."
    order = 230
    ops = frozenset({"Cast"})

    def merge(self, graph: Graph, first: Node, node: Node, dead: list[Node]) -> bool:
        src, middle = onnx_type(first.inputs[0].dtype), cast_target(first)
        if src is None or middle is None or not lossless(src, middle):
            return False
        set_input(node, 0, first.inputs[0])
        detach(first, dead)
        return True
