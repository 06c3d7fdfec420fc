"""The attention recogniser shared by fuse-attention (ONNX ``Attention``) and the CANN lowering.

Scaled dot-product attention as the exporters emit it, anchored at the
``MatMul(probs, v)`` whose probabilities come from a ``Softmax``:

- probabilities: ``Softmax(x)``, or torch sdpa's ``Where(IsNaN(Softmax(x)), 0, Softmax(x))`` (a fully
  masked row gives zeros, not NaN); a ``Dropout`` there is refused;
- ``x``: the scores plus at most one additive mask (``Add``), the scores ``MatMul(q', k')`` times
  constant scalars after it (``Mul``/``Div``, eager's ``/ sqrt(d)``);
- ``q'``: ``q`` times constant scalars (sdpa's ``d^-1/4``); ``k'``: the keys transposed, times constant
  scalars before or after the transpose: ``Transpose(k, [0,1,3,2])`` of BNSD keys,
  ``Transpose(k, [0,2,3,1])`` of BSND keys (the head split fused in), or dynamo's 3-D form
  ``Reshape(Transpose(Reshape(k, [-1, S, D]), [0,2,1]), [B, N, D, S])`` with the shapes proven to
  be ``k``'s own;
- GQA's repeat_kv on k and v, ``Reshape(Expand(Unsqueeze(k, 2), [B, Nkv, rep, S, D]), [B, Nkv*rep, S, D])``,
  is absorbed (the match gives k and v before it, and ``kv_num_heads``);
- decode: keys ``Concat(past, new)`` on the sequence axis are described (the Concat output is ``k``).

A match is described by an :class:`AttentionMatch`; :func:`analyze` declines (``m.fail``) unless
the softmax is over the last axis of rank-4 scores, every scale factor is a positive finite
constant scalar (their product is ``scale``), no intermediate from the scores to the probabilities
is read elsewhere or is a graph output, there is no Dropout, q/k/v/output share one float dtype,
the head counts and head dims are static and GQA's head count divides, and the mask does not
raise the scores' rank. What a fused op does with a query row whose keys are all masked is the
lowering's concern (``zero_fully_masked`` and ``keep``/``mask_fill`` say what the graph does).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Sequence

import numpy as np
import onnx_graphsurgeon as gs
from onnx import TensorProto, helper

from .. import ir
from ..ir import Graph, NameScope, Node, Tensor, is_graph_output, producer
from ..patterns import Match, PatternBuilder, RewriteBuilder, Rule, checks
from ..patterns.rule_pass import sweep
from . import fold_shapes
from .base import PassContext

#: Element types the attention's q/k/v/output may have (the fused ops' float types).
FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
#: A mask fill at or below this is "masked out" (transformers uses the dtype's lowest value or -inf).
MASKED_BELOW = -1e30


@dataclasses.dataclass
class AttentionMatch:
    """One matched attention, BNSD layouts (batch, heads, sequence, head dim); see the interface doc."""

    q: Tensor
    k: Tensor
    v: Tensor
    q_num_heads: Optional[int]     # None when not static (a 4-D fused op reads it from the shapes)
    kv_num_heads: Optional[int]
    head_dim_qk: int
    head_dim_v: int
    scale: float
    mask: Optional[Tensor]
    keep: Optional[Tensor]
    causal_only: bool
    zero_fully_masked: bool
    past_key: Optional[Tensor]
    past_value: Optional[Tensor]
    new_key: Optional[Tensor]
    new_value: Optional[Tensor]
    present_key: Optional[Tensor]
    present_value: Optional[Tensor]
    output: Tensor
    softmax: Node
    dtype: int
    match: Match
    #: The fill of a ``Where(keep, 0, fill)`` mask (or of a constant mask of 0s and one value): -inf or a
    #: negative number; None for a mask of unknown form. ``keep`` is set when it is -inf or <= MASKED_BELOW.
    mask_fill: Optional[float] = None


# -- pattern -------------------------------------------------------------------------------------------------

def _pattern(op: PatternBuilder, x: object, v: object) -> object:
    sm = op.Softmax(x, _name="softmax")
    guarded = op.Or(op.Where(op.IsNaN(sm, _name="isnan"), 0.0, sm, _name="guard"), sm)
    probs = op.Or(op.Dropout(guarded, _name="dropout", _allow_other_inputs=True), guarded, _name="probs")
    return op.MatMul(probs, v, _name="pv")


def attention_rules(rewrite: Callable[[RewriteBuilder, AttentionMatch], Optional[Tensor]], name: str = "attention",
                    on_decline: Optional[Callable[[Node, str], None]] = None) -> list[Rule]:
    """The attention rule, rebuilt by ``rewrite(op, am)`` (the replacement of ``am.output``, or None).

    ``on_decline(softmax, reason)`` hears every refusal, the recogniser's and the rewrite's (a rewrite
    declining calls ``am.match.fail(reason)`` first); apply with :func:`apply_attention`.
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
        if out is None and on_decline is not None:
            on_decline(am.softmax, m.failure or "declined by the lowering")
        return out

    return [Rule(name, _pattern, apply, check, allow_escaping=True,
                 description="scaled dot-product attention (MatMul, scale, mask, Softmax, MatMul)")]


