"""cancel-squeeze-pairs: ``Squeeze(Unsqueeze(x, a), a)`` and ``Unsqueeze(Squeeze(x, a), a)`` are x.

Unsqueezing inserts size-1 dims at the output positions ``a``; squeezing those very positions of
that output removes them again. Squeezing positions ``a`` of x (which must be 1 for the model to
run) and unsqueezing the result at ``a`` puts them back. Both axes lists are normalized against the
rank of the larger tensor (negative axes need x's rank) and must be equal as sets. Both axes forms
are read (attribute before opset 13, constant input after). Refused: a Squeeze without axes (it
drops whichever dims are 1), non-constant axes, different axes, the middle tensor read elsewhere or
a graph output (merge-unsqueezes composes Unsqueeze chains; remove-noop-ops folds a Reshape back).
"""
from __future__ import annotations

from typing import Optional

from ...graph.ir import Graph, Node, rank
from ...pipeline.analyses import Shapes
from ...pipeline.pass_base import PassContext
from .._rewire import NodeRewritePass, bypass, chain_producer, detach, unsqueeze_axes

PAIRS = {"Squeeze": "Unsqueeze", "Unsqueeze": "Squeeze"}


def _normalized(axes: Optional[list[int]], r: Optional[int]) -> Optional[frozenset[int]]:
    if axes is None or (r is None and any(a < 0 for a in axes)):
        return None
    norm = [a + r if a < 0 else a for a in axes] if r is not None else axes
    return frozenset(norm) if len(set(norm)) == len(norm) else None


class CancelSqueezePairs(NodeRewritePass):
    name = "cancel-squeeze-pairs"
    description = "Squeeze(Unsqueeze(x, a), a) and Unsqueeze(Squeeze(x, a), a) become x."
    order = 256
    preserves = frozenset({Shapes})
    ops = frozenset(PAIRS)

    def rewrite(self, graph: Graph, node: Node, ctx: PassContext, dead: list[Node]) -> bool:
        first = chain_producer(graph, node, PAIRS[node.op], ctx)
        if first is None:
            return False
        x = first.inputs[0]
        a1, a2 = unsqueeze_axes(first), unsqueeze_axes(node)  # the same reader for Squeeze's axes
        r = rank(x)
        wide = None if r is None or a1 is None else r + len(a1) if first.op == "Unsqueeze" else r
        if not a1 or not a2 or _normalized(a1, wide) is None or _normalized(a1, wide) != _normalized(a2, wide):
            return False
        if not bypass(graph, node, x, dead):
            return False
        detach(first, dead)
        return True
