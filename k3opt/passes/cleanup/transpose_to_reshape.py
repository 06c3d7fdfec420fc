"""transpose-to-reshape: a Transpose that only moves dims of size 1 becomes a Reshape.

Exact because memory order is what a Reshape keeps: when every dim the
permutation moves past another is provably 1, the non-unit dims stay in
their relative order, so the elements are read in the same order and only
the shape changes. A decode step's ``(B, 1, H, D) -> (B, H, 1, D)`` is the
usual case (the new-token dim is 1); merge-reshapes then folds the Reshape
into the one before it.

The Reshape target spells each output dim as its known size, a 0 (copy)
when the dim keeps its place, or one -1 when every other entry is a known
positive size (so the -1 is exact even for an empty tensor). Refused when
the input's dims are unknown, a non-unit dim changes place relative to
another, more than one dim would need a -1, or the opset predates
Reshape's shape input (5).
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ...graph.ir import Graph, Node, as_constant, is_graph_output
from ...graph.symbolic.algebra import Dim
from ...pipeline.analyses import Shapes
from ...pipeline.pass_base import PassContext
from .._rewire import NodeRewritePass, bypass
from .._shared.op_kinds import perm_of


def reshape_target(dims: Sequence[Dim], perm: Sequence[int]) -> Optional[list[int]]:
    """The Reshape target equal to ``Transpose(x, perm)`` for ``x`` of ``dims``, or None when there is none."""
    if len(dims) != len(perm) or sorted(perm) != list(range(len(perm))) or list(perm) == sorted(perm):
        return None
    kept = [p for p in perm if dims[p] != 1]
    if kept != sorted(kept):
        return None  # a dim that is not provably 1 moves past another
    target = []
    for i, p in enumerate(perm):
        d = dims[p]
        if isinstance(d, int) and d > 0:
            target.append(d)
        elif p == i and not isinstance(d, int):
            target.append(0)  # the dim stays at index i: copy it (allowzero is off)
        else:
            target.append(-1)
    if target.count(-1) > 1 or (-1 in target and any(t <= 0 for t in target if t != -1)):
        return None
    return target


def keeps_order(dims: Sequence[Dim], perm: Sequence[int]) -> bool:
    """``Transpose(x, perm)`` of ``x`` of ``dims`` lays the elements out in x's order (it moves only unit dims)."""
    kept = [p for p in perm if dims[p] != 1]
    return len(dims) == len(perm) and sorted(perm) == list(range(len(perm))) and kept == sorted(kept)


def _into_reshape(graph: Graph, ctx: PassContext, node: Node, perm: Sequence[int], dims: Sequence[Dim],
                  dead: list[Node]) -> bool:
    """A Transpose moving only unit dims, whose one reader is a Reshape of it, goes: the Reshape reads the
    elements in the same order from the Transpose's input. Only where every target element that may be 0 (a 0,
    or computed) stands at an axis the Transpose keeps in place: a 0 copies that axis of the Reshape's input.
    The decode step's ``Reshape(Transpose(o, [0,2,1,3]), [B, 1, -1])`` of a one-token attention output is the case
    whose reshape target (the moved dim unknown beside a copied one) :func:`reshape_target` cannot spell."""
    out = node.outputs[0]
    if not keeps_order(dims, perm) or len(out.outputs) != 1 or is_graph_output(graph, out):
        return False
    reader = out.outputs[0]
    if reader.op != "Reshape" or (reader.domain or "") not in ("", "ai.onnx") or len(reader.inputs) != 2 \
            or reader.inputs[0] is not out or reader.inputs[1] is out:
        return False
    if not reader.attrs.get("allowzero", 0):
        elements = ctx.dims(graph).elements(reader.inputs[1])
        if elements is None:
            return False
        for i, e in enumerate(elements[0]):
            if not (isinstance(e, int) and e != 0) and (i >= len(perm) or perm[i] != i):
                return False
    return bypass(graph, node, node.inputs[0], dead)


class TransposeToReshape(NodeRewritePass):
    name = "transpose-to-reshape"
    description = "A Transpose that only moves dims of size 1 becomes a Reshape (which then merges with its neighbours)."
    order = 245
    ops = frozenset({"Transpose"})
    min_opset = 5
    anchor_ops = frozenset({"Transpose"})
    preserves = frozenset({Shapes})

    def rewrite(self, graph: Graph, node: Node, ctx: PassContext, dead: list[Node]) -> bool:
        perm, dims = perm_of(node), ctx.dims(graph).of(node.inputs[0])
        target = None if perm is None or dims is None else reshape_target(dims, perm)
        if target is None:
            return perm is not None and dims is not None and _into_reshape(graph, ctx, node, perm, dims, dead)
        node.op = "Reshape"
        node.attrs.clear()
        node.inputs.append(as_constant(ctx.fresh_name(f"{node.name or 'Transpose'}_shape"),
                                       np.array(target, dtype=np.int64)))
        return True
