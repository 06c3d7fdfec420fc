"""fold-batchnorm: an inference BatchNormalization, or a per-channel Mul by a constant, folds into the
Conv / ConvTranspose / Gemm / MatMul computing its input.

``BN(y) = (y - mean) * scale / sqrt(var + eps) + B`` over axis 1 is, per output channel, ``y * a + c``
with ``a = scale / sqrt(var + eps)`` and ``c = B - mean * a``: the producer's weights are scaled by ``a``
and its bias becomes ``bias * a + c`` (``_channel_affine``; float64, cast back to the weights' dtype).
A MatMul takes the bias by becoming a Gemm, so only a 2-D one folds a BatchNormalization (its channel
axis, 1, is then the last). ``Mul(conv(x), s)`` with ``s`` of shape ``(C,1,1)``, ``(1,C,1,1)`` or a
scalar scales the Conv/ConvTranspose weights the same way.

Refused: scale, B, mean or var not constant, not of shape ``(C,)`` or ``var + eps <= 0``; a non-constant
epsilon is impossible (attribute); ``training_mode=1`` or a used running-mean/var output; ``spatial=0``
(opset < 9); the producer's output read elsewhere or a graph output; non-constant weights or bias;
weights not float16/32/64; folded values that overflow the dtype or fall below its smallest normal;
a Mul constant that broadcasts over any axis but the channel's or raises the rank.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ...graph.ir import Graph, Node, const_value, is_graph_output
from ...pipeline.analyses import Shapes
from ...pipeline.pass_base import PassContext
from ..fold._channel_affine import (CONVOLUTIONS, MAX_CHANNEL_ELEMENTS, RefusalNotes, channel_operand, channel_producer,
                              fold_into, out_channels, out_rank)
from .._rewire import NodeRewritePass


def batchnorm_affine(node: Node, channels: int) -> tuple[Optional[tuple[np.ndarray, np.ndarray]], str]:
    """``(a, c)`` with ``BN(y) = y * a + c`` per channel (float64), or (None, why not)."""
    if int(node.attrs.get("training_mode", 0)) != 0 or int(node.attrs.get("spatial", 1)) != 1:
        return None, "training mode or spatial=0"
    if len(node.inputs) != 5:
        return None, "not the five-input inference form"
    values = []
    for t in node.inputs[1:]:
        shape = getattr(t, "shape", None)
        v = const_value(t) if shape is not None and len(shape) == 1 and shape[0] == channels else None
        if v is None or v.size > MAX_CHANNEL_ELEMENTS:
            return None, f"scale/B/mean/var not constants of shape ({channels},)"
        values.append(v.astype(np.float64))
    scale, bias, mean, var = values
    denom = var + float(node.attrs.get("epsilon", 1e-5))
    if not (denom > 0).all():
        return None, "var + epsilon is not positive"
    a = scale / np.sqrt(denom)
    return (a, bias - mean * a), ""


class FoldBatchNorm(RefusalNotes, NodeRewritePass):
    name = "fold-batchnorm"
    description = "Fold inference BatchNormalization (and per-channel constant Mul) into the Conv/ConvTranspose/Gemm/MatMul before it."
    order = 150
    preserves = frozenset({Shapes})
    ops = frozenset({"BatchNormalization", "Mul"})

    def rewrite(self, graph: Graph, node: Node, ctx: PassContext, dead: list[Node]) -> bool:
        if node.op == "BatchNormalization":
            return self._batchnorm(graph, node, ctx, dead)
        return self._mul(graph, node, ctx, dead)

    def _batchnorm(self, graph: Graph, node: Node, ctx: PassContext, dead: list[Node]) -> bool:
        p = channel_producer(graph, node.inputs[0], ctx)
        if p is None:
            return False
        if any(t.outputs or is_graph_output(graph, t) for t in node.outputs[1:]):
            return self.refuse(node, "its running mean/var outputs are used")
        c, r = out_channels(p), out_rank(p)
        if c is None:
            return self.refuse(node, f"the {p.op}'s weight is not a constant of known shape")
        if r is None or r < 2 or (p.op == "MatMul" and r != 2):
            return self.refuse(node, f"the {p.op}'s channels are not on axis 1 (or its rank is unknown)")
        affine, why = batchnorm_affine(node, c)
        if affine is None:
            return self.refuse(node, why)
        return fold_into(graph, node, p, affine[0], affine[1], ctx, dead, self.refuse)

    def _mul(self, graph: Graph, node: Node, ctx: PassContext, dead: list[Node]) -> bool:
        found = channel_operand(graph, node, CONVOLUTIONS, self.refuse, ctx)
        return found is not None and fold_into(graph, node, found[0], found[1], None, ctx, dead, self.refuse)
