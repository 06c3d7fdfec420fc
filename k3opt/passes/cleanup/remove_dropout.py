"""remove-dropout: inference-time ``Dropout`` is the identity on its data.

Removed when its mask output is unused and it cannot drop anything: no
``training_mode`` input (or a constant false one; before opset 7, ``is_test``
set), or a constant ratio of 0. Refused when the mask is read, when training
mode is on or unknown and the ratio is not a constant 0.
"""
from __future__ import annotations

from ...graph.ir import Graph, Node, const_scalar
from ...pipeline.analyses import Shapes
from ...pipeline.pass_base import PassContext
from .._rewire import NodeRewritePass, bypass, is_used


def inference_mode(node: Node, opset: int) -> bool:
    """True when this Dropout cannot drop: not training, or ratio 0."""
    ins = node.inputs
    ratio_zero = const_scalar(ins[1]) == 0.0 if len(ins) > 1 and ins[1].name else node.attrs.get("ratio", 0.5) == 0
    if ratio_zero:
        return True
    if opset < 7:
        return bool(node.attrs.get("is_test", 0))
    return len(ins) < 3 or not ins[2].name or const_scalar(ins[2]) == 0.0


class RemoveDropout(NodeRewritePass):
    name = "remove-dropout"
    description = "Remove inference-time Dropout whose mask is unused."
    order = 210
    preserves = frozenset({Shapes})
    ops = frozenset({"Dropout"})

    def rewrite(self, graph: Graph, node: Node, ctx: PassContext, dead: list[Node]) -> bool:
        if any(is_used(graph, t) for t in node.outputs[1:]) or not inference_mode(node, ctx.opset):
            return False
        return bypass(graph, node, node.inputs[0], dead)
