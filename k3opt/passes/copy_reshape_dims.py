"""copy-reshape-dims: a Reshape target computed at run time becomes a constant when each element is a
known number or a copy of the input's own dim at that position (``0`` with ``allowzero=0``).

PyTorch's ``x.view(n, 3, 7, h, w)`` with a dynamic batch ``n = x.size(0)`` exports
``Shape``/``Gather``/``Unsqueeze``/``Concat`` feeding the Reshape; when ``n`` is dim 0 of the
Reshape's own input (the same symbol, as shape inference or dim tracing proves it), the target
``[0, 3, 7, h, w]`` says the same and the shape arithmetic dies.

Exact: element ``i`` becomes 0 only when it is the same symbol as the input's dim ``i`` (so copying
gives that very size, also when it is 0 at run time); known numbers (a literal -1 or 0 included)
stay. Refused when ``allowzero=1`` (0 would mean an empty dim), when any element is unknown or a
symbol other than the input's dim at its position, or the target is already constant.
"""
from __future__ import annotations

import numpy as np

from ..ir import Graph, Node, as_constant, is_const, set_input
from .base import PassContext, register_pass
from .cleanup_rewire import NodeRewritePass
from .fold_shapes import dim_at, remembered_dims, shape_elements


#: How far back the target's and the input's dims are traced: a CNN's batch size is often lost by shape
#: inference at a Resize and found again a dozen ops upstream (cached per tensor within a run).
TRACE_DEPTH = 24


class CopyReshapeDims(NodeRewritePass):
    name = "copy-reshape-dims"
    description = "A run-time Reshape target of known numbers and copies of the input's own dims becomes a constant."
    order = 285
    needs_shapes = True
    #: Only the target's spelling changes: every value, so every shape, stays.
    preserves_shapes = True
    ops = frozenset({"Reshape"})

    def run(self, graph: Graph, ctx: PassContext) -> int:
        with remembered_dims(graph):
            return super().run(graph, ctx)

    def rewrite(self, graph: Graph, node: Node, ctx: PassContext, dead: list[Node]) -> bool:
        if len(node.inputs) != 2 or is_const(node.inputs[1]) or node.attrs.get("allowzero", 0):
            return False
        elements = shape_elements(node.inputs[1], TRACE_DEPTH)
        if elements is None or len(elements[1]) != 1:
            return False
        x = node.inputs[0]
        target = []
        for i, e in enumerate(elements[0]):
            if isinstance(e, int):
                target.append(e)
            elif isinstance(e, str) and dim_at(x, i, TRACE_DEPTH) == e:
                target.append(0)
            else:
                return False
        set_input(node, 1, as_constant(ctx.fresh_name(f"{node.name}_shape"), np.array(target, np.int64)))
        return True


register_pass(CopyReshapeDims)
