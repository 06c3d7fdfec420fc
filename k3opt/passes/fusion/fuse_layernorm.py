"""fuse-layernorm: a decomposed LayerNorm becomes one ``LayerNormalization`` (opset >= 17).

Matches ``(x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps) [* scale] [+ bias]`` in the
spellings exporters emit (see docs/passes/fuse-layernorm.md and :mod:`.._shared.norm_match`):
Pow(d, 2) or Mul(d, d); Div, Mul by Reciprocal, Div(1, .) or Pow(., -0.5); axes as
attribute or input; the Casts of fp16/bf16 exports around the statistics; scale and
bias in either operand order, each optional. Declines whatever it cannot prove exact
(:func:`.._shared.norm_match.analyze`).
"""
from __future__ import annotations

from typing import Any

from ...graph.ir import Tensor
from ...patterns import PatternBuilder, RewriteBuilder
from ...pipeline.analyses import Shapes
from .._shared.norm_match import (LAYER_NORMALIZATION_OPSET, TAILS, NormMatch, OrderedRulesPass, affine_input,
                                  maybe_cast, norm_input, rms_core, tail_rules)


def layer_norm_core(op: PatternBuilder, x: Any) -> Any:
    """``(x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps)`` with optional Casts on x and after the Sub."""
    x1 = maybe_cast(op, x, "cast_in")
    d = op.Sub(x1, op.ReduceMean(x1, _name="mean", _allow_other_inputs=True, keepdims=1))
    return rms_core(op, maybe_cast(op, d, "cast_mid"))


def to_layer_normalization(op: RewriteBuilder, nm: NormMatch) -> Tensor:
    """``LayerNormalization(x, scale or ones, [bias], axis, epsilon, stash_type=1)``."""
    inputs = [norm_input(op, nm), affine_input(op, nm, nm.scale, 1.0)]
    if nm.bias is not None:
        inputs.append(affine_input(op, nm, nm.bias, 0.0))
    return op.LayerNormalization(*inputs, axis=nm.axis, epsilon=nm.epsilon, stash_type=1)


RULES = tail_rules("layernorm", layer_norm_core, TAILS, True, to_layer_normalization,
                   "decomposed LayerNorm -> LayerNormalization")

class FuseLayerNorm(OrderedRulesPass):
    """Decomposed LayerNorms (every exporter spelling, fp16/bf16 Casts) -> LayerNormalization."""

    name = "fuse-layernorm"
    description = "decomposed LayerNorm (every exporter spelling, fp16/bf16 Casts) -> LayerNormalization"
    order = 500
    preserves = frozenset({Shapes})
    min_opset = LAYER_NORMALIZATION_OPSET
    anchor_ops = frozenset({"ReduceMean"})
    needs_shapes = True
    rules = RULES
