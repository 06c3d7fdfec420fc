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

from ...graph.ir import Graph, Node, as_constant
from ...pipeline.analyses import Shapes
from ...pipeline.pass_base import PassContext, register_pass
from .._rewire import NodeRewritePass
from .._shared.op_kinds import perm_of
from ..analysis.fold_shapes import Dim, DimAnalysis, tensor_dims


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


@register_pass
class TransposeToReshape(NodeRewritePass):
    name = "transpose-to-reshape"
    description = "A Transpose that only moves dims of size 1 becomes a Reshape (which then merges with its neighbours)."
    order = 245
    ops = frozenset({"Transpose"})
    min_opset = 5
    anchor_ops = frozenset({"Transpose"})
    preserves = frozenset({Shapes})

    def run(self, graph: Graph, ctx: PassContext) -> int:
        with ctx.analysis(DimAnalysis, graph):  # values never change here: what was traced holds
            return super().run(graph, ctx)

    def rewrite(self, graph: Graph, node: Node, ctx: PassContext, dead: list[Node]) -> bool:
        perm, dims = perm_of(node), tensor_dims(node.inputs[0])
        target = None if perm is None or dims is None else reshape_target(dims, perm)
        if target is None:
            return False
        node.op = "Reshape"
        node.attrs.clear()
        node.inputs.append(as_constant(ctx.fresh_name(f"{node.name or 'Transpose'}_shape"),
                                       np.array(target, dtype=np.int64)))
        return True
