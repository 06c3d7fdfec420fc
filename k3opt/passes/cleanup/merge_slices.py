"""merge-slices: ``Slice(Slice(x))`` with constant parameters becomes one Slice.

Axes only one of the two slices are kept as they are. An axis both slice composes when both steps
are 1 and every start/end is non-negative (negative ones are first made so with the axis's static
size): the inner slice keeps ``[s1, e1)``, the outer ``[s2, e2)`` of that, together
``[s1 + s2, min(e1, s1 + e2))``, also when either is empty or clamped at the end. Refused: a
non-constant parameter, a step other than 1 on a shared axis, a negative start/end on an axis of
unknown size, negative axes of an input of unknown rank, the inner result read elsewhere or a graph
output, the opset-1 attribute form.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ...graph.ir import Graph, Node, as_constant, int_list, rank, set_input
from ...pipeline.analyses import Shapes
from ...pipeline.pass_base import PassContext
from .._rewire import NodeRewritePass, chain_producer, detach

INT64_MAX = np.iinfo(np.int64).max


def slice_params(node: Node, x_rank: Optional[int]) -> Optional[dict[int, tuple[int, int, int]]]:
    """axis -> (start, end, step) of a Slice with constant inputs (axes normalized), or None."""
    if len(node.inputs) < 3 or "starts" in node.attrs:
        return None
    starts, ends = int_list(node.inputs[1]), int_list(node.inputs[2])
    if starts is None or ends is None or len(starts) != len(ends):
        return None
    has = [len(node.inputs) > i and bool(node.inputs[i].name) for i in (3, 4)]
    axes = int_list(node.inputs[3]) if has[0] else list(range(len(starts)))
    steps = int_list(node.inputs[4]) if has[1] else [1] * len(starts)
    if axes is None or steps is None or len(axes) != len(starts) or len(steps) != len(starts):
        return None
    if any(a < 0 for a in axes):
        if x_rank is None:
            return None
        axes = [a + x_rank if a < 0 else a for a in axes]
    if len(set(axes)) != len(axes):
        return None
    return {a: (s, e, st) for a, s, e, st in zip(axes, starts, ends, steps)}


def _non_negative(v: int, size: object) -> Optional[int]:
    """``v`` as a non-negative position (a negative one needs the static ``size``)."""
    if v >= 0:
        return v
    if isinstance(size, (int, np.integer)) and size >= 0:
        return max(v + int(size), 0)
    return None


def compose(inner: tuple[int, int, int], outer: tuple[int, int, int], size: object) -> Optional[tuple[int, int, int]]:
    """One (start, end, 1) equal to slicing by ``inner`` then ``outer`` on an axis of ``size`` (None: unknown)."""
    if inner[2] != 1 or outer[2] != 1:
        return None
    s1, e1 = _non_negative(inner[0], size), _non_negative(inner[1], size)
    if s1 is None or e1 is None:
        return None
    inner_len = None
    if isinstance(size, (int, np.integer)) and size >= 0:
        inner_len = max(0, min(e1, int(size)) - min(s1, int(size)))
    s2, e2 = _non_negative(outer[0], inner_len), _non_negative(outer[1], inner_len)
    if s2 is None or e2 is None:
        return None
    return min(s1 + s2, INT64_MAX), min(e1, s1 + e2, INT64_MAX), 1


class MergeSlices(NodeRewritePass):
    name = "merge-slices"
    description = "Merge consecutive Slices with constant parameters into one."
    order = 257
    preserves = frozenset({Shapes})
    ops = frozenset({"Slice"})

    def rewrite(self, graph: Graph, second: Node, ctx: PassContext, dead: list[Node]) -> bool:
        first = chain_producer(graph, second, "Slice", ctx)
        if first is None:
            return False
        x = first.inputs[0]
        r = rank(x)
        p1, p2 = slice_params(first, r), slice_params(second, r)
        if p1 is None or p2 is None:
            return False
        merged = dict(p1)
        for axis, outer in p2.items():
            if axis in merged:
                size = x.shape[axis] if x.shape is not None and axis < len(x.shape) else None
                both = compose(merged[axis], outer, size)
                if both is None:
                    return False
                merged[axis] = both
            else:
                merged[axis] = outer
        axes = sorted(merged)
        columns = [np.array([merged[a][k] for a in axes], np.int64) for k in range(3)]
        base = second.name or "slice"
        inputs = [as_constant(ctx.fresh_name(f"{base}_{n}"), v) for n, v in zip(("starts", "ends", "steps"), columns)]
        axes_t = as_constant(ctx.fresh_name(f"{base}_axes"), np.array(axes, np.int64))
        new = [x, inputs[0], inputs[1], axes_t, inputs[2]]
        for i, t in enumerate(new):
            if i < len(second.inputs):
                set_input(second, i, t)
            else:
                second.inputs.append(t)
        detach(first, dead)
        return True
