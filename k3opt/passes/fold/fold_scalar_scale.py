"""fold-scalar-scale: a constant scalar ``Mul``/``Div`` of a projection's output goes into the projection.

Whisper scales q and k by ``d ** -0.25`` after their projections: ``Mul(Gemm(x, W, b), s)`` becomes
``Gemm(x, W * s, b * s)`` (unshared constants), else ``Gemm(x, W, b, alpha * s, beta * s)`` (not for
``--target cann``, whose Gemm is not known to honour alpha and beta); ``Mul(MatMul(x, W), s)`` becomes ``MatMul(x, W * s)`` and
``Mul(Add(MatMul(x, W), b), s)`` becomes ``Add(MatMul(x, W * s), b * s)``. ``Div`` by ``s`` is a scale
by ``1 / s``.

Exact up to rounding (``(x W) s`` and ``x (W s)`` differ in the last bit, as every peer's folding does):
``s`` is a constant with one element, of the projection's floating dtype, of rank no higher than the
result's (a scale of rank above would widen the result); the projection's result has no other reader and
is no graph output; a weight or bias that is scaled is a constant read by nothing else (a shared one
would have to be copied). Refused otherwise, and for a zero divisor.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ...graph.ir import Graph, Node, Tensor, as_constant, const_value, is_const, producer, rank, set_input
from ...pipeline.pass_base import PassContext
from .._rewire import NodeRewritePass, bypass, can_replace, single_use


def scale_of(node: Node) -> Optional[tuple[Tensor, float]]:
    """``(y, s)`` when ``node`` is ``y * s``, ``s * y`` or ``y / s`` with ``s`` a fitting constant scalar."""
    if len(node.inputs) != 2:
        return None
    pairs = [(0, 1), (1, 0)] if node.op == "Mul" else [(0, 1)]
    for yi, si in pairs:
        y, s = node.inputs[yi], node.inputs[si]
        if is_const(y) or not is_const(s):
            continue
        value = const_value(s)
        if value is None or value.size != 1 or value.dtype.kind != "f" or value.dtype != y.dtype:
            continue
        r = rank(y)
        if value.ndim and (r is None or value.ndim > r):
            continue
        scalar = float(value.reshape(()))
        if node.op == "Div":
            if scalar == 0.0:
                continue
            scalar = 1.0 / scalar
        return y, scalar
    return None


def _own_constant(graph: Graph, t: Tensor) -> bool:
    """``t`` is a constant only one node reads (it may be rewritten in place of a copy)."""
    return is_const(t) and single_use(graph, t)


def _scaled(t: Tensor, s: float, ctx: PassContext) -> Tensor:
    value = const_value(t)
    return as_constant(ctx.fresh_name(f"{t.name}_scaled"), (value * np.asarray(s, value.dtype)).astype(value.dtype))


class FoldScalarScale(NodeRewritePass):
    name = "fold-scalar-scale"
    description = "A constant scalar Mul/Div of a Gemm/MatMul(+bias) result goes into its alpha/beta or weight."
    order = 705
    ops = frozenset({"Mul", "Div"})

    def rewrite(self, graph: Graph, node: Node, ctx: PassContext, dead: list[Node]) -> bool:
        found = scale_of(node)
        if found is None:
            return False
        y, s = found
        p = producer(y)
        if p is None or (p.domain or "") not in ("", "ai.onnx") or not single_use(graph, y) or not ctx.owns(graph, p):
            return False
        if not can_replace(graph, node.outputs[0], y) or not self._fold(graph, p, s, ctx):
            return False
        return bypass(graph, node, y, dead)

    def _fold(self, graph: Graph, p: Node, s: float, ctx: PassContext) -> bool:
        if p.op == "Gemm":
            bias = len(p.inputs) > 2 and p.inputs[2].name
            if len(p.inputs) > 1 and _own_constant(graph, p.inputs[1]) and (not bias or _own_constant(graph, p.inputs[2])):
                for i in (1, 2) if bias else (1,):
                    set_input(p, i, _scaled(p.inputs[i], s, ctx))
                return True
            if not ctx.target.honours_gemm_scales:  # cann: ATC's Gemm alpha/beta other than 1 unknown
                return False
            p.attrs["alpha"] = float(p.attrs.get("alpha", 1.0)) * s
            if bias:
                p.attrs["beta"] = float(p.attrs.get("beta", 1.0)) * s
            return True
        if p.op == "MatMul" and len(p.inputs) == 2 and _own_constant(graph, p.inputs[1]):
            set_input(p, 1, _scaled(p.inputs[1], s, ctx))
            return True
        if p.op == "Add" and len(p.inputs) == 2:
            for mi, bi in ((0, 1), (1, 0)):
                mm, b = producer(p.inputs[mi]), p.inputs[bi]
                if (mm is not None and mm.op == "MatMul" and (mm.domain or "") in ("", "ai.onnx")
                        and single_use(graph, p.inputs[mi]) and ctx.owns(graph, mm) and len(mm.inputs) == 2
                        and _own_constant(graph, mm.inputs[1]) and _own_constant(graph, b)):
                    set_input(mm, 1, _scaled(mm.inputs[1], s, ctx))
                    set_input(p, bi, _scaled(b, s, ctx))
                    return True
        return False