def apply_attention(graph: Graph, ctx: PassContext, rules: Sequence[Rule]) -> int:
    """Apply ``rules`` (one sweep each, anchors from ``ctx``'s census); returns the rewrites."""
    if ctx.names is None:
        ctx.names = NameScope(graph)
    return sum(sweep(graph, ctx, [rule]) for rule in rules)


# -- analysis ------------------------------------------------------------------------------------------------

class _Decline(Exception):
    """Why a match cannot be fused (raised inside :func:`analyze`, turned into ``m.fail``)."""


def analyze(m: Match) -> Optional[AttentionMatch]:
    """The :class:`AttentionMatch` of a structural match, or None with ``m.fail(reason)``."""
    try:
        return _analyze(m)
    except _Decline as why:
        m.fail(str(why))
        return None


def _analyze(m: Match) -> AttentionMatch:
    sm, pv = m.node("softmax"), m.node("pv")
    if m.which("probs") == 0:
        raise _Decline("a Dropout acts on the attention probabilities (training mode)")
    x = sm.inputs[0]
    if checks.rank(x) != 4:
        raise _Decline(f"the scores have rank {checks.rank(x)}, not 4 (batch, heads, queries, keys)")
    axis = int(sm.attrs.get("axis", -1))
    if axis not in (-1, 3):
        raise _Decline(f"the Softmax is over axis {axis}, not the last (keys) axis")
    chain: list[Node] = [n for n in m.nodes if n is not pv]  # scores .. probabilities: must not escape
    mask, scores = _split_mask(x, chain)
    scale, t = _peel_scale(scores, chain, "the scores")
    qk = producer(t)
    if qk is not None and qk.op in ("Mul", "Div"):
        raise _Decline(f"the scores are scaled by a non-constant ({qk.op} '{qk.name}')")
    if qk is None or qk.op != "MatMul":
        raise _Decline("the scores are not a MatMul(q, k^T)")
    chain.append(qk)
    walked: list[Node] = []
    q_scale, q = _peel_scale(qk.inputs[0], walked, "q")
    kt_scale, kt = _peel_scale(qk.inputs[1], walked, "k")
    k4, k_perm, k_scale = _untransposed_key(kt, walked)
    scale *= q_scale * kt_scale * k_scale
    if not (math.isfinite(scale) and scale > 0):
        raise _Decline(f"the total scale {scale:g} is not a positive finite number")
    _, k, rep_k = _repeat_kv(k4, walked) if k_perm == IDENTITY else (False, k4, None)
    _, v, rep_v = _repeat_kv(pv.inputs[1], walked)
    _no_escape(m.graph, chain, pv)
    dtype = _dtype_of(q, k, v, pv.outputs[0], scores)
    k_dims = _permuted_dims(k, k_perm)
    if checks.rank(q) != 4 or k_dims is None or len(k_dims) != 4 or checks.rank(v) != 4:
        raise _Decline("q, k and v are not all rank 4")
    q_heads, dqk = _heads(q, scores), _static(q, 3, "q's head dim")
    kv_heads = _kv_heads(k, rep_k, k4, q_heads, "k") if k_perm == IDENTITY else \
        (k_dims[1] if isinstance(k_dims[1], int) else None)
    v_heads = _kv_heads(v, rep_v, pv.inputs[1], q_heads, "v")
    if (kv_heads is not None and v_heads is not None and kv_heads != v_heads) or rep_k != rep_v:
        raise _Decline(f"k and v have different head counts or repeats ({kv_heads}, {v_heads})")
    if isinstance(k_dims[3], int) and k_dims[3] != dqk:
        raise _Decline(f"q's head dim {dqk} differs from k's {k_dims[3]}")
    dv = _static(v, 3, "v's head dim")
    if mask is not None:
        _check_mask(mask, scores, dtype)
    keep, fill, causal = _mask_form(mask, q, k_dims) if mask is not None else (None, None, False)
    past = _decode_parts(k if k_perm == IDENTITY else None, v)
    m.nodes.extend(walked + [n for n in chain if n not in m.nodes])  # detached by the commit once dead
    am = AttentionMatch(q, k, v, q_heads, kv_heads if kv_heads is not None else v_heads, dqk, dv, scale, mask, keep, causal,
                        m.which("probs") == 1 and _guarded(m), *past, pv.outputs[0], sm, dtype, m, fill)
    m.memo["k_perm"] = k_perm
    return am


