"""The attention recogniser shared by fuse-attention (ONNX ``Attention``) and the CANN lowering.

Scaled dot-product attention as the exporters emit it, anchored at the
``MatMul(probs, v)`` whose probabilities come from a ``Softmax``:

- probabilities: ``Softmax(x)``, or torch sdpa's ``Where(IsNaN(Softmax(x)), 0, Softmax(x))`` (a fully
  masked row gives zeros, not NaN); a ``Dropout`` there is refused;
- ``x``: the scores plus at most one additive mask (``Add``), the scores ``MatMul(q', k')`` times
  constant scalars after it (``Mul``/``Div``, eager's ``/ sqrt(d)``);
- ``q'``: ``q`` times constant scalars (sdpa's ``d^-1/4``); ``k'``: the keys transposed, times constant
  scalars before or after the transpose: ``Transpose(X, p)`` for any rank-4 perm that makes k^T
  (``[0,1,3,2]`` of BNSD keys, ``[0,2,3,1]`` of BSND keys with the head split fused in, dynamo's
  ``[3,1,0,2]``; the match's k is then ``Transpose(X, [0,2,1,3])`` etc.), or dynamo's 3-D form
  ``Reshape(Transpose(Reshape(k, [-1, S, D]), [0,2,1]), [B, N, D, S])`` with the shapes proven to
  be ``k``'s own;
- GQA's repeat_kv on k and v, ``Reshape(Expand(Unsqueeze(k, 2), [B, Nkv, rep, S, D]), [B, Nkv*rep, S, D])``,
  is absorbed (the match gives k and v before it, and ``kv_num_heads``);
- decode: keys ``Concat(past, new)`` on the sequence axis are described (the Concat output is ``k``).

A match is described by an :class:`AttentionMatch`; :func:`analyze` declines (``m.fail``) unless
the softmax is over the last axis of rank-4 scores, every scale factor is a positive finite
constant scalar (their product is ``scale``), no intermediate from the scores to the probabilities
is read elsewhere or is a graph output, there is no Dropout, q/k/v/output share one float dtype,
the head dims are static, GQA's repeat provably merges just the heads (the head counts are given
when static), and the mask does not raise the scores' rank nor broadcast a static dim of them.
What a fused op does with a query row whose keys are all masked is the
lowering's concern (``zero_fully_masked`` and ``keep``/``mask_fill`` say what the graph does).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import ml_dtypes
import numpy as np
from ... import graph as gs
from onnx import TensorProto

from ...graph import dtypes, ir
from ...graph.ir import Graph, Node, Tensor, is_graph_output, producer
from ...graph.symbolic.dims import Dims
from ...patterns import Match, PatternBuilder, RewriteBuilder, Rule, checks
from ...patterns.matcher import describe
from ...patterns.schema import attr_value
from .._shared.shape_refs import is_dim_of, ref_size, same_size, shape_refs, small_const, small_ints

#: Element types the attention's q/k/v/output may have (the fused ops' float types).
FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
#: A mask fill at or below this fraction of the dtype's lowest value is "masked out" (transformers fills
#: -inf or the lowest value; every score plus such a fill rounds to it or gives exp() == 0).
MASKED_FRACTION = 0.5


@dataclasses.dataclass
class AttentionMask:
    """The scores' additive mask and what is known of its form: what a fused op may take for it, and what the
    graph does with a query row whose keys are all masked."""

    #: The mask added to the scores; None: the scores are not masked (the other fields keep their defaults).
    tensor: Optional[Tensor] = None
    #: The ``keep`` of a ``Where(keep, 0, fill)`` mask (or a constant's), set when its fill masks out
    #: (:func:`masks_out`).
    keep: Optional[Tensor] = None
    #: The fill of such a mask (or of a constant mask of 0s and one value): -inf or a negative number; None for a
    #: mask of unknown form.
    fill: Optional[float] = None
    #: The mask is exactly the causal one (``keep`` a constant lower triangle).
    causal_only: bool = False
    #: The mask is a constant keeping a key in every query row (a sliding-window band, say): no row is fully
    #: masked, so what the graph and a fused op do with such a row does not matter (as for ``causal_only``).
    rows_open: bool = False
    #: The probabilities are guarded (torch sdpa's ``Where(IsNaN(p), 0, p)``): a fully masked row gives zeros.
    zero_fully_masked: bool = False


@dataclasses.dataclass
class KVCache:
    """A decode step's cache: the keys and the values are ``Concat(past, new)`` on the sequence axis (the
    Concats' outputs, ``present_*``, are the attention's k and v)."""

    past_key: Tensor
    past_value: Tensor
    new_key: Tensor
    new_value: Tensor
    present_key: Tensor
    present_value: Tensor


@dataclasses.dataclass
class AttentionMatch:
    """One matched attention, BNSD layouts (batch, heads, sequence, head dim); see the interface doc. The core is
    here; ``mask`` and ``cache`` are its parts."""

    q: Tensor
    k: Tensor
    v: Tensor
    q_num_heads: Optional[int]     # None when not static (a 4-D fused op reads it from the shapes)
    kv_num_heads: Optional[int]
    head_dim_qk: int
    head_dim_v: int
    scale: float
    output: Tensor
    softmax: Node
    dtype: int
    match: Match
    mask: AttentionMask
    #: Set for a decode step whose keys and values concatenate the cache (:class:`KVCache`), else None.
    cache: Optional[KVCache]


# -- pattern -------------------------------------------------------------------------------------------------

def _pattern(op: PatternBuilder, x: object, v: object) -> object:
    sm = op.Softmax(x, _name="softmax")
    guarded = op.Or(op.Where(op.IsNaN(sm, _name="isnan"), 0.0, sm, _name="guard"), sm)
    probs = op.Or(dropout=op.Dropout(guarded, _name="dropout", _allow_other_inputs=True), plain=guarded,
                  _name="probs")
    return op.MatMul(probs, v, _name="pv")


def attention_rules(rewrite: Callable[[RewriteBuilder, AttentionMatch], Optional[Tensor]], name: str = "attention",
                    on_decline: Optional[Callable[[Node, str], None]] = None) -> list[Rule]:
    """The attention rule, rebuilt by ``rewrite(op, am)`` (the replacement of ``am.output``, or None).

    ``on_decline(softmax, reason)`` hears every refusal: the recogniser's, and a rewrite's that calls
    ``am.match.fail(reason)`` before returning None (one returning None without a reason, a recorder
    say, is not a refusal). Apply with :func:`k3opt.patterns.apply_rules` (``bodies=True``).
    """

    def check(m: Match) -> bool:
        m.memo["attention"] = analyze(m)
        if m.memo["attention"] is None and on_decline is not None:
            on_decline(m.node("softmax"), m.failure or "not recognised")
        return m.memo["attention"] is not None

    def apply(op: RewriteBuilder, m: Match) -> Optional[Tensor]:
        am = m.memo["attention"] if "attention" in m.memo else analyze(m)
        if am is None:
            return None
        am = _materialized(op, am)
        out = rewrite(op, am)
        if out is None and m.failure and on_decline is not None:
            on_decline(am.softmax, m.failure)
        return out

    return [Rule(name, _pattern, apply, check, allow_escaping=True,
                 description="scaled dot-product attention (MatMul, scale, mask, Softmax, MatMul)")]


# -- analysis ------------------------------------------------------------------------------------------------

SCORES = "the scores"
#: Why TorchScript's float16 export of torch's CPU sdpa stays decomposed (see docs/passes/fuse-attention.md).
MIXED_PRECISION = ("the scores are Cast before the softmax (mixed precision: float16 q @ k^T, the softmax and "
                   "probs @ v in float32); Attention-23 rounds the probabilities to q's type before probs @ v, "
                   "even with softmax_precision")


class _Decline(Exception):
    """Why a match cannot be fused (raised inside :func:`analyze`, turned into ``m.fail``)."""


def analyze(m: Match) -> Optional[AttentionMatch]:
    """The :class:`AttentionMatch` of a structural match, or None with ``m.fail(reason)``."""
    try:
        # Dims traced once per match; the symbols the graph declares (batch, sequence) are not traced, and
        # unknown ones are named (a head split's -1 of a flattened batch cancels against the batch it reads):
        # the names hold while the graph holds its tensors, so the Dims is the match's alone.
        return _analyze(m, Dims(m.graph, name_unknown=True))
    except _Decline as why:
        m.fail(str(why))
        return None


def _analyze(m: Match, dims: Dims) -> AttentionMatch:
    sm, pv = m.node("softmax"), m.node("pv")
    if m.which("probs") == "dropout":
        raise _Decline("a Dropout acts on the attention probabilities (training mode)")
    x = sm.inputs[0]
    if checks.rank(x) != 4:
        raise _Decline(f"the scores have rank {checks.rank(x)}, not 4 (batch, heads, queries, keys)")
    axis = attr_value(sm.attrs, "Softmax", "", m.ctx.opset if m.ctx is not None else 23, "axis")
    if axis not in (-1, 3):  # (below opset 13 the default is 1: a softmax over the flattened heads and rows)
        raise _Decline(f"the Softmax is over axis {axis}, not the last (keys) axis")
    matched = {id(n) for n in m.nodes}
    chain: list[Node] = [n for n in m.nodes if n is not pv]  # scores .. probabilities: must not escape
    mask, scores = _split_mask(x, chain)
    scale, t = _peel_scale(scores, chain, SCORES)
    qk = producer(t)
    if qk is not None and qk.op in ("Mul", "Div"):
        raise _Decline(f"the scores are scaled by a non-constant ({qk.op} '{qk.name}')")
    if qk is not None and qk.op == "Cast" and _reaches_matmul(qk.inputs[0]):
        raise _Decline(MIXED_PRECISION)
    if qk is None or qk.op != "MatMul":
        raise _Decline("the scores are not a MatMul(q, k^T)")
    chain.append(qk)
    walked: list[Node] = []
    q_scale, q = _peel_scale(qk.inputs[0], walked, "q")
    kv = _keys_and_values(dims, qk.inputs[1], pv.inputs[1], walked)
    scale *= q_scale * kv.scale
    if not (math.isfinite(scale) and scale > 0):
        raise _Decline(f"the total scale {scale:g} is not a positive finite number")
    _no_escape(m.graph, chain, pv)
    dtype = _dtype_of(q, kv.k, kv.v, pv.outputs[0], scores)
    if checks.rank(q) != 4:
        raise _Decline("q is not rank 4")
    q_heads, dqk = _heads(dims, q, scores), _static(dims, q, 3, "q's head dim")
    kv_heads = kv.heads(q_heads)
    if isinstance(kv.k_dims[3], int) and kv.k_dims[3] != dqk:
        raise _Decline(f"q's head dim {dqk} differs from k's {kv.k_dims[3]}")
    guarded = m.get_node("guard") is not None
    if mask is not None:
        _check_mask(mask, scores, dtype)
        form = _mask_form(dims, mask, q, kv.k_dims, dtype)
        form.zero_fully_masked = guarded
    else:
        form = AttentionMask(zero_fully_masked=guarded)
    cache = _decode_parts(kv.k if kv.perm == IDENTITY else None, kv.v)
    outer = next((n for n in walked + chain if not m.owns(n)), None)
    if outer is not None:  # the commit would detach it in its own graph, and move its work into this body
        raise _Decline(f"{describe(outer)} belongs to an enclosing graph: a fusion does not move the enclosing "
                       "graph's work into an If/Loop/Scan body")
    m.nodes.extend(n for n in walked + chain if id(n) not in matched)  # detached by the commit once dead
    m.memo["k_perm"] = kv.perm
    return AttentionMatch(q=q, k=kv.k, v=kv.v, q_num_heads=q_heads, kv_num_heads=kv_heads, head_dim_qk=dqk,
                          head_dim_v=_static(dims, kv.v, 3, "v's head dim"), scale=scale, output=pv.outputs[0],
                          softmax=sm, dtype=dtype, match=m, mask=form, cache=cache)


@dataclasses.dataclass
class _KeysValues:
    """The keys under ``k^T`` and the values, before repeat_kv: ``Transpose(k, perm)`` is BNSD; the match's dims."""

    dims: Dims
    k: Tensor
    perm: tuple[int, ...]
    scale: float  # the factors applied to the keys
    k_repeat: Optional[_Repeat]
    v: Tensor
    v_repeat: Optional[_Repeat]

    @property
    def k_dims(self) -> "_PermutedDims":
        return _PermutedDims(self.dims, self.k, self.perm)

    def heads(self, q_heads: Optional[int]) -> Optional[int]:
        """The kv head count (None when not static), checked against q's and between k and v."""
        k_heads = _kv_heads(self.dims, self.k, self.k_repeat, q_heads, "k") if self.perm == IDENTITY else \
            (self.k_dims[1] if isinstance(self.k_dims[1], int) else None)
        v_heads = _kv_heads(self.dims, self.v, self.v_repeat, q_heads, "v")
        reps = [None if r is None else r.rep for r in (self.k_repeat, self.v_repeat)]
        if (k_heads is not None and v_heads is not None and k_heads != v_heads) or reps[0] != reps[1]:
            raise _Decline(f"k and v have different head counts or repeats ({k_heads}, {v_heads})")
        return k_heads if k_heads is not None else v_heads


