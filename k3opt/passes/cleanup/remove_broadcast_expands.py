"""remove-broadcast-expands: an ``Expand`` whose readers' broadcast already gives its shape goes.

``Add(x, Expand(b, Shape(x)))`` is ``Add(x, b)``: a broadcasting elementwise op (Add, Sub, Mul, Div, Pow,
Equal, Less, Greater, And, Or, Where) that reads ``Expand(b, s)`` reads ``b`` instead when ``s`` adds
nothing to the broadcast of the op's other operands. Exact when ``s`` (read as a shape computation:
constant, or ``Shape(x)`` and its pieces, symbols included) is no longer than the longest other operand
and each element is 1 or provably equal to the dim of some other operand at that (right-aligned)
position: the result's shape is then the broadcast of the others and ``b``, as before, and every element
is the same value of ``b``. Refused when an element is unknown, or when ``b`` and the Expand's output
differ in dtype (they cannot); readers that are not such ops keep reading the Expand.
"""
from __future__ import annotations

from typing import Optional

from ...graph.ir import Graph, Node, Tensor, producer, set_input
from ...graph.symbolic.dims import Dims
from ...graph.symbolic.trace import BROADCASTING
from ...pipeline.analyses import Shapes
from ...pipeline.pass_base import PassContext
from .._rewire import NodeRewritePass


def _given_by_others(dims: Dims, target: list, others: list[Tensor]) -> bool:
    """Every element of ``target`` is 1 or a dim some tensor of ``others`` has at that right-aligned place."""
    ranks = [len(o.shape) for o in others if o.shape is not None]
    if not ranks or len(target) > max(ranks):
        return False
    for k, e in enumerate(reversed(target)):
        if e == 1:
            continue
        if e is None or (isinstance(e, int) and e < 0):
            return False
        if not any(o.shape is not None and len(o.shape) > k and dims.at(o, len(o.shape) - 1 - k) == e
                   for o in others):
            return False
    return True


class RemoveBroadcastExpands(NodeRewritePass):
    name = "remove-broadcast-expands"
    description = "An Expand read by broadcasting ops whose other operands already give its shape goes."
    order = 223
    preserves = frozenset({Shapes})
    ops = BROADCASTING

    def rewrite(self, graph: Graph, node: Node, ctx: PassContext, dead: list[Node]) -> bool:
        done = False
        for i, t in enumerate(node.inputs):
            src = self._expanded(t)
            if src is None:
                continue
            dims = ctx.dims(graph)
            target = dims.elements(producer(t).inputs[1])
            others = [o for j, o in enumerate(node.inputs) if j != i]
            if target is None or len(target[1]) != 1 or not _given_by_others(dims, list(target[0]), others):
                continue
            set_input(node, i, src)
            done = True
        return done

    @staticmethod
    def _expanded(t: Tensor) -> Optional[Tensor]:
        """``b`` when ``t`` is ``Expand(b, s)`` of the standard domain, else None."""
        p = producer(t)
        if p is None or p.op != "Expand" or (p.domain or "") not in ("", "ai.onnx") or len(p.inputs) != 2:
            return None
        b = p.inputs[0]
        return b if b.dtype is None or t.dtype is None or b.dtype == t.dtype else None