def _guarded(m: Match) -> bool:
    try:
        m.node("guard")
    except KeyError:
        return False
    return True


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
    """``t`` under the Mul/Divs on top of it (through the non-constant operand, else the first): where the
    scores' MatMul is, if ``t`` is the scores (a non-constant factor is refused later, by name)."""
    while True:
        n = producer(t)
        if n is None or n.op not in ("Mul", "Div") or len(n.inputs) != 2:
            return t
        t = n.inputs[1] if n.op == "Mul" and ir.is_const(n.inputs[0]) else n.inputs[0]


def _reaches_matmul(t: Tensor) -> bool:
    n = producer(_peeled(t))
    return n is not None and n.op == "MatMul"


def _peel_scale(t: Tensor, walked: list[Node], what: str) -> tuple[float, Tensor]:
    """Strip Mul/Div by constant scalars from ``t``: (the product of the factors, the tensor under them).

    A Mul/Div by a constant of more than one element is refused: it is not a scale the fused op applies.
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
            raise _Decline(f"{what} is multiplied or divided by a constant that is not a float scalar "
                           f"(shape {ir.const_tensor(n.inputs[const_at]).shape}): not a scale of q @ k^T")
        c = float(checks.const_value(n.inputs[const_at]).reshape(-1)[0])
        if not math.isfinite(c) or c == 0.0:
            raise _Decline(f"a scale factor of {what} is {c:g}")
        scale = scale / c if n.op == "Div" else scale * c
        walked.append(n)
        t = n.inputs[1 - const_at]


def _scalar_const(t: Tensor) -> bool:
    """A float constant of one element and rank <= 4 (it cannot raise the rank of a BNSD operand)."""
    c = ir.const_tensor(t)
    if c is None or len(c.shape) > 4 or int(np.prod(c.shape, dtype=np.int64)) != 1:
        return False
    return checks.const_value(t).dtype.kind == "f"


def _untransposed_key(kt: Tensor, walked: list[Node]) -> tuple[Tensor, tuple[int, ...], float]:
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
        k = _batched_transpose(n, walked)
        if k is not None:
            scale, k = _peel_scale(k, walked, "k")
            return k, IDENTITY, scale
    raise _Decline("the second operand of the scores MatMul is not a transposed key")


IDENTITY = (0, 1, 2, 3)


def _batched_transpose(outer: Node, walked: list[Node]) -> Optional[Tensor]:
    """dynamo's ``Reshape(Transpose(Reshape(k, [-1, S, D]), [0, 2, 1]), [B, N, D, S])`` -> ``k`` (BNSD), when the
    Reshape targets are provably ``k``'s own dims; else None."""
    t = producer(outer.inputs[0])
    if t is None or t.op != "Transpose" or [int(p) for p in t.attrs.get("perm", ())] != [0, 2, 1]:
        return None
    inner = producer(t.inputs[0])
    if inner is None or inner.op != "Reshape" or len(inner.inputs) != 2:
        return None
    k = inner.inputs[0]
    if checks.rank(k) != 4:
        return None
    flat = _shape_refs(inner.inputs[1])
    back = _shape_refs(outer.inputs[1])
    if flat is None or back is None or len(flat) != 3 or len(back) != 4 or flat[0] != -1:
        return None
    if not (_is_dim(flat[1], k, 2) and _is_dim(flat[2], k, 3) and _is_dim(back[0], k, 0)
            and _is_dim(back[1], k, 1) and _is_dim(back[2], k, 3) and _is_dim(back[3], k, 2)):
        return None
    if inner.attrs.get("allowzero", 0) or outer.attrs.get("allowzero", 0):
        return None
    walked.extend([outer, t, inner])
    return k