def _keys_and_values(dims: Dims, kt: Tensor, v_repeated: Tensor, walked: list[Node]) -> _KeysValues:
    """The keys (from the scores MatMul's second operand) and values, scale factors and repeat_kv stripped."""
    kt_scale, kt = _peel_scale(kt, walked, "k")
    k_repeated, perm, k_scale = _untransposed_key(dims, kt, walked)
    if checks.rank(k_repeated) == 5:  # GQA's repeat, its Reshape merged into dynamo's batched transpose
        k_repeat = _expanded(dims, k_repeated)
        k = k_repeat.x
        walked.extend(k_repeat.nodes)
    else:
        k, k_repeat = _repeat_kv(dims, k_repeated, walked) if perm == IDENTITY else (k_repeated, None)
    v, v_repeat = _repeat_kv(dims, v_repeated, walked)
    if checks.rank(k) != 4 or checks.rank(v) != 4:
        raise _Decline("k and v are not both rank 4")
    return _KeysValues(dims=dims, k=k, perm=perm, scale=kt_scale * k_scale, k_repeat=k_repeat, v=v, v_repeat=v_repeat)


def _split_mask(x: Tensor, chain: list[Node]) -> tuple[Optional[Tensor], Tensor]:
    """``x = scores + mask`` (one Add, either operand order) -> (mask, scores); (None, x) without an Add."""
    n = producer(x)
    if n is None or n.op != "Add" or len(n.inputs) != 2:
        return None, x
    a, b = n.inputs
    if _reaches_matmul(a) and _reaches_matmul(b):
        raise _Decline("both operands of the Add under the Softmax are matrix products")
    if not (_reaches_matmul(a) or _reaches_matmul(b)):
        if any(producer(i) is not None and producer(i).op == "Add" for i in (a, b)):
            raise _Decline("several masks are added to the scores")
        return None, x
    chain.append(n)
    return (b, a) if _reaches_matmul(a) else (a, b)


