"""What fuse-layernorm and fuse-rmsnorm share: the statistics pattern, the Casts of low-precision
exports, the scale/bias tails, and the checks that make a fusion exact.

LayerNorm is RMSNorm of ``x - mean(x)``: both end in ``v / sqrt(mean(v*v) + eps)``
(:func:`rms_core`). A matched normalization is described by a :class:`NormMatch`
(built by :func:`analyze`, which declines with a reason for anything it cannot
prove exact); rewrites rebuild it from that with :func:`norm_input` and
:func:`affine_input`.

Rules come in tails, largest first: scale and bias, scale, bias, a Cast back
to the input type, nothing. :func:`k3opt.patterns.apply_rules` gives each rule its own
sweep in that order, so the largest fusion of a norm always wins, whatever
order the applier visits nodes in (a smaller rule anchors inside a larger
match: at the statistics, before the scale and bias).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Sequence

import numpy as np
from onnx import TensorProto

from ...graph import dtypes, ir
from ...graph.ir import Graph, Node, Tensor
from ...patterns import Match, PatternBuilder, RewriteBuilder, Rule, RuleSetPass, apply_rules, checks
from ...pipeline.pass_base import Hints, PassContext

#: Bits of precision order of the float types a normalization may run in (16-bit types do not widen into each other).
_WIDTH = {TensorProto.FLOAT16: 16, TensorProto.BFLOAT16: 16, TensorProto.FLOAT: 32, TensorProto.DOUBLE: 64}
#: Input/output types the fused ops take with ``stash_type=1`` (statistics in float32) without losing precision.
_FUSABLE_TYPES = (TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.FLOAT)
#: The tails after the statistics, largest first ("cast": only the Cast back to the input type).
TAILS = (("scale", "bias"), ("scale",), ("bias",), ("cast",), ())


@dataclasses.dataclass
class NormMatch:
    """A matched normalization, enough to rebuild it.

    ``x`` is the input before any Cast of the match; ``scale``/``bias`` the
    matched constants as they are in the graph (None when absent; any shape
    that broadcasts exactly over ``normalized_shape``). dtypes are ONNX
    element types: ``input_dtype`` of ``x``, ``compute_dtype`` of the
    statistics, ``output_dtype`` of the value the match replaces.
    """

    x: Tensor
    scale: Optional[Tensor]
    bias: Optional[Tensor]
    epsilon: float
    axis: int
    normalized_shape: tuple[int, ...]
    input_dtype: int
    compute_dtype: int
    output_dtype: int
    casts: list[Node]
    #: The ReduceMean of the squares: identifies the normalization (one per match).
    reduce: Node
    match: Match

    @property
    def weight(self) -> Optional[Tensor]:
        """RMSNorm's name for the scale."""
        return self.scale

    @property
    def axes(self) -> tuple[int, ...]:
        """The normalized axes, negative (``axis`` .. -1)."""
        return tuple(range(self.axis, 0))


# -- patterns ----------------------------------------------------------------------------------------------------

#: First opset with LayerNormalization in the default domain (fuse-layernorm's ``min_opset``).
LAYER_NORMALIZATION_OPSET = 17


def maybe_cast(op: PatternBuilder, value: Any, label: str) -> Any:
    """``value`` or ``Cast(value)`` (node labelled ``label``); binds the result as ``label + "_value"``."""
    return op.Or(op.Cast(value, _name=label), value, _name=label + "_value")