def _shape_refs(t: Tensor) -> Optional[list]:
    """A small integer tensor (a shape) element by element: ints for constants, ``("dim", x, axis)`` for
    dims of a Shape(x), ``("elem", t, i)`` for an element of anything else (equal only to itself)."""
    value = checks.const_value(t)
    if value is not None:
        return [int(v) for v in value.reshape(-1)] if value.dtype.kind in "iu" and value.size <= 8 else None
    n = producer(t)
    refs = None if n is None else _computed_refs(n)
    if refs is None and ir.const_shape(t) is not None and len(t.shape) <= 1 and int(np.prod(t.shape)) <= 8:
        refs = [("elem", t, i) for i in range(int(np.prod(t.shape)))]
    return refs


def _computed_refs(n: Node) -> Optional[list]:
    """:func:`_shape_refs` of the output of ``n``, from its op."""
    if n.op == "Concat" and int(n.attrs.get("axis", 0)) in (0, -1):
        parts = [_shape_refs(i) for i in n.inputs]
        return None if any(p is None for p in parts) else [e for p in parts for e in p]
    if n.op == "Shape":
        r = checks.rank(n.inputs[0])
        if r is None:
            return None
        start, end = int(n.attrs.get("start", 0)), n.attrs.get("end")
        axes = range(r)[slice(start, None if end is None else int(end))]
        return [("dim", n.inputs[0], a) for a in axes]
    if n.op == "Slice" and len(n.inputs) in (3, 4) and (len(n.inputs) < 4 or _ints(n.inputs[3]) == [0]):
        src, starts, ends = _shape_refs(n.inputs[0]), _ints(n.inputs[1]), _ints(n.inputs[2])
        if src is None or starts is None or ends is None or len(starts) != 1 or len(ends) != 1:
            return None
        return src[slice(max(starts[0], -len(src) - 1), min(ends[0], len(src)))]
    if n.op == "Gather" and int(n.attrs.get("axis", 0)) == 0:
        src, idx = _shape_refs(n.inputs[0]), _ints(n.inputs[1])
        return None if src is None or idx is None or len(idx) != 1 or not -len(src) <= idx[0] < len(src) \
            else [src[idx[0]]]
    if n.op in ("Unsqueeze", "Reshape", "Squeeze") and len(n.outputs[0].shape or (0, 0)) <= 1:
        return _shape_refs(n.inputs[0])  # a 0-D or 1-D result has the elements in their order
    if n.op == "Where":  # TorchScript's expand target: Where(Equal(shape, -1), 1, shape), the Equal folded
        cond, parts = checks.const_value(n.inputs[0]), [_shape_refs(i) for i in n.inputs[1:]]
        if cond is None or cond.ndim != 1 or any(p is None or len(p) not in (1, cond.size) for p in parts):
            return None
        pick = [p * cond.size if len(p) == 1 else p for p in parts]
        return [pick[0][i] if c else pick[1][i] for i, c in enumerate(cond.tolist())]
    return None


def _ints(t: Tensor) -> Optional[list[int]]:
    value = checks.const_value(t)
    return None if value is None or value.dtype.kind not in "iu" else [int(v) for v in value.reshape(-1)]


def _is_dim(ref: object, x: Tensor, axis: int) -> bool:
    """``ref`` (from :func:`_shape_refs`) is dim ``axis`` of ``x``: read from ``x``'s shape, or equal to it as a
    number or a symbol (equal ``dim_param`` names are equal sizes)."""
    return _same(ref, ("dim", x, axis))


def _same(a: object, b: object) -> bool:
    """Two :func:`_shape_refs` elements are provably the same size: one element of one tensor, or equal
    numbers or symbols (equal ``dim_param`` names are equal sizes)."""
    if isinstance(a, tuple) and isinstance(b, tuple) and a[0] == b[0] and a[1] is b[1] and a[2] == b[2]:
        return True
    a, b = _size(a), _size(b)
    return a is not None and a == b and not (isinstance(a, int) and a < 0)


