"""copy-reshape-dims: a Reshape target computed at run time becomes a constant when each element is a
known number or a copy of the input's own dim at that position (``0`` with ``allowzero=0``), or when
exactly one element is unknown and every other is a known positive number (that one becomes ``-1``).

PyTorch's ``x.view(n, 3, 7, h, w)`` with a dynamic batch ``n = x.size(0)`` exports
``Shape``/``Gather``/``Unsqueeze``/``Concat`` feeding the Reshape; when ``n`` is dim 0 of the
Reshape's own input (the same symbol, as shape inference or dim tracing proves it), the target
``[0, 3, 7, h, w]`` says the same and the shape arithmetic dies. Paddle's exports spell
``reshape(x, [batch, 200])`` with ``Cast``s around the Shape: ``[-1, 200]``.

Exact: element ``i`` becomes 0 only when it is the same symbol as the input's dim ``i`` (so copying
gives that very size, also when it is 0 at run time); known numbers (a literal -1 or 0 included)
stay. A lone unknown element ``u`` with every other a known positive number: the original Reshape
runs only when ``u`` (or the dim a 0 copies, or what a -1 infers) times their product is the element
count, which is exactly what ``-1`` infers. Refused when ``allowzero=1`` (0 would mean an empty dim),
when two elements are unknown, a symbol sits at another position, or the target is already constant.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ...graph.ir import Graph, Node, Tensor, as_constant, is_const, producer, set_input
from ...graph.symbolic.algebra import Dim
from ...graph.symbolic.dims import Dims
from ...pipeline.analyses import Shapes
from ...pipeline.pass_base import PassContext
from .._rewire import NodeRewritePass

#: How far back the target's and the input's dims are traced: a CNN's batch size is often lost by shape
#: inference at a Resize and found again a dozen ops upstream (cached per tensor within a run).
TRACE_DEPTH = 24
#: An element nothing is known of (a computed int, maybe negative), unlike a dim (None or a symbol).
UNKNOWN = object()


def target_elements(dims: Dims, t: Tensor) -> Optional[list[object]]:
    """The target's elements as :meth:`Dims.elements` knows them; a Concat's 1-element part it cannot
    read (a ``Cast`` of a dim, say) counts as :data:`UNKNOWN`. None when the length is not known."""
    elements = dims.elements(t, TRACE_DEPTH)
    if elements is not None:
        return list(elements[0]) if len(elements[1]) == 1 else None
    p = producer(t)
    if p is None or p.op != "Concat" or int(p.attrs.get("axis", 0)) not in (0, -1):
        return None
    out: list[object] = []
    for part in p.inputs:
        known = dims.elements(part, TRACE_DEPTH)
        if known is not None and len(known[1]) == 1:
            out += known[0]
        elif part.shape is not None and list(part.shape) == [1]:
            out.append(UNKNOWN)
        else:
            return None
    return out


class CopyReshapeDims(NodeRewritePass):
    name = "copy-reshape-dims"
    description = ("A run-time Reshape target of known numbers and copies of the input's own dims (or one "
                   "unknown among known positive numbers: -1) becomes a constant.")
    order = 285
    needs_shapes = True
    #: Only the target's spelling changes: every value, so every shape, stays (inference may know more of the
    #: output then: see :func:`_sharpens`).
    preserves = frozenset({Shapes})
    ops = frozenset({"Reshape"})

    def rewrite(self, graph: Graph, node: Node, ctx: PassContext, dead: list[Node]) -> bool:
        if len(node.inputs) != 2 or is_const(node.inputs[1]) or node.attrs.get("allowzero", 0):
            return False
        dims = ctx.dims(graph)
        elements = target_elements(dims, node.inputs[1])
        if elements is None:
            return False
        x = node.inputs[0]
        target: list[Optional[int]] = [_spelled(dims, e, x, i) for i, e in enumerate(elements)]
        unknown = [i for i, e in enumerate(target) if e is None]
        if len(unknown) > 1:
            return False
        if unknown:
            if any(e <= 0 for i, e in enumerate(target) if i != unknown[0]):
                return False
            target[unknown[0]] = -1
        if _sharpens(node, target):
            ctx.analyses.sharpen_shapes(graph)
        set_input(node, 1, as_constant(ctx.fresh_name(f"{node.name}_shape"), np.array(target, np.int64)))
        return True


def _sharpens(node: Node, target: list[Optional[int]]) -> bool:
    """Whether inference knows a dim of the Reshape's output from the constant ``target`` that its kept shape
    lacks (a number, or a 0 copying a known input dim, where the data propagation of the old target lost it).

    A -1 that inference may now compute (the 0s cancel symbolic dims) is not counted: dim tracing reads that
    quotient already (``k3opt.graph.symbolic.trace._reshaped_dim``), and counting it costs the 64-layer Llama a
    third inference and a round for value_info only."""
    out, x = node.outputs[0].shape, node.inputs[0].shape
    if out is None or len(out) != len(target):
        return True
    copied = [None] * len(target) if x is None else list(x[:len(target)]) + [None] * (len(target) - len(x))
    return any(not isinstance(d, (int, str)) and (e > 0 or (e == 0 and isinstance(c, (int, str))))
               for d, e, c in zip(out, target, copied))


def _spelled(dims: Dims, e: object, x: Tensor, i: int) -> Optional[int]:
    """Element ``e`` at position ``i`` as a constant target entry (0: copy x's dim ``i``), None if unknown."""
    if isinstance(e, int):
        return e
    d: Dim = e if isinstance(e, str) else None
    return 0 if d is not None and dims.at(x, i, TRACE_DEPTH) == d else None