def rms_core(op: PatternBuilder, v: Any) -> Any:
    """``v / sqrt(mean(v*v) + eps)``: Pow(v, 2) or Mul(v, v); Div by the Sqrt, or Mul by Reciprocal(Sqrt),
    by Div(1, Sqrt) or by Pow(., -0.5). The mean is labelled ``var_mean``, eps ``eps``.
    """
    square = op.Or(op.Pow(v, op.Constant(2.0, rtol=0.0), _name="square"), op.Mul(v, v, _name="square"))
    var_eps = op.Add(op.ReduceMean(square, _name="var_mean", _allow_other_inputs=True, keepdims=1),
                     op.AnyConstant("eps"))
    std = op.Sqrt(var_eps)
    return op.Or(op.Div(v, std), op.Mul(v, op.Reciprocal(std)), op.Mul(v, op.Div(1.0, std)),
                 op.Mul(v, op.Pow(var_eps, op.Constant(-0.5, rtol=0.0))))


def with_tail(op: PatternBuilder, y: Any, tail: tuple[str, ...]) -> Any:
    """What follows the statistics ``y``: an optional Cast (labelled ``cast_out``; a required one for the
    ``("cast",)`` tail), then ``* scale`` and ``+ bias`` for the parts named in ``tail``.
    """
    if tail == ("cast",):
        return op.Cast(y, _name="cast_out")
    if tail:
        y = maybe_cast(op, y, "cast_out")
    if "scale" in tail:
        y = op.Mul(y, op.AnyConstant("scale"), _name="scale_mul")
    if "bias" in tail:
        y = op.Add(y, op.AnyConstant("bias"), _name="bias_add")
    return y


def tail_rules(name: str, core: Callable[[PatternBuilder, Any], Any], tails: tuple[tuple[str, ...], ...],
               centered: bool, rewrite: Callable[[RewriteBuilder, NormMatch], Optional[Tensor]],
               description: str) -> list[Rule]:
    """One rule per tail: pattern ``with_tail(core(op, x))``, checked by :func:`analyze`, rebuilt by ``rewrite``.

    ``rewrite(op, norm_match)`` returns the replacement tensor, or None to leave the match alone. Apply
    the rules with ``k3opt.patterns.apply_rules(..., bodies=True)`` (or :class:`OrderedRulesPass`).
    """
    return [_tail_rule(name, core, tail, centered, rewrite, description) for tail in tails]


def _tail_rule(name: str, core: Callable[[PatternBuilder, Any], Any], tail: tuple[str, ...], centered: bool,
               rewrite: Callable[[RewriteBuilder, NormMatch], Optional[Tensor]], description: str) -> Rule:
    def pattern(op: PatternBuilder, x: Any) -> Any:
        return with_tail(op, core(op, x), tail)

    def check(m: Match) -> bool:
        m.memo["norm"] = analyze(m, centered)
        return m.memo["norm"] is not None

    def apply(op: RewriteBuilder, m: Match) -> Optional[Tensor]:
        nm = m.memo["norm"] if "norm" in m.memo else analyze(m, centered)
        return None if nm is None else rewrite(op, nm)

    return Rule(f"{name}-{'-'.join(tail) or 'bare'}", pattern, apply, check,
                description=f"{description} ({' and '.join(tail) or 'nothing after the statistics'})")


class OrderedRulesPass(RuleSetPass):
    """A :class:`RuleSetPass` whose rules get one sweep each, in order, in the graph and its bodies
    (:func:`k3opt.patterns.apply_rules`)."""

    _hints = Hints(adds_bodies=False)  # k3opt's norm rules build no graph attribute

    def run(self, graph: Graph, ctx: PassContext) -> int:
        return apply_rules(graph, ctx, self.rules, bodies=True)


# -- checks ------------------------------------------------------------------------------------------------------

def _widens(src: int, dst: int) -> bool:
    return src == dst or (src in _WIDTH and dst in _WIDTH and _WIDTH[dst] > _WIDTH[src])


def _shape(m: Match) -> Optional[list]:
    """The input's shape, from whichever tensor of the statistics (all shaped like it) has the most known dims.

    Never from the match's output: a scale or bias may broadcast that to another shape.
    """
    square = m.node("var_mean").inputs[0]
    candidates = [m["x"], m.get("cast_in_value"), m.get("cast_mid_value"), square]
    shapes = [t.shape for t in candidates if t is not None and t.shape is not None]
    known = lambda s: sum(isinstance(d, (int, np.integer)) and d >= 0 for d in s)  # noqa: E731
    return max(shapes, key=known) if shapes else None


