"""fuse-rotary: the rotary position embedding of q and of k (recognised by :mod:`.._shared.rotary_match`)
becomes ``RotaryEmbedding`` (default domain; onnxruntime 1.32 runs it) for ``--target onnx`` at opset >= 23.

The fused op takes ``cos_cache``/``sin_cache`` of shape (batch, positions, D/2) without ``position_ids``,
which the schema allows: the angles computed in the graph (at run time from the positions, or folded) are
handed over as they are, so nothing depends on a bound of the position (an Expand to x's batch and
positions fills in what broadcasts). DeepSeek-V3's even/odd form is ``RotaryEmbedding(Concat(x1, x2))``
with ``interleaved=0``; GPT-J's interleaved form (``rotate_every_two``) is ``RotaryEmbedding(x, ...,
interleaved=1)`` with the even elements of its equal-paired angles as caches; GPT-NeoX's
``cat(rope(q[..., :r]), q[..., r:])`` becomes ``rotary_embedding_dim=r``
(rule ``rotary-partial``).

Below opset 23, or for another target, the rotations stay decomposed: the pass rewrites nothing and
counts them once on the final graph (``ctx.counters["rotary_found"]``, a report note). For ``--target
cann`` the lowering ``lower-rotary-npu`` makes them NPURotaryPositionEmbedding (mode 0) where exact.
"""
from __future__ import annotations

import re
from typing import Any, Optional

import numpy as np

from ...graph.ir import Graph, Node, Tensor, producer
from ...patterns import Match, PatternBuilder, RewriteBuilder, Rule, apply_rules, checks
from ...pipeline.analyses import Shapes
from ...pipeline.pass_base import Hints, Pass, PassContext
from .._shared.rotary_match import RotaryMatch, concat_axis, rotary_rules, slice_last, unsqueeze_axes
from ._left_decomposed import note_left_decomposed

#: First opset with RotaryEmbedding in the default domain.
ROTARY_EMBEDDING_OPSET = 23
_NOTE = re.compile(r"^\d+ rotary embeddings? found, left decomposed: ")

def to_rotary_embedding(op: RewriteBuilder, rm: RotaryMatch) -> Tensor:
    """``RotaryEmbedding(x, cos_cache, sin_cache)`` (opset 23) with caches of shape (batch, positions, D/2)."""
    x = op.Concat(rm.lo, rm.hi, axis=-1) if rm.pairs else rm.x
    size = None
    if not (rm.same_batch and rm.same_positions):
        shape = op.Shape(_same_leading_dims(rm.x))
        size = op.Concat(op.Gather(shape, op.const([0], np.int64)), op.Gather(shape, op.const([2], np.int64)),
                         op.const([1], np.int64), axis=0)
    return op.RotaryEmbedding(x, angle_cache(op, rm, rm.cos, size), angle_cache(op, rm, rm.sin, size),
                              interleaved=int(rm.interleaved))


def _same_leading_dims(x: Tensor) -> Tensor:
    """The tensor ``x`` is a last-axis Slice of, if it is one (the same batch, heads and positions), else ``x``:
    its Shape is read for the Expand, so a partial rotation's ``q[..., :r]`` is not kept alive by it."""
    node = producer(x)
    if node is not None and node.op == "Slice" and x.shape is not None and checks.last_dim(x) is not None \
            and node.inputs[0].shape is not None and len(node.inputs[0].shape) == 4 \
            and checks.last_dim(node.inputs[0]) is not None \
            and slice_last(node, checks.last_dim(node.inputs[0])) is not None:
        return node.inputs[0]
    return x


def angle_cache(op: RewriteBuilder, rm: RotaryMatch, t: Tensor, size: Optional[Tensor]) -> Tensor:
    """``t`` (as multiplied with x) as the op's (batch, positions, D/2) cache: heads dim dropped, first half of
    a full-width tensor (its even elements in the interleaved form), expanded to ``size`` (x's batch and
    positions) when given."""
    rank = len(t.shape)
    src = producer(t)
    if rank == 4 and src is not None and src.op == "Unsqueeze" and unsqueeze_axes(src, 4) == [1]:
        t3 = src.inputs[0]
    elif rank == 4:
        t3 = op.Squeeze(t, op.const([1], np.int64))
    elif rank == 3:
        t3 = t  # (1, positions, width): its first dim is the (broadcast) heads dim, here taken as a batch of 1
    else:
        t3 = op.Unsqueeze(t, op.const(list(range(3 - rank)), np.int64))
    if rm.interleaved:
        t3 = op.Slice(t3, op.const([0], np.int64), op.const([rm.head_dim], np.int64), op.const([-1], np.int64),
                      op.const([2], np.int64))
    elif rm.full_width:
        h = rm.head_dim // 2
        t3 = op.Slice(t3, op.const([0], np.int64), op.const([h], np.int64), op.const([-1], np.int64))
    return t3 if size is None else op.Expand(t3, size)