def _size(ref: object) -> object:
    """What is known of a ref's size: a number, a symbol, or None."""
    if isinstance(ref, tuple):
        return fold_shapes.dim_at(ref[1], ref[2]) if ref[0] == "dim" else None
    return ref


def _repeat_kv(t: Tensor, walked: list[Node]) -> tuple[bool, Tensor, Optional[int]]:
    """``Reshape(Expand(Unsqueeze(x, 2), [B, H, rep, S, D]), [B, H*rep, S, D])`` -> (True, x, rep); else (False, t, None).

    The Reshape must keep dims 0, 2 and 3 (so, row-major, it merges exactly the heads and the repeat
    axes); ``rep`` must be a constant. The Expand's other target elements need no proof: where one
    broadcasts a dim of x (1 in x), the repeated copies are equal, so the head a query reads is the
    same; for the batch, sequence and head dims a fused op checks q/k/v/mask shapes at run time.
    """
    r = producer(t)
    e = producer(r.inputs[0]) if r is not None and r.op == "Reshape" else None
    u = producer(e.inputs[0]) if e is not None and e.op == "Expand" else None
    if u is None or u.op != "Unsqueeze":
        return False, t, None
    axes = u.attrs.get("axes") if "axes" in u.attrs else (_ints(u.inputs[1]) if len(u.inputs) > 1 else None)
    x = u.inputs[0]
    if axes is None or [int(a) for a in axes] not in ([2], [-3]) or checks.rank(x) != 4:
        return False, t, None
    target = _shape_refs(e.inputs[1])
    if target is None or len(target) != 5 or not isinstance(target[2], int) or target[2] <= 0:
        raise _Decline("GQA's Expand of the keys/values has no readable target with a constant repeat count")
    out = _shape_refs(r.inputs[1])
    copy = not r.attrs.get("allowzero", 0)
    # The Expand's dim j is its target's element where that is not 1, else x's dim.
    kept = [(out[0], 0, 0), (out[2], 3, 2), (out[3], 4, 3)] if out is not None and len(out) == 4 else None
    if kept is None or not all((copy and o == 0 and j == 0) or (_same(o, target[j]) if target[j] != 1
                                                                 else _is_dim(o, x, axis)) for o, j, axis in kept):
        raise _Decline("GQA's Reshape of the repeated keys/values does not provably merge just the heads axes")
    walked.extend([r, e, u])
    return True, x, target[2]


def _permuted_dims(x: Tensor, perm: tuple[int, ...]) -> Optional[list]:
    dims = fold_shapes.tensor_dims(x)
    return None if dims is None or len(dims) != 4 else [dims[p] for p in perm]


def _static(t: Tensor, axis: int, what: str) -> int:
    d = fold_shapes.dim_at(t, axis)
    if not isinstance(d, int) or d <= 0:
        raise _Decline(f"{what} is not static")
    return d


def _heads(t: Tensor, scores: Tensor) -> Optional[int]:
    """q's head count: its static dim 1, else the scores' (they have q's heads unless q broadcasts)."""
    for d in (fold_shapes.dim_at(t, 1), fold_shapes.dim_at(scores, 1)):
        if isinstance(d, int) and d > 0:
            return d
    return None


def _kv_heads(x: Tensor, rep: Optional[int], repeated: Tensor, q_heads: Optional[int], what: str) -> Optional[int]:
    """The head count of k or v (None when not static), checked against q's."""
    d = fold_shapes.dim_at(x, 1)
    d = d if isinstance(d, int) and d > 0 else None
    if rep is not None and rep > 1:
        total = fold_shapes.dim_at(repeated, 1)
        if q_heads is None or total != q_heads:
            raise _Decline(f"GQA: q's head count is not provably the repeated {what}'s")
        if d is not None and d * rep != q_heads:
            raise _Decline(f"{what}'s {d} heads repeated {rep} times are not q's {q_heads}")
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


def _elem(t: Tensor) -> Optional[int]:
    if t.dtype is None:
        return None
    if isinstance(t.dtype, int):
        return t.dtype
    try:
        return helper.np_dtype_to_tensor_dtype(np.dtype(t.dtype))
    except TypeError:
        return None