def _axes(node: Node, rank: int) -> Optional[tuple[int, ...]]:
    """The reduced axes, non-negative; None unless constant and at least one (a rank-0 input has none to fuse)."""
    axes = checks.reduce_axes(node)
    if axes is None or axes == ():
        return None
    axes = tuple(range(rank)) if axes == checks.ALL else checks.normalized_axes(axes, rank)
    return axes or None


def fits(shape: tuple[int, ...], normalized_shape: tuple[int, ...], rank: int) -> bool:
    """A constant of ``shape`` broadcasts over exactly the normalized (trailing) axes of a rank-``rank`` value:
    1s elsewhere, each normalized dim equal or 1, rank not above the value's (so the result's shape is unchanged).
    """
    k = len(normalized_shape)
    if len(shape) > rank or any(d != 1 for d in shape[:-k]):
        return False
    trailing = (1,) * max(0, k - len(shape)) + tuple(shape[-k:])
    return all(d in (1, n) for d, n in zip(trailing, normalized_shape))


def _const_shape(t: Tensor) -> Optional[tuple[int, ...]]:
    """``t``'s static shape, or its constant's (read from the proto: a weight is never loaded for it)."""
    shape = checks.static_shape(t)
    if shape is None:
        c = ir.const_tensor(t)
        shape = None if c is None else tuple(int(d) for d in c.shape)
    return shape


def _absorbable(t: Tensor, normalized_shape: tuple[int, ...], rank: int, dtype: int) -> bool:
    shape = _const_shape(t)
    return shape is not None and fits(shape, normalized_shape, rank) and dtypes.onnx_type(t.dtype) in (None, dtype)


def analyze(m: Match, centered: bool) -> Optional[NormMatch]:
    """The :class:`NormMatch` of a structural match, or None (with ``m.fail(reason)``) when fusing is not exact.

    Declines when: the reduce axes are not constant, not the trailing axes, or differ between the two
    means; the normalized dims are not static; eps is not a constant scalar >= 0; a Cast narrows the
    precision (or the result is cast to a type other than the input's); scale/bias do not broadcast over
    exactly the normalized axes.
    """
    shape = _shape(m)
    if shape is None:
        return _fail(m, "the input's rank is unknown")
    rank = len(shape)
    axes = _axes(m.node("var_mean"), rank)
    if axes is None:
        return _fail(m, "the ReduceMean axes are not constant (or reduce nothing)")
    if centered and _axes(m.node("mean"), rank) != axes:
        return _fail(m, "the two ReduceMeans reduce different axes")
    if axes != tuple(range(rank - len(axes), rank)):
        return _fail(m, f"reduce axes {list(axes)} are not the trailing axes of a rank-{rank} input")
    normalized_shape = tuple(shape[rank - len(axes):])
    if not all(isinstance(d, (int, np.integer)) and d > 0 for d in normalized_shape):
        return _fail(m, f"normalized dims {normalized_shape} are not static")
    normalized_shape = tuple(int(d) for d in normalized_shape)
    eps = checks.const_value(m["eps"])
    if eps is None or eps.size != 1 or eps.ndim > rank or dtypes.onnx_type(eps.dtype) not in _WIDTH \
            or not math.isfinite(float(eps.reshape(-1)[0])) or float(eps.reshape(-1)[0]) < 0:
        return _fail(m, "epsilon is not a constant finite scalar >= 0")
    types = _dtypes(m, dtypes.onnx_type(eps.dtype))
    if isinstance(types, str):
        return _fail(m, types)
    input_dtype, compute_dtype, output_dtype = types
    scale, bias = m.get("scale"), m.get("bias")
    for role, t in (("scale", scale), ("bias", bias)):
        if t is not None and not _absorbable(t, normalized_shape, rank, output_dtype):
            return _fail(m, f"the {role} {_const_shape(t)} does not broadcast over exactly the normalized "
                            f"dims {normalized_shape}")
    casts = [n for n in (m.get_node(label) for label in ("cast_in", "cast_mid", "cast_out")) if n is not None]
    return NormMatch(x=m["x"], scale=scale, bias=bias, epsilon=float(eps.reshape(-1)[0]), axis=-len(axes),
                     normalized_shape=normalized_shape, input_dtype=input_dtype, compute_dtype=compute_dtype,
                     output_dtype=output_dtype, casts=casts, reduce=m.node("var_mean"), match=m)