def _peeled(t: Tensor) -> Tensor:
    """``t`` under the Mul/Divs and Casts on top of it (through the non-constant operand, else the first): where
    the scores' MatMul is, if ``t`` is the scores (a non-constant factor or a Cast is refused later, by name)."""
    while True:
        n = producer(t)
        if n is not None and n.op == "Cast":
            t = n.inputs[0]
            continue
        if n is None or n.op not in ("Mul", "Div") or len(n.inputs) != 2:
            return t
        t = n.inputs[1] if n.op == "Mul" and ir.is_const(n.inputs[0]) else n.inputs[0]


def _reaches_matmul(t: Tensor) -> bool:
    n = producer(_peeled(t))
    return n is not None and n.op == "MatMul"


def _peel_scale(t: Tensor, walked: list[Node], what: str) -> tuple[float, Tensor]:
    """Strip Mul/Div by constant scalars from ``t``: (the product of the factors, the tensor under them).

    On the scores, a Mul/Div by a constant of more than one element is refused (it is not a scale the
    fused op applies); on q or k it ends the walk.
    """
    scale = 1.0
    while True:
        n = producer(t)
        if n is None or n.op not in ("Mul", "Div") or len(n.inputs) != 2:
            return scale, t
        const_at = 1 if ir.is_const(n.inputs[1]) else (0 if n.op == "Mul" and ir.is_const(n.inputs[0])
                                                            else None)
        if const_at is None:
            return scale, t
        if not _scalar_const(n.inputs[const_at]):
            if what != SCORES:  # part of how q or k is computed (a constant rotary table, say)
                return scale, t
            raise _Decline(f"{what} are multiplied or divided by a constant that is not a float scalar "
                           f"(shape {ir.const_tensor(n.inputs[const_at]).shape}): not a scale of q @ k^T")
        c = float(small_const(n.inputs[const_at]).reshape(-1)[0])
        if not math.isfinite(c) or c == 0.0:
            raise _Decline(f"a scale factor of {what} is {c:g}")
        scale = scale / c if n.op == "Div" else scale * c
        walked.append(n)
        t = n.inputs[1 - const_at]


