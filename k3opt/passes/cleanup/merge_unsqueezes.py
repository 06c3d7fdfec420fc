"""merge-unsqueezes: ``Unsqueeze(Unsqueeze(x, a1), a2)`` becomes one ``Unsqueeze(x, a)``.

The second Unsqueeze's axes are positions in the final result; the first
one's axes land on the final positions left over, in order. Exact for any
axes; refused when x's rank is unknown (negative axes need it), an axes
list is not constant or repeats an axis, or the middle tensor has another
reader or is a graph output.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ...graph.ir import Graph, Node, Tensor, as_constant, rank, set_input
from ...pipeline.pass_base import PassContext
from .._rewire import NodeRewritePass, chain_producer, detach, unsqueeze_axes


def merged_axes(x_rank: int, a1: list[int], a2: list[int]) -> Optional[list[int]]:
    """The axes of the one Unsqueeze equal to unsqueezing a rank-``x_rank`` tensor by a1 then a2."""
    r1 = x_rank + len(a1)
    r2 = r1 + len(a2)
    n1 = {a + r1 if a < 0 else a for a in a1}
    n2 = {a + r2 if a < 0 else a for a in a2}
    if len(n1) != len(a1) or len(n2) != len(a2) or not all(0 <= a < r1 for a in n1) or not all(0 <= a < r2 for a in n2):
        return None
    rest = [p for p in range(r2) if p not in n2]  # final positions of the middle tensor's axes
    return sorted(n2 | {rest[j] for j in n1})


class MergeUnsqueezes(NodeRewritePass):
    name = "merge-unsqueezes"
    description = "Merge consecutive Unsqueezes into one."
    order = 255
    ops = frozenset({"Unsqueeze"})

    def rewrite(self, graph: Graph, node: Node, ctx: PassContext, dead: list[Node]) -> bool:
        first = chain_producer(graph, node, "Unsqueeze", ctx)
        if first is None:
            return False
        x: Tensor = first.inputs[0]
        a1, a2, r = unsqueeze_axes(first), unsqueeze_axes(node), rank(x)
        axes = None if a1 is None or a2 is None or r is None else merged_axes(r, a1, a2)
        if axes is None:
            return False
        if "axes" in node.attrs:
            node.attrs["axes"] = axes
        else:
            set_input(node, 1, as_constant(ctx.fresh_name(f"{node.name}_axes"), np.array(axes, dtype=np.int64)))
        set_input(node, 0, x)
        detach(first, dead)
        return True
