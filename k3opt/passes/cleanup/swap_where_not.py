"""swap-where-not: ``Where(Not(c), a, b)`` becomes ``Where(c, b, a)``.

Exact: ``Not(c)`` has ``c``'s shape, so the broadcast is the same, and each element picks the same value.
The ``Not`` goes once no node reads it (remove-dead-nodes). Refused for a ``Not`` of another domain.
"""
from __future__ import annotations

from ...graph.ir import Graph, Node, producer, set_input
from ...pipeline.analyses import Shapes
from ...pipeline.pass_base import PassContext
from .._rewire import NodeRewritePass


class SwapWhereNot(NodeRewritePass):
    name = "swap-where-not"
    description = "Where(Not(c), a, b) -> Where(c, b, a)."
    order = 262
    preserves = frozenset({Shapes})
    ops = frozenset({"Where"})

    def rewrite(self, graph: Graph, node: Node, ctx: PassContext, dead: list[Node]) -> bool:
        if len(node.inputs) != 3:
            return False
        neg = producer(node.inputs[0])
        if neg is None or neg.op != "Not" or (neg.domain or "") not in ("", "ai.onnx") or not neg.inputs:
            return False
        c, a, b = neg.inputs[0], node.inputs[1], node.inputs[2]
        set_input(node, 0, c)
        set_input(node, 1, b)
        set_input(node, 2, a)
        return True