def _scalar_const(t: Tensor) -> bool:
    """A float constant of one element and rank <= 4 (it cannot raise the rank of a BNSD operand)."""
    c = ir.const_tensor(t)
    if c is None or len(c.shape) > 4 or math.prod(c.shape) != 1:
        return False
    return small_const(t).dtype.kind == "f"


def _untransposed_key(dims: Dims, kt: Tensor, walked: list[Node]) -> tuple[Tensor, tuple[int, ...], float]:
    """The keys under ``k^T``: (a tensor X, the perm taking X to BNSD keys, the scale factors applied to X).

    ``k^T = Transpose(X, p)`` gives the keys as ``Transpose(X, p with its last two entries swapped)``:
    X itself for p = [0,1,3,2], a head split fused in for TorchScript's [0,2,3,1], dynamo's [3,1,0,2] of
    an in-place update; or dynamo's 3-D batched transpose of BNSD keys.
    """
    n = producer(kt)
    if n is not None and n.op == "Transpose":
        perm = [int(p) for p in n.attrs.get("perm", ())]
        if sorted(perm) != [0, 1, 2, 3]:
            raise _Decline(f"the keys are transposed with perm {perm}, not a rank-4 k^T")
        walked.append(n)
        scale, k = _peel_scale(n.inputs[0], walked, "k")
        return k, (perm[0], perm[1], perm[3], perm[2]), scale
    if n is not None and n.op == "Reshape":
        k = _batched_transpose(dims, n, walked)
        if k is not None:
            scale, k = _peel_scale(k, walked, "k")
            return k, IDENTITY, scale
    raise _Decline("the second operand of the scores MatMul is not a transposed key")