def _dtypes(m: Match, eps_dtype: Optional[int]) -> tuple[int, int, int] | str:
    """(input, compute, output) element types, or why the match's Casts make fusing inexact."""
    src = dtypes.onnx_type(m["x"].dtype)
    cur = src
    for label in ("cast_in", "cast_mid"):
        node = m.get_node(label)
        if node is not None:
            if cur is None:
                return "the input's dtype is unknown"
            if not _widens(cur, node.attrs["to"]):
                return "a Cast lowers the precision inside the statistics"
            cur = node.attrs["to"]
    if src is None:  # no Cast before the statistics: they run in the input's type, eps's type
        src = cur = eps_dtype
    out_cast = m.get_node("cast_out")
    out = out_cast.attrs["to"] if out_cast is not None else cur
    if out_cast is not None and out != src:
        return "the result is cast to a type other than the input's"
    if src not in _FUSABLE_TYPES or out not in _FUSABLE_TYPES:
        return "only float16, bfloat16 and float32 inputs and results are fused (statistics in float32)"
    return src, cur, out


def _fail(m: Match, reason: str) -> None:
    m.fail(reason)
    return None


# -- rewrites ----------------------------------------------------------------------------------------------------

def norm_input(op: RewriteBuilder, nm: NormMatch) -> Tensor:
    """The fused op's input: ``x``, or ``x`` cast to the output type when the match widened it for good."""
    if nm.output_dtype == nm.input_dtype:
        return nm.x
    return op.Cast(nm.x, to=nm.output_dtype)


def affine_input(op: RewriteBuilder, nm: NormMatch, t: Optional[Tensor], fill: float) -> Tensor:
    """A scale/bias of exactly ``normalized_shape`` and the output type: ``t`` itself when it already is
    (its data is not loaded), else a new constant (``fill`` everywhere when ``t`` is None).
    """
    dtype = dtypes.numpy_dtype(nm.output_dtype)
    if t is None:
        return op.const(np.full(nm.normalized_shape, fill, dtype=dtype))
    if _const_shape(t) == nm.normalized_shape:
        return t
    value = np.asarray(checks.const_value(t))
    k = len(nm.normalized_shape)
    trailing = value.reshape(value.shape[-k:] if value.ndim >= k else (1,) * (k - value.ndim) + value.shape)
    return op.const(np.broadcast_to(trailing, nm.normalized_shape).astype(dtype))


#: RMSNorm has a weight (scale) but no bias.
RMS_TAILS = (("scale",), ("cast",), ())


def rms_norm_core(op: PatternBuilder, x: Any) -> Any:
    """``x / sqrt(mean(x^2) + eps)`` with an optional Cast of x (``hidden.to(float32)``)."""
    return rms_core(op, maybe_cast(op, x, "cast_in"))


def rmsnorm_rules(rewrite: Callable[[RewriteBuilder, NormMatch], Optional[Tensor]], name: str = "rmsnorm"
                  ) -> list[Rule]:
    """The RMSNorm rules (weighted, Cast back only, bare), each rebuilt by ``rewrite`` (see module docstring)."""
    return tail_rules(name, rms_norm_core, RMS_TAILS, False, rewrite, "RMSNorm")
