"""merge-conv-bias: ``Add(conv(x), b)`` with a per-channel constant ``b`` becomes the convolution's bias.

For a Conv or ConvTranspose (with or without a bias input) ``b`` is of shape ``(C,1,1)``,
``(1,C,1,1)``, ``(1,C,1,...)`` or a scalar; for a Gemm ``(N,)``, ``(1,N)`` or a scalar (added to
``beta * C``). The new bias is ``bias + b``, computed in float64 and cast to the weights' dtype
(``_channel_affine``). Refused: a non-constant ``b``, one broadcasting over any axis but the
channel's or raising the rank, the producer's output read elsewhere or a graph output, a
non-constant existing bias, values that do not fit the dtype. MatMul + Add is fuse-matmul-add's.
"""
from __future__ import annotations

from ...graph.ir import Graph, Node
from ...pipeline.analyses import Shapes
from ...pipeline.pass_base import PassContext
from ..fold._channel_affine import CONVOLUTIONS, RefusalNotes, channel_operand, fold_into
from .._rewire import NodeRewritePass

BIASED = CONVOLUTIONS | {"Gemm"}


class MergeConvBias(RefusalNotes, NodeRewritePass):
    name = "merge-conv-bias"
    description = "Merge an Add of a per-channel constant after a Conv/ConvTranspose/Gemm into its bias."
    order = 155
    preserves = frozenset({Shapes})
    ops = frozenset({"Add"})

    def rewrite(self, graph: Graph, node: Node, ctx: PassContext, dead: list[Node]) -> bool:
        found = channel_operand(graph, node, BIASED, self.refuse, ctx)
        return found is not None and fold_into(graph, node, found[0], None, found[1], ctx, dead, self.refuse)