IDENTITY = (0, 1, 2, 3)


def _batched_transpose(dims: Dims, outer: Node, walked: list[Node]) -> Optional[Tensor]:
    """dynamo's ``Reshape(Transpose(Reshape(k, [-1, S, D]), [0, 2, 1]), [B, N, D, S])`` -> ``k`` (BNSD), when the
    Reshape targets are provably ``k``'s own dims; else None. ``k`` may be GQA's rank-5 repeat (its
    Reshape to BNSD merged into the flattening one): it is returned as it is."""
    t = producer(outer.inputs[0])
    if t is None or t.op != "Transpose" or [int(p) for p in t.attrs.get("perm", ())] != [0, 2, 1]:
        return None
    inner = producer(t.inputs[0])
    if inner is None or inner.op != "Reshape" or len(inner.inputs) != 2 \
            or inner.attrs.get("allowzero", 0) or outer.attrs.get("allowzero", 0):
        return None
    k = inner.inputs[0]
    flat, back = shape_refs(inner.inputs[1]), shape_refs(outer.inputs[1])
    if flat is None or back is None or len(flat) != 3 or len(back) != 4:
        return None
    if checks.rank(k) == 4:
        is_dim = lambda ref, j: is_dim_of(dims, ref, k, j)  # noqa: E731
        axes = (0, 2, 3)  # batch, sequence, head dim
        merged = flat[0] == -1 or _merged(dims, flat[0], k)
    else:
        ex = _expanded(dims, k) if checks.rank(k) == 5 else None
        if ex is None:
            return None
        is_dim, axes, merged = ex.is_dim, (0, 3, 4), flat[0] == -1
    b, s, d = axes
    # Row-major: (B, N, S, D) -> (B*N, S, D) -> (B*N, D, S) -> (B, N, D, S) is k^T when S, D and B are k's.
    # The batch may be inferred (-1, e.g. once copy-reshape-dims made the target constant) when the heads are
    # k's: the other three dims then leave exactly B for it.
    batch = is_dim(back[0], b) or (back[0] == -1 and _key_heads(dims, back[1], k))
    if not (merged and is_dim(flat[1], s) and is_dim(flat[2], d) and batch and is_dim(back[2], d)
            and is_dim(back[3], s)):
        return None
    walked.extend([outer, t, inner])
    return k


def _key_heads(dims: Dims, ref: object, k: Tensor) -> bool:
    """``ref`` is the head count of ``k``: its dim 1 (BNSD), or the static product of dims 1 and 2 of GQA's
    rank-5 repeat ``(B, Nkv, rep, S, D)``."""
    if checks.rank(k) == 4:
        return is_dim_of(dims, ref, k, 1)
    kv, rep = dims.at(k, 1), dims.at(k, 2)
    return isinstance(ref, int) and isinstance(kv, int) and isinstance(rep, int) and ref == kv * rep


def _merged(dims: Dims, ref: object, k: Tensor) -> bool:
    """``ref`` is the static product of ``k``'s dims 0 and 1 (the batch and heads merged)."""
    b, n = dims.at(k, 0), dims.at(k, 1)
    return isinstance(ref, int) and isinstance(b, int) and isinstance(n, int) and ref == b * n


