"""lower-rotary-npu: a recognised rotary embedding becomes ``NPURotaryPositionEmbedding(x, cos, sin, mode=0)``
for ``--target cann``, where the plugin's contract is met exactly (a target lowering: runs after the verified
passes).

The contract (sources by short name in :mod:`k3opt.targets.cann.npu_contract`, facts in docs/cann.md): the
ATC plugin registers ``ai.onnx::11..18`` and ``npu::1`` and requires the INT attribute ``mode``
([RoPE-plugin]); mode 0 ("half") is ``x * cos + cat(-x2, x1) * sin`` with full-width 4-D cos/sin of x's
dtype (fp16, bf16, fp32), one shape for both, D even and < 896, B and N < 1000 ([RoPE-doc], [RoPE-IR]).

The recogniser (:func:`.._shared.rotary_match.rotary_rules`) has proved the rotation exact: x is (batch, heads,
positions, D), cos and sin are broadcast over the heads, with batch and position dims of 1 or provably x's.
Their values need no proof (``angles_proven=False``): the documented formula multiplies by the full-width cos
and sin as they are, so caches that are graph inputs (an opset-23 RotaryEmbedding's, written decomposed) lower
too. Every form becomes mode 0:

- rotate-half: ``NPURotaryPositionEmbedding(x, cos, sin)`` with cos/sin as multiplied;
- explicit halves (half-width angles): the same with ``Concat(cos, cos)``, ``Concat(sin, sin)``
  (``x1*c - x2*s`` is ``x1*c + (-x2)*s`` exactly), or the full-width angles a half-width cache was sliced from
  when their halves are proven equal (:func:`.._shared.rotary_match.whole_of_half`);
- DeepSeek's even/odd halves: the same of ``Concat(x[..., 0::2], x[..., 1::2])`` (the result is in the
  half-split layout, as the graph's);
- GPT-J's interleaved form (``rotate_every_two``): mode 1 ("interleave"), whose documented rotation
  ``r[..., 2i] = -x[..., 2i+1]``, ``r[..., 2i+1] = x[..., 2i]`` is exactly ``rotate_every_two``, with cos/sin
  as multiplied; mode 1 takes only 11SD angles for a BNSD x ([RoPE-doc]), so angles with x's batch (> 1 or
  not known to be 1) are kept decomposed (never expanded);
- cos/sin of rank < 4 get their leading 1s; a batch dim of 1 against x's batch is expanded to it, making the
  layout B1SD: the tiling refuses a BNSD x with 11SD angles when ``B * N > 8 * S`` ([RoPE-tiling],
  ``CheckBnsdBlockSkip``), so that path is never taken.

Kept decomposed (the report says why): a positions dim of cos/sin that is broadcast against x's (not a
documented layout), D >= 896, or a static batch or head count >= 1000. The plugin does not know the SoC:
Atlas inference (310P), 200I/500 A2 (310B) and training (910) products have no kernel in [RoPE-doc]'s table,
ATC reports that.
"""
from __future__ import annotations

import functools
from typing import Optional

import numpy as np

from ..npu_contract import ROPE_HALF, ROPE_INTERLEAVE, ROPE_MAX_HEAD_DIM
from ..target_form import STAGING_DOMAIN
from ....graph.ir import Graph, Tensor
from ....patterns import RewriteBuilder, apply_rules
from ....pipeline.pass_base import PassContext
from ....passes._shared.rotary_match import RotaryMatch, rotary_rules, whole_of_half
from ._npu_lowering import NPULowering

#: [RoPE-doc] half mode: "B，N < 1000".
MAX_BATCH_HEADS = 999


