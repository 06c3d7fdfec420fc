"""castlike-to-cast: ``CastLike(x, like)`` becomes ``Cast(x, to=type(like))`` when like's type is known.

Exact by definition: CastLike reads only the element type of its second
input, and is specified as that Cast (same attributes, e.g. ``saturate``).
The Cast no longer reads ``like``, so a constant ``x`` folds (the dynamo
exporter's ``CastLike(1.0, hidden)`` in every RMSNorm), and the tensor
``like`` loses a reader. Refused when like's element type is unknown; for
``--target cann`` the report then names what is left (ATC has no CastLike
parser, so ``k3opt check`` will list it too).
"""
from __future__ import annotations

from ...graph.ir import Graph, Node
from ...pipeline.pass_base import PassContext
from ...graph.dtypes import onnx_type
from .._rewire import NodeRewritePass


class CastLikeToCast(NodeRewritePass):
    name = "castlike-to-cast"
    description = "CastLike to a known type becomes Cast (a constant operand then folds)."
    order = 225
    ops = frozenset({"CastLike"})

    def rewrite(self, graph: Graph, node: Node, ctx: PassContext, dead: list[Node]) -> bool:
        if len(node.inputs) != 2:
            return False
        to = onnx_type(node.inputs[1].dtype)
        if to is None:
            return False
        del node.inputs[1]
        node.op = "Cast"
        node.attrs["to"] = to
        return True

    def finish(self, graph: Graph, ctx: PassContext) -> None:
        """For a target without CastLike (cann), note the CastLikes left (their second input's type is unknown)."""
        if ctx.target.runs_castlike:
            return
        left = [n.name for g in ctx.graphs(graph) for n in ctx.nodes_of(g, self.ops)]
        if left:
            ctx.note(f"{len(left)} CastLike kept for {ctx.target}, which has no CastLike parser (dtype of the second "
                     f"input unknown: {', '.join(left[:5])})")