def _dtype_of(*tensors: Tensor) -> int:
    types = {_elem(t) for t in tensors}
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
    (dims unknown here are checked by the fused op at run time against (B, Nq, Sq, Skv))."""
    if _elem(mask) != dtype:
        raise _Decline("the mask's dtype is not the scores'")
    r = checks.rank(mask)
    if r is None or r > 4:
        raise _Decline(f"the mask's rank ({r}) is unknown or above the scores' 4 (it would broadcast them)")
    for i in range(r):
        d, s = fold_shapes.dim_at(mask, i), fold_shapes.dim_at(scores, 4 - r + i)
        if isinstance(d, int) and d != 1 and isinstance(s, int) and s != d:
            raise _Decline(f"the mask's dim {i} ({d}) broadcasts the scores' ({s})")


def _mask_form(mask: Tensor, q: Tensor, k_dims: list) -> tuple[Optional[Tensor], Optional[float], bool]:
    """(keep, fill, causal_only) of an additive mask ``Where(keep, 0, fill)`` or a constant of 0s and one
    negative fill; ``keep`` only when the fill masks out (-inf or at most :data:`MASKED_BELOW`)."""
    value = checks.const_value(mask) if ir.is_const(mask) and _size_of(mask) <= 1 << 22 else None
    if value is not None:
        fills = np.unique(value[value != 0])
        if len(fills) > 1 or (len(fills) == 1 and not fills[0] < 0):
            return None, None, False
        keep_value = value == 0
        fill = float(fills[0]) if len(fills) else float("-inf")
        keep = gs.Constant(f"{mask.name}_keep", keep_value)
        return (keep if fill <= MASKED_BELOW else None), fill, _causal(keep_value, q, k_dims)
    n = producer(mask)
    if n is None or n.op != "Where" or len(n.inputs) != 3 or _elem(n.inputs[0]) != TensorProto.BOOL:
        return None, None, False
    zero, fill = checks.const_value(n.inputs[1]), checks.const_value(n.inputs[2])
    if zero is None or fill is None or zero.size != 1 or fill.size != 1 or zero.ndim > 4 or fill.ndim > 4 \
            or float(zero.reshape(-1)[0]) != 0.0 or not float(fill.reshape(-1)[0]) < 0:
        return None, None, False
    keep, f = n.inputs[0], float(fill.reshape(-1)[0])
    kv = checks.const_value(keep) if ir.is_const(keep) and _size_of(keep) <= 1 << 22 else None
    return (keep if f <= MASKED_BELOW else None), f, kv is not None and _causal(kv, q, k_dims)


def _size_of(t: Tensor) -> int:
    c = ir.const_tensor(t)
    return int(np.prod(c.shape, dtype=np.int64)) if c is not None else 0


def _causal(keep: np.ndarray, q: Tensor, k_dims: list) -> bool:
    """``keep`` is exactly the bottom-right aligned causal triangle of the (static) q and k lengths, with
    at least as many keys as queries (so every query row keeps a key)."""
    sq, skv = fold_shapes.dim_at(q, 2), k_dims[2]
    if keep.ndim < 2 or not isinstance(sq, int) or not isinstance(skv, int) or skv < sq \
            or keep.shape[-2:] != (sq, skv) \
            or any(d != 1 for d in keep.shape[:-2]):
        return False
    tri = np.arange(skv)[None, :] <= np.arange(sq)[:, None] + (skv - sq)
    return bool(np.array_equal(keep.reshape(sq, skv), tri))


def _decode_parts(k: Optional[Tensor], v: Tensor) -> tuple:
    """(past_key, past_value, new_key, new_value, present_key, present_value): set when k and v are both
    ``Concat(past, new)`` on the sequence axis."""
    parts = []
    for t in (k, v):
        n = producer(t) if t is not None else None
        if n is None or n.op != "Concat" or len(n.inputs) != 2 or int(n.attrs.get("axis", 0)) not in (2, -2):
            return (None,) * 6
        parts.append(n)
    (ck, cv) = parts
    return ck.inputs[0], cv.inputs[0], ck.inputs[1], cv.inputs[1], ck.outputs[0], cv.outputs[0]


def _materialized(op: RewriteBuilder, am: AttentionMatch) -> AttentionMatch:
    """``am`` with BNSD keys: keys found in another layout (a head split fused into the transpose) get a
    Transpose to BNSD."""
    perm = am.match.memo.get("k_perm", IDENTITY)
    return am if perm == IDENTITY else dataclasses.replace(am, k=op.Transpose(am.k, perm=list(perm)))
