"""fuse-attention: recognised scaled dot-product attention (:mod:`.._shared.attention_match`) becomes one
``Attention`` (opset 23, default domain; onnxruntime 1.32 runs it) for ``--target onnx`` at opset >= 23.

The node gets 4-D BNSD q/k/v (GQA's repeat absorbed: ``q_num_heads``/``kv_num_heads``), ``scale``
(the product of the graph's factors), and the mask: ``is_causal=1`` for a constant mask that is
exactly the causal triangle of static lengths, else the graph's additive float mask as ``attn_mask``
(the op adds it to the scores as the graph does), expanded over its last two axes to (Sq, Skv) when
they are not provably those (onnxruntime broadcasts only the leading axes). Decode steps get the cache as
``past_key``/``past_value`` and the op's ``present`` outputs replace the ``Concat(past, new)``
(:func:`cache_refusal` says when the op reads the Concat instead).

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

from ...graph import dtypes
from ...graph.ir import Graph, Node, Tensor, producer, replace_uses
from ...patterns import RewriteBuilder, apply_rules, checks
from .._shared.attention_sites import attention_sites, site_name, why_unrecognised
from .._shared.attention_match import AttentionMatch, attention_rules
from ...pipeline.pass_base import Hints, Pass, PassContext
from ._left_decomposed import note_left_decomposed

#: First opset with Attention in the default domain.
ATTENTION_OPSET = 23
_NOTE = re.compile(r"^\d+ attention\(s\) (found, left decomposed|declined): ")


def mask_refusal(am: AttentionMatch) -> Optional[str]:
    """Why Attention-23 (as onnxruntime runs it) would differ from the graph on fully masked rows, or None."""
    if am.mask.tensor is None or am.mask.causal_only or am.mask.rows_open:
        return None
    if am.mask.fill is None:
        return ("the mask is of unknown form: Attention zeroes a query row whose biases are all -inf or the "
                "dtype's lowest value, the decomposed graph need not")
    if am.mask.fill == float("-inf") and not am.mask.zero_fully_masked:
        return "the mask fills -inf without the IsNaN guard: a fully masked row is NaN here, zeros in Attention"
    return None


#: (the Concat's present output, the Attention's) of each decode step fused with past_key/past_value.
Presents = list[tuple[Tensor, Tensor]]


def to_attention(op: RewriteBuilder, am: AttentionMatch, presents: Optional[Presents] = None) -> Optional[Tensor]:
    """``Attention(q, k, v[, attn_mask], scale, q_num_heads, kv_num_heads[, is_causal])`` (opset 23); a decode
    step whose cache Concats only the attention reads (:func:`cache_refusal`) gets the new keys and values
    and ``past_key``/``past_value``, its ``present_*`` outputs noted in ``presents``."""
    why = mask_refusal(am)
    if why is not None:
        am.match.fail(why)
        return None
    attrs: dict = dict(scale=float(am.scale))
    # Attention-24 refuses head counts with 4-D inputs (it reads them from the shapes, as 23 does without them)
    if am.q_num_heads is not None and am.kv_num_heads is not None and am.match.ctx.opset < 24:
        attrs.update(q_num_heads=am.q_num_heads, kv_num_heads=am.kv_num_heads)
    why = None if presents is None or am.cache is None else cache_refusal(am)
    if why is not None:
        am.match.ctx.note(f"attention at '{site_name(am.softmax)}' reads the concatenated KV cache: {why}")
    cached = presents is not None and am.cache is not None and why is None
    if am.mask.tensor is None:
        mask = None
    elif am.mask.causal_only and _square(am, cached):
        mask, attrs["is_causal"] = None, 1
    else:
        mask = _fitted_mask(op, am, _mask_value(op, am), cached)
    if not cached:
        return op.Attention(am.q, am.k, am.v, *([] if mask is None else [mask]), **attrs)
    cache = am.cache
    y, key, value = op.Attention(am.q, cache.new_key, cache.new_value, mask, cache.past_key, cache.past_value,
                                 _outputs=3, **attrs)
    presents += [(cache.present_key, key), (cache.present_value, value)]
    return y


def cache_refusal(am: AttentionMatch) -> Optional[str]:
    """Why a decode step's (``am.cache`` set) ``Concat(past, new)`` keys/values cannot become Attention's
    ``past_key``/``past_value``
    (the op then concatenates on the sequence axis of BNSD, as the graph does), or None.

    The recogniser gives the cache only for Concats of two inputs on axis 2 of BNSD keys, under GQA's
    repeat; here both parts must be rank 4 of the attention's dtype, and every reader of the Concats must be
    the attention's (or a Shape): the op's present outputs then replace them.
    """
    parts = (am.cache.past_key, am.cache.new_key, am.cache.past_value, am.cache.new_value)
    if any(checks.rank(t) != 4 for t in parts) or any(dtypes.onnx_type(t.dtype) != am.dtype for t in parts):
        return "the cache parts are not rank 4 of the attention's dtype"
    inside = {id(n) for n in am.match.nodes}
    for present in (am.cache.present_key, am.cache.present_value):
        other = next((n for n in present.outputs if id(n) not in inside and n.op != "Shape"), None)
        if other is not None:
            return f"the cache Concat '{present.name}' is also read by '{other.name}' ({other.op})"
    return None


def move_presents(graph: Graph, presents: Presents) -> None:
    """The Concats' readers (the graph outputs ``present.*``, Shapes) read the Attention's present outputs,
    unless a reader leads to the Attention (a mask from the cache's length): the Concat then stays for them."""
    for old, new in presents:
        if not _leads_to(old, producer(new)):
            replace_uses(graph, old, new)


#: Nodes :func:`_leads_to` visits before it gives up (and answers yes).
MAX_WALK = 256


def _leads_to(t: Tensor, node: Node) -> bool:
    """``node`` reads ``t`` or a tensor computed from it (or more than :data:`MAX_WALK` nodes do)."""
    seen: set[int] = set()
    todo = list(t.outputs)
    while todo:
        n = todo.pop()
        if n is node or len(seen) > MAX_WALK:
            return True
        if id(n) not in seen:
            seen.add(id(n))
            todo.extend(r for o in n.outputs for r in o.outputs)
    return False


def _square(am: AttentionMatch, cached: bool) -> bool:
    """q and the keys are of one static length, so the causal mask is the square lower triangle. With the
    cache given as ``past_key``, where ``is_causal`` aligns (upper left in the spec's text, offset by the past
    length in onnxruntime) matters unless the past is empty: q's length must also be the new keys'."""
    dims = am.match.dims
    sq, skv = dims.at(am.q, 2), dims.at(am.k, 2)
    return isinstance(sq, int) and sq == skv and (not cached or sq == dims.at(am.cache.new_key, 2))


def _mask_value(op: RewriteBuilder, am: AttentionMatch) -> Tensor:
    """The mask, its fill moved off the dtype's lowest value (which onnxruntime takes for -inf)."""
    np_type = dtypes.numpy_dtype(am.dtype)  # float32, float16 or ml_dtypes' bfloat16
    lowest = np.array(ml_dtypes.finfo(np_type).min, dtype=np_type)
    if am.mask.fill != float(lowest):
        return am.mask.tensor
    fill = np.nextafter(lowest, np.array(0, dtype=np_type))
    return op.Where(am.mask.keep, op.const(np.zeros((), np_type)), op.const(fill))


def _fitted_mask(op: RewriteBuilder, am: AttentionMatch, mask: Tensor, cached: bool) -> Tensor:
    """``mask`` with its last two axes of q's and k's sequence lengths (Expand when not provably so; with the
    cache as past inputs, ``cached``, its length is read from the parts: the Concat goes)."""
    rank = max(2, len(am.mask.tensor.shape))
    dims = am.match.dims
    sq, skv = dims.at(am.q, 2), dims.at(am.k, 2)
    have = [dims.at(am.mask.tensor, i) for i in range(len(am.mask.tensor.shape))][-2:]
    if len(have) == 2 and have[0] == sq and have[1] == skv and sq is not None and skv is not None:
        return mask
    q_len = op.Shape(am.q, start=2, end=3)
    if not cached:
        k_len = op.Shape(am.k, start=2, end=3)
    else:
        k_len = op.Add(op.Shape(am.cache.past_key, start=2, end=3), op.Shape(am.cache.new_key, start=2, end=3))
    shape = op.Concat(op.const(np.ones(rank - 2, dtype=np.int64)), q_len, k_len, axis=0)
    return op.Expand(mask, shape)


class FuseAttention(Pass):
    """Scaled dot-product attention -> Attention for --target onnx at opset >= 23; otherwise counted."""

    name = "fuse-attention"
    description = ("scaled dot-product attention (sdpa and eager exports, GQA, MLA, KV cache) -> Attention "
                   "(target onnx, opset >= 23); counted and kept decomposed otherwise")
    order = 520
    _hints = Hints(adds_bodies=False)
    needs_shapes = True

    def run(self, graph: Graph, ctx: PassContext) -> int:
        if not _fusable(ctx):
            return 0
        presents: Presents = []
        rules = attention_rules(lambda op, am: to_attention(op, am, presents))
        done = apply_rules(graph, ctx, rules, bodies=True)
        move_presents(graph, presents)
        return done

    def finish(self, graph: Graph, ctx: PassContext) -> None:
        """Count the attentions left decomposed (``attention_found``) and note why, once, on the final graph."""
        found: dict[int, Node] = {}
        declined: dict[str, list[str]] = {}
        seen: set[int] = set()

        def record(op: RewriteBuilder, am: AttentionMatch) -> None:
            seen.add(id(am.softmax))
            why = mask_refusal(am) if _fusable(ctx) else None
            if why is None:
                found.setdefault(id(am.softmax), am.softmax)
            else:
                declined.setdefault(why, []).append(site_name(am.softmax))

        def decline(softmax: Node, why: str) -> None:
            seen.add(id(softmax))
            declined.setdefault(why, []).append(site_name(softmax))

        apply_rules(graph, ctx, attention_rules(record, on_decline=decline), bodies=True)
        for softmax, scores, reader, local in attention_sites(graph):  # never silent: what the pattern missed
            if id(softmax) not in seen:
                declined.setdefault(why_unrecognised(scores, reader, local), []).append(site_name(softmax))
        ctx.notes[:] = [n for n in ctx.notes if not _NOTE.match(n)]  # the final graph's count only
        if not _fusable(ctx):
            note_left_decomposed(ctx, "attention_found", len(found), _NOTE, "attention(s)", ATTENTION_OPSET,
                                 lowered_by_target=True)
        for why, where in declined.items():
            names = ", ".join(f"'{w}'" for w in sorted(set(where))[:3])
            ctx.note(f"{len(set(where))} attention(s) declined: {why} (at {names})")


def _fusable(ctx: PassContext) -> bool:
    return ctx.target.fuses_to_standard_ops and ctx.emit_opset >= ATTENTION_OPSET