def refusal(rm: RotaryMatch) -> Optional[str]:
    """Why an (already exact) rotation cannot become NPURotaryPositionEmbedding, or None when it can."""
    if rm.head_dim > ROPE_MAX_HEAD_DIM:
        return f"head dim {rm.head_dim} is not < 896"
    dims = rm.match.dims
    for axis, what in ((0, "batch"), (1, "heads")):
        dim = dims.at(rm.x, axis)
        if isinstance(dim, int) and dim > MAX_BATCH_HEADS:
            return f"{what} {dim} is not < 1000"
    if not rm.same_positions:
        return "cos/sin are broadcast over x's positions (no documented layout)"
    if rm.interleaved and rm.same_batch and dims.at(rm.x, 0) != 1:
        return "cos/sin have x's batch: mode 1 (interleave) takes only 11SD cos/sin"
    return None


def _angles(op: RewriteBuilder, rm: RotaryMatch, t: Tensor, batch: Optional[Tensor]) -> Tensor:
    """``t`` as the plugin's full-width 4-D cos/sin: leading 1s added, halves doubled (or the full-width angles
    they were sliced from taken again), expanded to ``batch``."""
    rank, doubled = len(t.shape), not rm.full_width
    whole = whole_of_half(t, rm.head_dim) if doubled else None
    if whole is not None:  # of t's rank again
        t, doubled = whole[0], False
        for node in whole[1]:
            t = op.Unsqueeze(t, *node.inputs[1:], **node.attrs)
    if rank < 4:
        t = op.Unsqueeze(t, op.const(list(range(4 - rank)), np.int64))
    if doubled:
        t = op.Concat(t, t, axis=-1)
    return t if batch is None else op.Expand(t, batch)


class LowerRotaryNPU(NPULowering):
    """Rotary embedding -> NPURotaryPositionEmbedding mode 0 (mode 1 for GPT-J's interleaved form; target cann)
    where the plugin's contract is met."""

    name = "lower-rotary-npu"
    description = "rotary embedding -> NPURotaryPositionEmbedding mode 0 (rotate-half) where exact (target cann)"
    order = 2020
    npu_op, what = "NPURotaryPositionEmbedding", "rotary embedding"
    # kept: by root node; the op's formula takes any full-width cos/sin (no proof that they are one rotation's)
    recogniser = staticmethod(functools.partial(rotary_rules, name="lower-rotary", angles_proven=False))
    #: Models without RoPE (BERT, ViT, the hand-made attentions) keep the lowering lines they had.
    note_none = False

    def __init__(self) -> None:
        super().__init__()
        self.modes: set[int] = set()

    @property
    def remark(self) -> str:  # type: ignore[override]
        """The count line's remark: the modes emitted (``(mode 0)`` when none was)."""
        return "(mode " + " and ".join(map(str, sorted(self.modes or {ROPE_HALF}))) + ")"

    def run(self, graph: Graph, ctx: PassContext) -> int:
        return apply_rules(graph, ctx, self.rules)

    def _rewrite(self, op: RewriteBuilder, rm: RotaryMatch) -> Optional[Tensor]:
        """``NPURotaryPositionEmbedding(x, cos, sin, mode=0 or 1)``, or None: stays decomposed, reason kept."""
        where = rm.root.name
        why = refusal(rm)
        if why is not None:
            self.kept.setdefault(where, f"rotary embedding at '{where}' kept decomposed: {why}")
            return None
        x = op.Concat(rm.lo, rm.hi, axis=-1) if rm.pairs else rm.x
        mode = ROPE_INTERLEAVE if rm.interleaved else ROPE_HALF
        batch = None
        # cos/sin batch 1 against x's: B1SD, never the 11SD path the tiling may refuse (mode 1 takes only 11SD)
        if not rm.same_batch and not rm.interleaved:
            batch = op.Concat(op.Shape(rm.x, start=0, end=1), op.const([1, 1, 1], np.int64), axis=0)
        y = op.NPURotaryPositionEmbedding(x, _angles(op, rm, rm.cos, batch), _angles(op, rm, rm.sin, batch),
                                          mode=mode, _name="NPURotaryPositionEmbedding", _domain=STAGING_DOMAIN)
        self.modes.add(mode)
        self.lowered.append(f"rotary embedding at '{where}' -> NPURotaryPositionEmbedding (mode {mode})")
        return y