@dataclasses.dataclass
class _Repeat:
    """GQA's ``Expand(Unsqueeze(x, 2), [B, H, rep, S, D])`` (rank 5), ``rep`` a constant.

    The target's other elements need no proof: where one broadcasts a dim of x (1 in x), the repeated
    copies are equal, so the head a query reads is the same; for the batch, sequence and head dims a
    fused op checks q/k/v/mask shapes at run time.
    """

    x: Tensor
    target: list
    nodes: list[Node]
    dims: Dims

    @property
    def rep(self) -> int:
        return self.target[2]

    def is_dim(self, ref: object, j: int) -> bool:
        """``ref`` is provably dim ``j`` of the expanded tensor: the target's element where that is not 1,
        else x's dim."""
        if self.target[j] != 1:
            return same_size(self.dims, ref, self.target[j])
        return is_dim_of(self.dims, ref, self.x, (0, 1, None, 2, 3)[j])

    def heads(self) -> Optional[int]:
        """The heads after the repeat (H * rep), when static."""
        h = self.target[1] if self.target[1] != 1 else self.dims.at(self.x, 1)
        h = ref_size(self.dims, h)
        return h * self.rep if isinstance(h, int) and h > 0 else None


def _expanded(dims: Dims, t: Tensor) -> Optional[_Repeat]:
    """The :class:`_Repeat` computing ``t``, else None."""
    e = producer(t)
    u = producer(e.inputs[0]) if e is not None and e.op == "Expand" and len(e.inputs) == 2 else None
    if u is None or u.op != "Unsqueeze":
        return None
    axes = u.attrs.get("axes") if "axes" in u.attrs else (small_ints(u.inputs[1]) if len(u.inputs) > 1 else None)
    x = u.inputs[0]
    if axes is None or [int(a) for a in axes] not in ([2], [-3]) or checks.rank(x) != 4:
        return None
    target = shape_refs(e.inputs[1])
    if target is None or len(target) != 5 or not isinstance(target[2], int) or target[2] <= 0:
        raise _Decline("GQA's Expand of the keys/values has no readable target with a constant repeat count")
    return _Repeat(x=x, target=target, nodes=[e, u], dims=dims)


def _repeat_kv(dims: Dims, t: Tensor, walked: list[Node]) -> tuple[Tensor, Optional[_Repeat]]:
    """``Reshape(Expand(Unsqueeze(x, 2), [B, H, rep, S, D]), [B, H*rep, S, D])`` -> (x, its repeat); else (t, None).

    The Reshape must keep dims 0, 2 and 3 (so, row-major, it merges exactly the heads and the repeat axes).
    """
    r = producer(t)
    ex = _expanded(dims, r.inputs[0]) if r is not None and r.op == "Reshape" and len(r.inputs) == 2 else None
    if ex is None:
        return t, None
    out = shape_refs(r.inputs[1])
    copy = not r.attrs.get("allowzero", 0)
    if out is None or len(out) != 4 or not ((copy and out[0] == 0) or ex.is_dim(out[0], 0)) \
            or not ex.is_dim(out[2], 3) or not ex.is_dim(out[3], 4):
        raise _Decline("GQA's Reshape of the repeated keys/values does not provably merge just the heads axes")
    walked.extend([r, *ex.nodes])
    return ex.x, ex


class _PermutedDims:
    """The dims of ``Transpose(x, perm)``, each traced when first asked for."""

    def __init__(self, dims: Dims, x: Tensor, perm: tuple[int, ...]):
        self.dims, self.x, self.perm = dims, x, perm

    def __getitem__(self, i: int) -> object:
        return self.dims.at(self.x, self.perm[i])


def _static(dims: Dims, t: Tensor, axis: int, what: str) -> int:
    d = dims.at(t, axis)
    if not isinstance(d, int) or d <= 0:
        raise _Decline(f"{what} is not static")
    return d


def _heads(dims: Dims, t: Tensor, scores: Tensor) -> Optional[int]:
    """q's head count: its static dim 1, else the scores' (they have q's heads unless q broadcasts)."""
    for d in (dims.at(t, 1), dims.at(scores, 1)):
        if isinstance(d, int) and d > 0:
            return d
    return None


def _kv_heads(dims: Dims, x: Tensor, repeat: Optional[_Repeat], q_heads: Optional[int], what: str
              ) -> Optional[int]:
    """The head count of k or v (None when not static), checked against q's."""
    d = dims.at(x, 1)
    d = d if isinstance(d, int) and d > 0 else None
    if repeat is not None and repeat.rep > 1:
        if q_heads is None or repeat.heads() != q_heads:
            raise _Decline(f"GQA: q's head count is not provably the repeated {what}'s")
        if d is not None and d * repeat.rep != q_heads:
            raise _Decline(f"{what}'s {d} heads repeated {repeat.rep} times are not q's {q_heads}")
    if d is not None and q_heads is not None and q_heads % d:
        raise _Decline(f"q's {q_heads} heads are not a multiple of {what}'s {d}")
    return d


