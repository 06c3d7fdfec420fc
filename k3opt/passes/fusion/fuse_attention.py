"""fuse-attention: recognised scaled dot-product attention (:mod:`._attention_common`) becomes one
``Attention`` (opset 23, default domain; onnxruntime 1.32 runs it) for ``--target onnx`` at opset >= 23.

The node gets 4-D BNSD q/k/v (GQA's repeat absorbed: ``q_num_heads``/``kv_num_heads``), ``scale``
(the product of the graph's factors), and the mask: ``is_causal=1`` for a constant mask that is
exactly the causal triangle of static lengths, else the graph's additive float mask as ``attn_mask``
(the op adds it to the scores as the graph does), expanded over its last two axes to (Sq, Skv) when
they are not provably those (onnxruntime broadcasts only the leading axes). Decode steps keep their
``Concat(past, new)`` and the op reads the concatenated keys/values (``present`` outputs unchanged).

Rows whose keys are all masked (onnxruntime's Attention gives them zeros, for a bias of -inf and for
one of the dtype's lowest value alike, per the op's errata) are made to agree with the graph:

- fill -inf with torch sdpa's IsNaN guard: zeros in both;
- fill -inf without the guard: the graph gives NaN; fused only when the mask is causal (no row is
  fully masked), else declined;
- fill = the dtype's lowest value (transformers' eager and dynamo masks): the graph gives a uniform
  row (every score rounds to that value); the mask is rebuilt with the next larger value, which every
  partially masked row still zeroes exactly and a fully masked one keeps uniform;
- a finite fill above the lowest value is added as it is (no row can be taken for a masked one);
- a mask of unknown form is declined (it may hold either value in a full row).

Below opset 23, or for another target, attentions stay decomposed: the pass counts them once on
the final graph (``finish``: ``ctx.counters["attention_found"]``, a note). Where it fuses, the
attentions it declines are noted with the reason.
"""
from __future__ import annotations

import re
from typing import Optional

import ml_dtypes
import numpy as np
from onnx import helper

from ...graph.ir import Graph, Node, Tensor
from ...patterns import RewriteBuilder
from ..analysis import fold_shapes
from ..fusion._attention_common import AttentionMatch, apply_attention, attention_rules
from ...pipeline.pass_base import Pass, PassContext, register_pass
from ._left_decomposed import note_left_decomposed

#: First opset with Attention in the default domain.
ATTENTION_OPSET = 23
_NOTE = re.compile(r"^\d+ attention\(s\) (found, left decomposed|declined): ")


def mask_refusal(am: AttentionMatch) -> Optional[str]:
    """Why Attention-23 (as onnxruntime runs it) would differ from the graph on fully masked rows, or None."""
    if am.mask is None or am.causal_only or am.rows_open:
        return None
    if am.mask_fill is None:
        return ("the mask is of unknown form: Attention zeroes a query row whose biases are all -inf or the "
                "dtype's lowest value, the decomposed graph need not")
    if am.mask_fill == float("-inf") and not am.zero_fully_masked:
        return "the mask fills -inf without the IsNaN guard: a fully masked row is NaN here, zeros in Attention"
    return None


def to_attention(op: RewriteBuilder, am: AttentionMatch) -> Optional[Tensor]:
    """``Attention(q, k, v[, attn_mask], scale, q_num_heads, kv_num_heads[, is_causal])`` (opset 23)."""
    why = mask_refusal(am)
    if why is not None:
        am.match.fail(why)
        return None
    attrs: dict = dict(scale=float(am.scale))
    # Attention-24 refuses head counts with 4-D inputs (it reads them from the shapes, as 23 does without them)
    if am.q_num_heads is not None and am.kv_num_heads is not None and am.match.ctx.opset < 24:
        attrs.update(q_num_heads=am.q_num_heads, kv_num_heads=am.kv_num_heads)
    if am.mask is None:
        return op.Attention(am.q, am.k, am.v, **attrs)
    if am.causal_only and _square(am):  # is_causal aligns by past_key's length; the keys here hold the past
        return op.Attention(am.q, am.k, am.v, is_causal=1, **attrs)
    return op.Attention(am.q, am.k, am.v, _fitted_mask(op, am, _mask_value(op, am)), **attrs)


