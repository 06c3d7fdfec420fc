"""merge-reshapes: ``Reshape(Reshape(x, s1), s2)`` becomes ``Reshape(x, s2')``.

Exact when s2 does not read the first result's shape: s2 is a constant and,
unless the second Reshape has ``allowzero=1``, each 0 in it (a copy of the
first result's dim at that index) is resolved: to that dim's known size, or
kept as a 0 when that dim provably equals x's dim at the same index (s1 has
a 0 there too, or both are the same symbol), or made the -1 when that dim
is a symbol and every other element a number. A -1 is fine: it depends only
on the element count, which the first Reshape keeps. A computed s2 (the
shape arithmetic of an export: ``Concat(Unsqueeze(Gather(Shape(h), 0)), [1],
[-1])``) stays as it is: each element that may be 0 (a 0, or a dim, which is
0 for an empty tensor and then copies too) must sit where the first result's
dim is provably x's (traced, unknown dims named by their tensor: ``s1 =
[Shape(x)[0], -1, 1, 8]`` keeps x's dim 0). Refused when a 0 cannot be
resolved, or when the middle tensor has another reader or is a graph output.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ...graph.ir import Graph, Node, as_constant, int_list, set_input
from ...graph.symbolic.dims import Dims
from ...pipeline.pass_base import PassContext
from .._rewire import NodeRewritePass, chain_producer, detach


def resolved_target(dims: Dims, first: Node, target: list[int]) -> Optional[list[int]]:
    """``target`` (the second Reshape's, allowzero off) with its 0s made independent of ``first``'s result."""
    middle, x = first.outputs[0], first.inputs[0]
    s1 = int_list(first.inputs[1]) if not first.attrs.get("allowzero", 0) else None
    out = []
    for i, t in enumerate(target):
        if t != 0:
            out.append(t)
            continue
        d = dims.at(middle, i)
        if isinstance(d, int) and d > 0:
            out.append(d)
        elif (s1 is not None and i < len(s1) and s1[i] == 0) or (isinstance(d, str) and dims.at(x, i) == d):
            out.append(0)
        elif isinstance(d, str):
            out.append(-1)  # a symbol x lacks there: the rest of the element count, when the others are numbers
        else:
            return None
    if out.count(-1) > target.count(-1) and (out.count(-1) > 1 or any(t <= 0 for t in out if t != -1)):
        return None
    return out


def _copies_agree(dims: Dims, graph: Graph, first: Node, second: Node) -> bool:
    """The computed target of ``second`` copies the same dims from x as from ``first``'s result: every element
    that may be 0 is at an index where the two provably have one dim (unknown dims named by their tensor)."""
    elements = dims.elements(second.inputs[1])
    if elements is None or len(elements[1]) != 1:
        return False
    maybe_zero = [i for i, e in enumerate(elements[0]) if not (isinstance(e, int) and e != 0)]
    if not maybe_zero:
        return True
    named = Dims(graph, name_unknown=True)
    middle, x = first.outputs[0], first.inputs[0]
    return all(named.at(middle, i) is not None and named.at(middle, i) == named.at(x, i) for i in maybe_zero)


class MergeReshapes(NodeRewritePass):
    name = "merge-reshapes"
    description = "Merge consecutive Reshapes whose second shape does not depend on the first."
    order = 250
    ops = frozenset({"Reshape"})

    def rewrite(self, graph: Graph, node: Node, ctx: PassContext, dead: list[Node]) -> bool:
        first = chain_producer(graph, node, "Reshape", ctx)
        if first is None or len(node.inputs) < 2 or len(first.inputs) < 2:  # opset < 5: shape attribute
            return False
        target = int_list(node.inputs[1])
        if target is None:
            if not node.attrs.get("allowzero", 0) and not _copies_agree(ctx.dims(graph), graph, first, node):
                return False
            set_input(node, 0, first.inputs[0])
            detach(first, dead)
            return True
        if 0 in target and not node.attrs.get("allowzero", 0):
            resolved = resolved_target(ctx.dims(graph), first, target)
            if resolved is None:
                return False
            if resolved != target:
                set_input(node, 1, as_constant(ctx.fresh_name(f"{node.name or 'Reshape'}_shape"),
                                               np.array(resolved, dtype=np.int64)))
        set_input(node, 0, first.inputs[0])
        detach(first, dead)
        return True