def _no_escape(graph: Graph, chain: list[Node], pv: Node) -> None:
    inside = {id(n) for n in chain} | {id(pv)}
    for n in chain:
        for out in n.outputs:
            if is_graph_output(graph, out):
                raise _Decline(f"'{out.name}' ({n.op}: attention scores or probabilities) is a graph output")
            other = next((c for c in out.outputs if id(c) not in inside), None)
            if other is not None:
                raise _Decline(f"'{out.name}' ({n.op}: attention scores or probabilities) is also read by "
                               f"'{other.name}' ({other.op})")


def _dtype_of(*tensors: Tensor) -> int:
    types = {dtypes.onnx_type(t.dtype) for t in tensors}
    if None in types:
        raise _Decline("a dtype of q, k, v or the scores is unknown")
    if len(types) != 1:
        raise _Decline("q, k, v and the scores do not share one dtype: "
                       + ", ".join(sorted(TensorProto.DataType.Name(d) for d in types)))
    dtype = types.pop()
    if dtype not in FLOAT_TYPES:
        raise _Decline(f"dtype {TensorProto.DataType.Name(dtype)} is not float16, bfloat16 or float32")
    return dtype


def _check_mask(mask: Tensor, scores: Tensor, dtype: int) -> None:
    """The mask has the scores' dtype, and no known dim of it broadcasts the scores to a larger shape
    (dims inference leaves unknown are checked by the fused op at run time against (B, Nq, Sq, Skv))."""
    if dtypes.onnx_type(mask.dtype) != dtype:
        raise _Decline("the mask's dtype is not the scores'")
    r = checks.rank(mask)
    if r is None or r > 4:
        raise _Decline(f"the mask's rank ({r}) is unknown or above the scores' 4 (it would broadcast them)")
    for i in range(r):  # the dims inference knows (tracing the others costs more than it proves)
        d = mask.shape[i]
        s = scores.shape[4 - r + i] if scores.shape is not None and len(scores.shape) == 4 else None
        if isinstance(d, int) and d != 1 and isinstance(s, int) and s != d:
            raise _Decline(f"the mask's dim {i} ({d}) broadcasts the scores' ({s})")


def masks_out(fill: float, dtype: int) -> bool:
    """A mask value that excludes a key: -inf, or at most half the dtype's lowest value."""
    return fill <= MASKED_FRACTION * float(ml_dtypes.finfo(dtypes.numpy_dtype(dtype)).min)


def _mask_form(dims: Dims, mask: Tensor, q: Tensor, k_dims: "_PermutedDims", dtype: int) -> AttentionMask:
    """The form of an additive mask ``Where(keep, 0, fill)`` or a constant of 0s and one negative fill: ``keep``
    only when the fill masks out (:func:`masks_out`); ``causal_only`` and ``rows_open`` need a constant keep
    (:func:`_causal`, :func:`_rows_open`)."""
    value = checks.const_value(mask) if ir.is_const(mask) and _size_of(mask) <= 1 << 22 else None
    if value is not None:
        fills = np.unique(value[value != 0])
        if len(fills) > 1 or (len(fills) == 1 and not fills[0] < 0):
            return AttentionMask(tensor=mask)
        keep_value = value == 0
        fill = float(fills[0]) if len(fills) else float("-inf")
        keep = gs.Constant(f"{mask.name}_keep", keep_value)
        return AttentionMask(tensor=mask, keep=keep if masks_out(fill, dtype) else None, fill=fill,
                             causal_only=_causal(dims, keep_value, q, k_dims), rows_open=_rows_open(keep_value))
    if _bounded_bias(mask, dtype):
        return AttentionMask(tensor=mask, rows_open=True)  # finite everywhere: no query row is ever fully masked
    n = producer(mask)
    if n is None or n.op != "Where" or len(n.inputs) != 3 or dtypes.onnx_type(n.inputs[0].dtype) != TensorProto.BOOL:
        return AttentionMask(tensor=mask)
    zero, fill = small_const(n.inputs[1]), small_const(n.inputs[2])
    if zero is None or fill is None or zero.size != 1 or fill.size != 1 or zero.ndim > 4 or fill.ndim > 4 \
            or float(zero.reshape(-1)[0]) != 0.0 or not float(fill.reshape(-1)[0]) < 0:
        return AttentionMask(tensor=mask)
    keep, f = n.inputs[0], float(fill.reshape(-1)[0])
    kv = checks.const_value(keep) if ir.is_const(keep) and _size_of(keep) <= 1 << 22 else None
    return AttentionMask(tensor=mask, keep=keep if masks_out(f, dtype) else None, fill=f,
                         causal_only=kv is not None and _causal(dims, kv, q, k_dims),
                         rows_open=kv is not None and _rows_open(kv))