def _square(am: AttentionMatch) -> bool:
    sq, skv = fold_shapes.dim_at(am.q, 2), fold_shapes.dim_at(am.k, 2)
    return isinstance(sq, int) and sq == skv


def _mask_value(op: RewriteBuilder, am: AttentionMatch) -> Tensor:
    """The mask, its fill moved off the dtype's lowest value (which onnxruntime takes for -inf)."""
    np_type = helper.tensor_dtype_to_np_dtype(am.dtype)  # float32, float16 or ml_dtypes' bfloat16
    lowest = np.array(ml_dtypes.finfo(np_type).min, dtype=np_type)
    if am.mask_fill != float(lowest):
        return am.mask
    fill = np.nextafter(lowest, np.array(0, dtype=np_type))
    return op.Where(am.keep, op.const(np.zeros((), np_type)), op.const(fill))


def _fitted_mask(op: RewriteBuilder, am: AttentionMatch, mask: Tensor) -> Tensor:
    """``mask`` with its last two axes of q's and k's sequence lengths (Expand when not provably so)."""
    rank = max(2, len(am.mask.shape))
    sq, skv = fold_shapes.dim_at(am.q, 2), fold_shapes.dim_at(am.k, 2)
    have = [fold_shapes.dim_at(am.mask, i) for i in range(len(am.mask.shape))][-2:]
    if len(have) == 2 and have[0] == sq and have[1] == skv and sq is not None and skv is not None:
        return mask
    q_len = op.Shape(am.q, start=2, end=3)
    k_len = op.Shape(am.k, start=2, end=3)
    shape = op.Concat(op.const(np.ones(rank - 2, dtype=np.int64)), q_len, k_len, axis=0)
    return op.Expand(mask, shape)


RULES = attention_rules(to_attention)


@register_pass
class FuseAttention(Pass):
    """Scaled dot-product attention -> Attention for --target onnx at opset >= 23; otherwise counted."""

    name = "fuse-attention"
    description = ("scaled dot-product attention (sdpa and eager exports, GQA, MLA, KV cache) -> Attention "
                   "(target onnx, opset >= 23); counted and kept decomposed otherwise")
    order = 520
    needs_shapes = True

    def run(self, graph: Graph, ctx: PassContext) -> int:
        return apply_attention(graph, ctx, RULES) if _fusable(ctx) else 0

    def finish(self, graph: Graph, ctx: PassContext) -> None:
        """Count the attentions left decomposed (``attention_found``) and note why, once, on the final graph."""
        found: dict[int, Node] = {}
        declined: dict[str, list[str]] = {}

        def record(op: RewriteBuilder, am: AttentionMatch) -> None:
            why = mask_refusal(am) if _fusable(ctx) else None
            if why is None:
                found.setdefault(id(am.softmax), am.softmax)
            else:
                declined.setdefault(why, []).append(am.softmax.name)

        def decline(softmax: Node, why: str) -> None:
            declined.setdefault(why, []).append(softmax.name)

        apply_attention(graph, ctx, attention_rules(record, on_decline=decline))
        ctx.notes[:] = [n for n in ctx.notes if not _NOTE.match(n)]  # the final graph's count only
        if not _fusable(ctx):
            note_left_decomposed(ctx, "attention_found", len(found), _NOTE, "attention(s)", ATTENTION_OPSET,
                                 lowered_by_target=True)
        for why, where in declined.items():
            names = ", ".join(f"'{w}'" for w in sorted(set(where))[:3])
            ctx.note(f"{len(set(where))} attention(s) declined: {why} (at {names})")


def _fusable(ctx: PassContext) -> bool:
    return ctx.target == "onnx" and ctx.emit_opset >= ATTENTION_OPSET