def _partial(op: PatternBuilder, q: Any, cos: Any, sin: Any) -> Any:
    """``Concat(RotaryEmbedding(q[..., :r]), q[..., r:])``: partial rotary (GPT-NeoX, Phi, StableLM), the first
    ``r`` dims rotated, once the rotation of ``q[..., :r]`` is fused."""
    head = op.Slice(q, _allow_other_inputs=True, _name="head")
    tail = op.Slice(q, _allow_other_inputs=True, _name="tail")
    return op.Concat(op.RotaryEmbedding(head, cos, sin, _allow_other_inputs=True, _name="rope"), tail, _name="root")


def _partial_check(m: Match) -> bool:
    """Exactly ``RotaryEmbedding(q, rotary_embedding_dim=r)``: the op rotates ``q[..., :r]`` and passes the rest."""
    q = m["q"]
    d = checks.last_dim(q)
    if q.shape is None or len(q.shape) != 4 or d is None:
        return m.fail("q is not 4-D with a static head dim")
    rope = m.node("rope")
    if rope.attrs.get("num_heads", 0) or rope.attrs.get("rotary_embedding_dim", 0):
        return m.fail("the rotation already has num_heads or rotary_embedding_dim")
    head, tail = slice_last(m.node("head"), d), slice_last(m.node("tail"), d)
    if head is None or tail is None or head[0] != 0 or head[2] != 1 or tail != (head[1], d, 1) \
            or not 0 < head[1] < d or head[1] % 2:
        return m.fail(f"the slices {head} and {tail} are not q[..., :r] and q[..., r:] for an even r")
    if concat_axis(m.node("root"), 4) != 3:
        return m.fail("the parts are not concatenated on the last axis")
    return True


def _partial_rewrite(op: RewriteBuilder, m: Match) -> Tensor:
    rope = m.node("rope")
    return op.RotaryEmbedding(m["q"], *rope.inputs[1:], interleaved=rope.attrs.get("interleaved", 0),
                              rotary_embedding_dim=slice_last(m.node("head"), checks.last_dim(m["q"]))[1])


PARTIAL = Rule("rotary-partial", _partial, _partial_rewrite, _partial_check,
               description="partial rotary: Concat(RotaryEmbedding(q[..., :r]), q[..., r:]) -> rotary_embedding_dim=r")
#: The pass's rules: the rotations, then the partial ones among the RotaryEmbeddings they made.
RULES = [*rotary_rules(to_rotary_embedding), PARTIAL]


def find_rotaries(graph: Graph, ctx: PassContext) -> list[Node]:
    """The root node of every rotary embedding recognised (and exact to fuse); changes nothing.

    The counting rules are built for the call (about a millisecond): what they find, and what their checks
    learn about each angle tensor while the graph stays as it is, is the call's."""
    found: dict[int, Node] = {}

    def record(op: RewriteBuilder, rm: RotaryMatch) -> None:
        found.setdefault(id(rm.root), rm.root)

    apply_rules(graph, ctx, rotary_rules(record, verdicts={}))
    return list(found.values())



class FuseRotary(Pass):
    """Rotary embeddings -> RotaryEmbedding for --target onnx at opset >= 23; otherwise counted and kept."""

    name = "fuse-rotary"
    description = ("rotary embeddings of q and k (rotate-half, explicit halves, DeepSeek's even/odd pairs, "
                   "GPT-J's interleaved form) -> "
                   "RotaryEmbedding (target onnx, opset >= 23); counted and kept decomposed otherwise")
    order = 515
    _hints = Hints(adds_bodies=False)
    needs_shapes = True
    preserves = frozenset({Shapes})

    def run(self, graph: Graph, ctx: PassContext) -> int:
        return apply_rules(graph, ctx, RULES) if _fusable(ctx) else 0

    def finish(self, graph: Graph, ctx: PassContext) -> None:
        """Where rotations stay decomposed, count them once, on the final graph (``rotary_found``, a note)."""
        if _fusable(ctx):
            return
        found = len(find_rotaries(graph, ctx))
        note_left_decomposed(ctx, "rotary_found", found, _NOTE, "rotary embedding" + ("s" if found > 1 else ""),
                             ROTARY_EMBEDDING_OPSET)


def _fusable(ctx: PassContext) -> bool:
    return ctx.target.fuses_to_standard_ops and ctx.emit_opset >= ROTARY_EMBEDDING_OPSET