#: Largest magnitude of each integer/bool element type (numpy name), for :func:`_bounded_bias`.
_INT_BOUNDS = {"bool": 1, "int8": 2 ** 7, "uint8": 2 ** 8, "int16": 2 ** 15, "uint16": 2 ** 16, "int32": 2 ** 31,
               "uint32": 2 ** 32, "int64": 2 ** 63, "uint64": 2 ** 64}


def _bounded_bias(mask: Tensor, dtype: int) -> bool:
    """``(k - m) * c`` or ``(m - k) * c`` (tf2onnx/Keras' ``(1 - m) * -10000``) of an integer or boolean ``m``
    cast late (through Reshape/Unsqueeze/Squeeze/Expand), ``k`` and ``c`` finite constant scalars: the bias is
    finite and at most half the dtype's largest value in magnitude, so no row is ever all -inf or lowest."""
    n = producer(mask)
    if n is None or n.op != "Mul" or len(n.inputs) != 2:
        return False
    scale = next((ir.const_scalar(x) for x in n.inputs if ir.is_const(x)), None)
    sub = next((producer(x) for x in n.inputs if not ir.is_const(x)), None)
    if scale is None or sub is None or sub.op != "Sub" or len(sub.inputs) != 2:
        return False
    k = next((ir.const_scalar(x) for x in sub.inputs if ir.is_const(x)), None)
    m = next((x for x in sub.inputs if not ir.is_const(x)), None)
    if k is None or m is None or not (math.isfinite(k) and math.isfinite(scale)):
        return False
    for _ in range(8):
        p = producer(m)
        if p is None or p.op not in ("Cast", "Reshape", "Unsqueeze", "Squeeze", "Expand") or not p.inputs:
            return False
        m = p.inputs[0]
        if p.op == "Cast":
            break
    else:
        return False
    bound = _INT_BOUNDS.get(np.dtype(m.dtype).name if m.dtype is not None else "")
    largest = float(ml_dtypes.finfo(dtypes.numpy_dtype(dtype)).max)
    return bound is not None and abs(scale) * (abs(k) + bound) <= largest / 2


def _rows_open(keep: np.ndarray) -> bool:
    """Every query row of a constant keep mask keeps a key (broadcasting copies rows, so the constant's own
    rows are all there are)."""
    return keep.ndim >= 1 and keep.size > 0 and bool(keep.reshape(-1, keep.shape[-1]).any(axis=1).all())


def _size_of(t: Tensor) -> int:
    c = ir.const_tensor(t)
    return math.prod(c.shape) if c is not None else 0


def _causal(dims: Dims, keep: np.ndarray, q: Tensor, k_dims: "_PermutedDims") -> bool:
    """``keep`` is exactly the bottom-right aligned causal triangle of the (static) q and k lengths, in every
    leading slice, with at least as many keys as queries (so every query row keeps a key)."""
    sq, skv = dims.at(q, 2), k_dims[2]
    if keep.ndim < 2 or not isinstance(sq, int) or not isinstance(skv, int) or skv < sq \
            or keep.shape[-2:] != (sq, skv):
        return False
    tri = np.arange(skv)[None, :] <= np.arange(sq)[:, None] + (skv - sq)
    return bool((keep.reshape(-1, sq, skv) == tri).all())


def _decode_parts(k: Optional[Tensor], v: Tensor) -> Optional[KVCache]:
    """The cache when k and v are both ``Concat(past, new)`` on the sequence axis, else None."""
    parts = []
    for t in (k, v):
        n = producer(t) if t is not None else None
        if n is None or n.op != "Concat" or len(n.inputs) != 2 or int(n.attrs.get("axis", 0)) not in (2, -2):
            return None
        parts.append(n)
    (ck, cv) = parts
    return KVCache(past_key=ck.inputs[0], past_value=cv.inputs[0], new_key=ck.inputs[1], new_value=cv.inputs[1],
                   present_key=ck.outputs[0], present_value=cv.outputs[0])


def _materialized(op: RewriteBuilder, am: AttentionMatch) -> AttentionMatch:
    """``am`` with BNSD keys: keys found in another layout (a head split fused into the transpose) get a
    Transpose to BNSD."""
    perm = am.match.memo.get("k_perm", IDENTITY)
    return am if perm == IDENTITY else dataclasses.replace(am, k=op.Transpose(am.k, perm=list(perm)))
