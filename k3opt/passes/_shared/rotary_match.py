"""The rotary-embedding recogniser shared by fuse-rotary (RotaryEmbedding-23) and lower-rotary-npu
(NPURotaryPositionEmbedding): it finds the rotation of q or k and proves it exact; the passes decide what
to emit.

Forms (see docs/passes/fuse-rotary.md), for a 4-D ``x`` (batch, heads, positions, head_dim D):

- rotate-half (Llama, Qwen2, GPT-NeoX): ``x * cos + Concat(-x[..., D/2:], x[..., :D/2]) * sin`` with
  full-width ``cos``/``sin`` (``..., D``), halves by Slice or Split, the minus as Neg or Mul by -1;
- the explicit halves form: ``Concat(x1*cos - x2*sin, x2*cos + x1*sin)`` with half-width ``cos``/``sin``,
  where ``x1, x2`` are the halves, or DeepSeek-V3's even/odd elements ``x[..., 0::2], x[..., 1::2]``
  (transformers' ``apply_rotary_pos_emb_interleave``: its result is in the half-split layout);
- partial rotary: MLA rotates a Split-off part of q/k, which is simply the ``x`` above; TorchScript merges
  ``cat((q_pass, q_rot))`` into the rotation's Concat (``Concat(q_pass, real, imag)``), kept as a prefix, and
  merge-concats a partial rotation's ``cat((q_rot, q_pass))`` (``Concat(real, imag, q_pass)``), kept as a
  suffix;
- interleaved (GPT-J, CodeGen): ``x * cos + rotate_every_two(x) * sin`` where ``rotate_every_two(x)`` is
  ``stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)`` (Unsqueeze, Concat and Reshape in ONNX) and
  ``cos``/``sin`` are ``repeat_interleave(2)`` of half-width angles (the result keeps the pairs).

A full-width angle tensor is only taken as equal-halved once that is proven (it is an element-wise
function, along the last axis, of ``Concat(f, f)``, or a constant with equal halves), and one of the
interleaved form as equal-paired once it is such a function of ``repeat_interleave(f, 2)`` (a Reshape
flattening ``Tile``/``Expand`` of ``Unsqueeze(f, -1)`` by 2) or a constant with equal pairs; its batch and
position dims must be 1 or provably x's; its heads dim must be 1. cos and sin must be the same
computation except Cos vs Sin, of one angle tensor (or both constants).

Entry point: ``rotary_rules(rewrite)`` gives the rules and :func:`k3opt.patterns.apply_rules` sweeps them; ``rewrite(op,
rm)`` receives a :class:`RotaryMatch` and returns the replacement of the rotated tensor (or None to leave it).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import numpy as np
from onnx import TensorProto

from ...graph import dtypes
from ...graph.ir import Node, Tensor, is_const, producer
from ...graph.small_constants import small_const_scalar, small_const_value
from ...patterns import Match, PatternBuilder, RewriteBuilder, Rule, checks
from ...patterns.matcher import is_empty
from ...graph.symbolic.algebra import Dim
from ...graph.symbolic.dims import Dims

#: Element types RotaryEmbedding-23 takes (and the NPU op: fp16, bf16, fp32).
_FUSABLE_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
_ANGLE_UNARY = ("Cast", "Cos", "Sin", "Identity", "Unsqueeze", "Squeeze", "Expand", "Slice", "Transpose", "Gather")
_ANGLE_SCALAR = ("Mul", "Div", "Add", "Sub")
#: How many producers deep an angle tensor or a position dim is followed.
_MAX_DEPTH = 16


@dataclasses.dataclass
class RotaryMatch:
    """A recognised rotation of ``x`` (rank 4: batch, heads, positions, ``head_dim``).

    ``lo``/``hi`` are the halves as matched; ``pairs`` when they are the even and odd elements (the
    result is still in the half-split layout). ``cos``/``sin`` are the angle tensors as the graph
    multiplies them: ``full_width`` (``..., head_dim``, both halves equal) or half-width.
    ``same_batch``/``same_positions``: their batch/position dims are provably x's (no broadcast).
    """

    x: Tensor
    lo: Tensor
    hi: Tensor
    pairs: bool
    cos: Tensor
    sin: Tensor
    full_width: bool
    head_dim: int
    same_batch: bool
    same_positions: bool
    #: The node computing the result (the final Add or Concat): names the rotation.
    root: Node
    match: Match
    #: The interleaved form: x's pairs ``(2i, 2i+1)`` rotated in place by full-width angles with equal pairs.
    interleaved: bool = False


# -- patterns ----------------------------------------------------------------------------------------------------

def _halves(op: PatternBuilder, x: Any, kind: str) -> tuple[Any, Any]:
    if kind == "slice":
        return (op.Slice(x, _allow_other_inputs=True, _name="lo"), op.Slice(x, _allow_other_inputs=True, _name="hi"))
    return op.Split(x, _allow_other_inputs=True, _outputs=["lo", "hi"], _name="split")


def _rotate_half(kind: str) -> Callable[..., Any]:
    def pattern(op: PatternBuilder, x: Any, cos: Any, sin: Any) -> Any:
        lo, hi = _halves(op, x, kind)
        rotated = op.Concat(op.Or(op.Neg(hi), op.Mul(hi, -1.0)), lo, _name="concat")
        return op.Add(op.Mul(x, cos), op.Mul(rotated, sin), _name="root")
    return pattern


def _explicit_halves(kind: str, around: str = "") -> Callable[..., Any]:
    """``Concat(x1*cos - x2*sin, x2*cos + x1*sin)``; ``around`` "prefix"/"suffix": with another input before or
    after the two halves (see :func:`_prefixed_halves`, :func:`_suffixed_halves`)."""
    def rotation(op: PatternBuilder, x: Any, cos: Any, sin: Any) -> tuple[Any, Any]:
        lo, hi = _halves(op, x, kind)
        return op.Sub(op.Mul(lo, cos), op.Mul(hi, sin)), op.Add(op.Mul(hi, cos), op.Mul(lo, sin))

    def pattern(op: PatternBuilder, x: Any, cos: Any, sin: Any) -> Any:
        return op.Concat(*rotation(op, x, cos, sin), _name="root")

    def prefixed_pattern(op: PatternBuilder, x: Any, cos: Any, sin: Any, prefix: Any) -> Any:
        return op.Concat(prefix, *rotation(op, x, cos, sin), _name="root")

    def suffixed_pattern(op: PatternBuilder, x: Any, cos: Any, sin: Any, suffix: Any) -> Any:
        return op.Concat(*rotation(op, x, cos, sin), suffix, _name="root")

    return {"": pattern, "prefix": prefixed_pattern, "suffix": suffixed_pattern}[around]


def _prefixed_halves(kind: str) -> Callable[..., Any]:
    """``Concat(prefix, x1*cos - x2*sin, x2*cos + x1*sin)``: TorchScript merges MLA's ``cat((q_pass, q_rot))``
    with the rotation's own Concat; the rotation is fused and ``prefix`` concatenated before it again."""
    return _explicit_halves(kind, "prefix")


def _suffixed_halves(kind: str) -> Callable[..., Any]:
    """``Concat(x1*cos - x2*sin, x2*cos + x1*sin, suffix)``: a partial rotation's ``cat((q_rot, q_pass))``
    merged with the rotation's own Concat (merge-concats does it, an exporter may); ``suffix`` is concatenated
    after the fused rotation again."""
    return _explicit_halves(kind, "suffix")


def _rotate_every_two(op: PatternBuilder, x: Any, cos: Any, sin: Any) -> Any:
    """GPT-J's ``x * cos + stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2) * sin``."""
    even = op.Slice(x, _allow_other_inputs=True, _name="lo")
    odd = op.Slice(x, _allow_other_inputs=True, _name="hi")
    minus = op.Or(op.Neg(odd), op.Mul(odd, -1.0))
    stacked = op.Concat(op.Unsqueeze(minus, _allow_other_inputs=True, _name="stack_odd"),
                        op.Unsqueeze(even, _allow_other_inputs=True, _name="stack_even"), _name="concat")
    rotated = op.Reshape(stacked, _allow_other_inputs=True, _name="flatten")
    return op.Add(op.Mul(x, cos), op.Mul(rotated, sin), _name="root")


_FORMS = (("rotate-half", _rotate_half, True), ("halves", _explicit_halves, False),
          ("prefixed-halves", _prefixed_halves, False), ("suffixed-halves", _suffixed_halves, False))


def rotary_rules(rewrite: Callable[[RewriteBuilder, RotaryMatch], Optional[Tensor]], name: str = "rotary",
                 angles_proven: bool = True, verdicts: Optional[dict[tuple, tuple]] = None) -> list[Rule]:
    """The rotary rules (rotate-half, explicit halves, explicit halves after an MLA prefix or before a partial
    rotation's rest; each with Slice or Split halves), checked by :func:`analyze` and rebuilt by ``rewrite``
    (None leaves the match as it is; a prefix or suffix is concatenated around the result by the rule).
    ``angles_proven``: cos and sin must be proven one rotation's angles (see :func:`analyze`).

    ``verdicts``: where the checks keep what they find about each angle tensor (:func:`_known_angle_shape`),
    for rules whose rewrites change nothing (counting, not fusing: the graph stays as the checks saw it)."""
    rules = []
    for form, pattern, full_width in _FORMS:
        for kind in ("slice", "split"):
            rules.append(_rule(f"{name}-{form}-{kind}", pattern(kind), full_width, rewrite, angles_proven,
                               verdicts=verdicts))
    rules.append(_rule(f"{name}-interleaved", _rotate_every_two, True, rewrite, angles_proven, True, verdicts))
    return rules


def _rule(name: str, pattern: Callable[..., Any], full_width: bool,
          rewrite: Callable[[RewriteBuilder, RotaryMatch], Optional[Tensor]], angles_proven: bool,
          interleaved: bool = False, verdicts: Optional[dict[tuple, tuple]] = None) -> Rule:
    def check(m: Match) -> bool:
        m.memo["rotary"] = analyze(m, full_width, interleaved, angles_proven, verdicts)
        return m.memo["rotary"] is not None

    def apply(op: RewriteBuilder, m: Match) -> Optional[Tensor]:
        rm = m.memo["rotary"] if "rotary" in m.memo else analyze(m, full_width, interleaved, angles_proven, verdicts)
        rotated = None if rm is None else rewrite(op, rm)
        if rotated is None or ("prefix" not in m and "suffix" not in m):
            return rotated
        return op.Concat(m["prefix"], rotated, axis=-1) if "prefix" in m else op.Concat(rotated, m["suffix"], axis=-1)

    return Rule(name, pattern, apply, check, description=f"rotary embedding ({name})")


# -- checks ------------------------------------------------------------------------------------------------------

def analyze(m: Match, full_width: bool, interleaved: bool = False, angles_proven: bool = True,
            verdicts: Optional[dict[tuple, tuple]] = None) -> Optional[RotaryMatch]:
    """The :class:`RotaryMatch` of a structural match, or None (with ``m.fail(reason)``) when fusing is not exact.

    ``angles_proven`` (fuse-rotary): cos and sin are proven the Cos and Sin of one angle tensor, and full-width
    ones equal on both halves (RotaryEmbedding-23 takes the half-width caches), or equal in pairs (the
    interleaved form). Without it (the NPU op, whose documented formula multiplies by the full-width cos and
    sin as they are: any values) only their shapes are checked. ``verdicts``: see :func:`rotary_rules`."""
    dims = m.dims
    x = m["x"]
    shape = x.shape
    if shape is None or len(shape) != 4:
        return _fail(m, "x is not a 4-D (batch, heads, positions, head_dim) tensor")
    d = checks.last_dim(x)
    if d is None or d < 2 or d % 2:
        return _fail(m, f"the head dim {shape[-1]} is not a static even number")
    dtype = dtypes.onnx_type(x.dtype)
    if dtype not in _FUSABLE_TYPES or any(dtypes.onnx_type(m[k].dtype) != dtype for k in ("cos", "sin")):
        return _fail(m, "x, cos and sin are not all float32, float16 or bfloat16 of one type")
    pairs = _halves_kind(m, d)
    if isinstance(pairs, str):
        return _fail(m, pairs)
    if interleaved:
        why = _every_two_refusal(dims, m, pairs)
        if why:
            return _fail(m, why)
        pairs = False  # the pairs are rotated in place: x itself is the op's input
    elif pairs and full_width:
        return _fail(m, "rotate-half of the even/odd elements is not a rotary embedding")
    elif concat_axis(m.node("concat" if full_width else "root"), 4) != 3:
        return _fail(m, "the halves are not concatenated on the last axis")
    width = d if full_width else d // 2
    shapes = {}
    for role in ("cos", "sin"):
        why = _known_angle_shape(dims, verdicts, m[role], x, width)
        if isinstance(why, str):
            return _fail(m, f"{role}: {why}")
        shapes[role] = why
    why = _angles_refusal(dims, m, d, full_width, interleaved) if angles_proven else None
    if why:
        return _fail(m, why)
    same_batch = shapes["cos"][0] and shapes["sin"][0]
    same_positions = shapes["cos"][1] and shapes["sin"][1]
    lo, hi = (m["lo"], m["hi"]) if "lo" in m else (m.node("lo").outputs[0], m.node("hi").outputs[0])
    return RotaryMatch(x=x, lo=lo, hi=hi, pairs=pairs, cos=m["cos"], sin=m["sin"], full_width=full_width, head_dim=d,
                       same_batch=same_batch, same_positions=same_positions, root=m.node("root"), match=m,
                       interleaved=interleaved)


def _angles_refusal(dims: Dims, m: Match, d: int, full_width: bool, interleaved: bool) -> Optional[str]:
    """Why cos and sin are not proven one rotation's angles (see :func:`analyze`), or None."""
    if interleaved:
        cos_chain, sin_chain = _paired_chain(dims, m["cos"], d), _paired_chain(dims, m["sin"], d)
        for role, paired in (("cos", cos_chain), ("sin", sin_chain)):
            if paired is None:
                return f"{role} is not proven repeat_interleave(2) of half-width angles (equal pairs)"
    else:
        cos_chain, sin_chain = _chain(m["cos"]), _chain(m["sin"])
    why = _same_angles(cos_chain, sin_chain)
    if why:
        return why
    if full_width and not interleaved:
        for role, chain in (("cos", cos_chain), ("sin", sin_chain)):
            if not _symmetric(chain, d):
                return f"{role} is not proven equal on both halves of the head dim"
    return None


def _fail(m: Match, reason: str) -> None:
    m.fail(reason)
    return None


def _every_two_refusal(dims: Dims, m: Match, pairs: bool) -> Optional[str]:
    """Why the interleaved form's rotation is not ``stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)``, or
    None. The Neg is on the odd elements (the pattern) and they are stacked in that order."""
    if not pairs:
        return "the stacked elements are not x[..., 0::2] and x[..., 1::2] (step-2 slices of the head dim)"
    if concat_axis(m.node("concat"), 5) != 4 or any(unsqueeze_axes(m.node(n), 5) != [4]
                                                   for n in ("stack_odd", "stack_even")):
        return "the even and odd elements are not stacked on a new last axis"
    if not flattens_last_pair(dims, m.node("flatten")):
        return "the stacked pairs are not flattened back into the head dim"
    return None


def flattens_last_pair(dims: Dims, node: Node) -> bool:
    """``node`` is a Reshape of a 5-D (a, b, c, n, 2) tensor to (a, b, c, 2n) (torch's ``flatten(-2)``): each
    of the first three elements of its shape copies the dim (0 without allowzero) or provably equals it (or one
    of them is -1 and the last is 2n), or they are ``Shape(src)[0:3]``."""
    src = node.inputs[0]
    if node.op != "Reshape" or len(node.inputs) != 2 or src.shape is None or len(src.shape) != 5 \
            or dims.at(src, 4) != 2 or not isinstance(dims.at(src, 3), int):
        return False
    elements = dims.elements(node.inputs[1])
    if elements is None or len(elements[0]) != 4 or elements[0][3] not in (-1, 2 * dims.at(src, 3)):
        return False
    copies = not int(node.attrs.get("allowzero", 0))
    kept = [(e == 0 and copies) or (e is not None and e == dims.at(src, k)) for k, e in enumerate(elements[0][:3])]
    # one -1 among them is the dim itself when every other one is (the element count is kept)
    inferred = [e == -1 for e in elements[0][:3]]
    return all(kept) or (sum(inferred) == 1 and elements[0][3] != -1 and all(k or i for k, i in zip(kept, inferred))) \
        or _leading_three_of(node.inputs[1], src)


def _leading_three_of(shape: Tensor, src: Tensor) -> bool:
    """``shape`` is ``Concat(Shape(src)[0:3], [last])`` (TorchScript's flatten when src's dims are unknown)."""
    concat = producer(shape)
    if concat is None or concat.op != "Concat" or len(concat.inputs) != 2:
        return False
    head, sliced = producer(concat.inputs[0]), False
    if head is not None and head.op == "Slice":
        values = [None if is_empty(t) else small_const_value(t) for t in head.inputs[1:]]
        want = ([0], [3], [0], [1])  # starts, ends, axes (or none), steps (or none)
        if len(values) < 2 or values[0] is None or values[1] is None or any(
                v is not None and [int(a) for a in np.asarray(v).reshape(-1)] != want[k] for k, v in enumerate(values)):
            return False
        head, sliced = producer(head.inputs[0]), True
    if head is None or head.op != "Shape" or head.inputs[0] is not src or int(head.attrs.get("start", 0)):
        return False
    return head.attrs.get("end") is None if sliced else head.attrs.get("end") == 3


def concat_axis(node: Node, rank: int) -> Optional[int]:
    axis = int(node.attrs.get("axis", 0))
    axis = axis + rank if axis < 0 else axis
    return axis if 0 <= axis < rank else None


def _halves_kind(m: Match, d: int) -> "bool | str":
    """False for the two halves ``x[..., :D/2]``, ``x[..., D/2:]``, True for ``x[..., 0::2]``, ``x[..., 1::2]``,
    else why the halves are something else."""
    h = d // 2
    try:
        split = m.node("split")
    except KeyError:
        lo, hi = slice_last(m.node("lo"), d), slice_last(m.node("hi"), d)
        if lo == (0, h, 1) and hi == (h, d, 1):
            return False
        if lo == (0, d, 2) and hi == (1, d, 2):
            return True
        return f"the halves are slices {lo} and {hi} of the head dim {d}, not its halves or even/odd elements"
    if len(split.outputs) != 2 or concat_axis(split, 4) != 3 or _split_sizes(split, d) != [h, h]:
        return "the Split does not cut the head dim into two halves"
    return False


def slice_last(node: Node, d: int) -> Optional[tuple[int, int, int]]:
    """(start, stop, step) of a Slice over the last axis only of a rank-4 tensor, normalized; None otherwise."""
    inputs = list(node.inputs) + [None] * (5 - len(node.inputs))
    values = [None if t is None or is_empty(t) else small_const_value(t) if is_const(t) else False for t in inputs[1:5]]
    if any(v is False for v in values) or values[0] is None or values[1] is None:
        return None
    starts, ends, axes, steps = (None if v is None else [int(a) for a in np.asarray(v).reshape(-1)] for v in values)
    axes = axes if axes is not None else list(range(len(starts)))
    steps = steps if steps is not None else [1] * len(starts)
    if not (len(starts) == len(ends) == len(axes) == len(steps) == 1) or axes[0] not in (3, -1) or steps[0] <= 0:
        return None
    start, stop = (min(max(v + d if v < 0 else v, 0), d) for v in (starts[0], ends[0]))
    return start, stop, steps[0]


def _split_sizes(node: Node, d: int) -> Optional[list[int]]:
    sizes = node.inputs[1] if len(node.inputs) > 1 and not is_empty(node.inputs[1]) else None
    if sizes is not None:
        value = small_const_value(sizes)
        return None if value is None else [int(s) for s in value.reshape(-1)]
    if "split" in node.attrs:
        return [int(s) for s in node.attrs["split"]]
    n = len(node.outputs)
    return [d // n] * n if d % n == 0 else None


def _angle_shape(dims: Dims, t: Tensor, x: Tensor, width: int) -> "tuple[bool, bool] | str":
    """Whether ``t`` broadcasts against ``x`` as the op's cache does: (same batch, same positions), or why not.

    Aligned with x's (batch, heads, positions, head_dim) from the right: the last dim is ``width``, the heads
    dim 1, the batch and position dims 1 or provably x's (an Expand then fills in what broadcasts).
    """
    shape = t.shape
    if shape is None or not 1 <= len(shape) <= 4:
        return "its rank is unknown or above 4"
    if _last_dim(dims, t) != width:
        return f"its last dim {shape[-1]} is not {width}"
    pad = 4 - len(shape)
    padded = [1] * pad + list(shape)
    if len(shape) >= 3 and padded[1] != 1 and not _same_dim(dims, t, 1 - pad, 1):
        return "it is not broadcast over the heads (its heads dim is not 1)"
    same = []
    for axis, what in ((0, "batch"), (2, "positions")):
        if axis >= pad and _same_dim(dims, t, axis - pad, dims.at(x, axis)):
            same.append(True)
        elif padded[axis] == 1 or (axis >= pad and _same_dim(dims, t, axis - pad, 1)):
            same.append(dims.at(x, axis) == 1)
        else:
            return f"its {what} dim is neither 1 nor provably x's"
    return same[0], same[1]


def _known_angle_shape(dims: Dims, verdicts: Optional[dict[tuple, tuple]], t: Tensor, x: Tensor,
                       width: int) -> "tuple[bool, bool] | str":
    """:func:`_angle_shape`, kept in ``verdicts`` when given (rules that rewrite nothing: each angle tensor is
    usually shared by q and k of every layer). It reads x only through its batch and positions dims: the key
    is (id(angles), width, x's batch dim, x's positions dim), the entry (the angle tensor, the verdict)."""
    if verdicts is None:
        return _angle_shape(dims, t, x, width)
    key = (id(t), width, dims.at(x, 0), dims.at(x, 2))
    hit = verdicts.get(key)
    if hit is None or hit[0] is not t:
        hit = verdicts[key] = (t, _angle_shape(dims, t, x, width))
    return hit[1]


def _last_dim(dims: Dims, t: Tensor) -> Optional[int]:
    """The static last dim of ``t``, also of a ``flatten(-2)`` Reshape whose inferred shape lost it."""
    node = producer(t)
    if checks.last_dim(t) is None and node is not None and node.op == "Reshape" and flattens_last_pair(dims, node):
        return 2 * dims.at(node.inputs[0], 3)
    return checks.last_dim(t)


def _same_dim(dims: Dims, t: Tensor, axis: int, want: Dim) -> bool:
    """Dim ``axis`` of ``t`` is provably ``want`` (a number or symbol): as inferred, or traced back through the
    ops that compute angles from positions (element-wise ops, Unsqueeze, Gather, ``Range(0, n, 1)``)."""
    if want is None:
        return False
    for _ in range(_MAX_DEPTH):
        have = dims.at(t, axis)
        if have == want:
            return True
        node = producer(t)
        if node is None or isinstance(have, int) or (node.domain or "") not in ("", "ai.onnx") or t.shape is None:
            return False
        step = _dim_source(dims, node, t, axis)
        if step is None:
            return False
        if step[0] is None:
            return step[1] == want
        t, axis = step
    return False


def _dim_source(dims: Dims, node: Node, t: Tensor, axis: int) -> Optional[tuple]:
    """Where dim ``axis`` of ``t`` (``node``'s output) comes from: (tensor, axis), or (None, value) when it is
    a value read off a Range's bound; None when not known."""
    rank = len(t.shape)
    op, inputs = node.op, node.inputs
    if op in ("Cos", "Sin", "Cast", "Neg", "Identity") or (op == "Concat" and concat_axis(node, rank) != axis) \
            or (op == "Slice" and _slice_spares(node, rank, axis)):
        return inputs[0], axis
    if op in _ANGLE_SCALAR and len(inputs) == 2:
        # the one operand not broadcast along this axis (a position offset or a frequency vector is)
        if any(x.shape is None for x in inputs):
            return None
        varying = [(x, j) for x in inputs for j in [axis - (rank - len(x.shape))] if j >= 0 and x.shape[j] != 1]
        return varying[0] if len(varying) == 1 else None
    if op == "Reshape" and axis < rank - 1 and flattens_last_pair(dims, node):
        return inputs[0], axis
    if op in ("Tile", "Expand") and _repeats_last_axis_only(dims, node) is not None and axis < rank - 1:
        return inputs[0], axis
    if op == "Unsqueeze":
        axes = unsqueeze_axes(node, rank)
        if axes is None or axis in axes:
            return None
        return inputs[0], axis - sum(a < axis for a in axes)
    if op == "Gather" and inputs[0].shape is not None and inputs[1].shape is not None:
        g = concat_axis(node, len(inputs[0].shape))
        k = len(inputs[1].shape)
        if g is None:
            return None
        if axis < g:
            return inputs[0], axis
        if axis < g + k:
            return inputs[1], axis - g
        return inputs[0], axis - k + 1
    if op == "Range" and axis == 0 and small_const_scalar(inputs[2]) == 1:
        if small_const_scalar(inputs[0]) == 0:
            return None, _scalar_dim(dims, inputs[1])
        limit = producer(inputs[1])
        if limit is not None and limit.op == "Add" and len(limit.inputs) == 2 \
                and any(a is inputs[0] for a in limit.inputs):
            return None, _scalar_dim(dims, limit.inputs[1] if limit.inputs[0] is inputs[0] else limit.inputs[0])
    return None


def _raw_axes(node: Node) -> Optional[list[int]]:
    """The axes of an Unsqueeze/Squeeze as written (attribute or constant input), None when not constant."""
    if "axes" in node.attrs:
        return [int(a) for a in node.attrs["axes"]]
    if len(node.inputs) > 1 and is_const(node.inputs[1]):
        return [int(a) for a in small_const_value(node.inputs[1]).reshape(-1)]
    return None


def unsqueeze_axes(node: Node, out_rank: int) -> Optional[list[int]]:
    axes = _raw_axes(node)
    return None if axes is None else sorted(a + out_rank if a < 0 else a for a in axes)


def _scalar_dim(dims: Dims, t: Tensor) -> Dim:
    """The one element of a shape computation (``Gather(Shape(x), i)``, also through Squeeze/Reshape), or None."""
    for _ in range(2):
        elements = dims.elements(t)
        if elements is not None and len(elements[0]) == 1:
            return elements[0][0]
        node = producer(t)
        if node is None or node.op not in ("Squeeze", "Reshape"):
            return None
        t = node.inputs[0]
    return None


# -- cos and sin: one angle computation ----------------------------------------------------------------------------

def _chain(t: Tensor) -> tuple[list[tuple[Node, int]], Tensor]:
    """The nodes from the angle tensor ``t`` back to its root, each with the input followed: through
    :data:`_ANGLE_UNARY` (their data input) and :data:`_ANGLE_SCALAR` ops with a scalar constant operand.
    The root is the first tensor computed otherwise."""
    steps: list[tuple[Node, int]] = []
    for _ in range(_MAX_DEPTH):
        node = producer(t)
        if node is None or (node.domain or "") not in ("", "ai.onnx") or not node.inputs:
            break
        if node.op in _ANGLE_UNARY:
            i = 0
        elif node.op in _ANGLE_SCALAR and len(node.inputs) == 2 and small_const_scalar(node.inputs[1]) is not None:
            i = 0
        elif node.op in _ANGLE_SCALAR and len(node.inputs) == 2 and small_const_scalar(node.inputs[0]) is not None:
            i = 1
        else:
            break
        steps.append((node, i))
        t = node.inputs[i]
    return steps, t


def _same_angles(cos: tuple[list[tuple[Node, int]], Tensor], sin: tuple[list[tuple[Node, int]], Tensor]
                 ) -> Optional[str]:
    """None when sin is cos's computation with Cos replaced by Sin, of the same root (or both from constants)."""
    (cos_steps, cos_root), (sin_steps, sin_root) = cos, sin
    if len(cos_steps) != len(sin_steps):
        return "cos and sin are not computed alike"
    trig = 0
    for (a, i), (b, j) in zip(cos_steps, sin_steps):
        if (a.op, b.op) == ("Cos", "Sin"):
            trig += 1
            continue
        others_a = [t for k, t in enumerate(a.inputs) if k != i]
        others_b = [t for k, t in enumerate(b.inputs) if k != j]
        if a.op != b.op or i != j or a.attrs != b.attrs or len(others_a) != len(others_b) \
                or not all(map(_same_operand, others_a, others_b)):
            return f"cos and sin are not computed alike ({a.op} vs {b.op})"
    if trig == 1 and cos_root is sin_root:
        return None
    if trig == 0 and is_const(cos_root) and is_const(sin_root):
        return None
    return "cos and sin are not the Cos and Sin of the same angles"


def _same_operand(a: Tensor, b: Tensor) -> bool:
    if a is b:
        return True
    if is_const(a) and is_const(b):
        va, vb = small_const_value(a), small_const_value(b)
        return va is not None and vb is not None and va.dtype == vb.dtype and np.array_equal(va, vb)
    return False


def _symmetric(chain: tuple[list[tuple[Node, int]], Tensor], d: int) -> bool:
    """The angle tensor's two halves along the last axis are equal: each step maps the last axis element-wise
    and the root is ``Concat(f, f)`` on the last axis or a constant with equal halves."""
    steps, root = chain
    for node, _ in steps:
        if not _spares_last_axis(node, d):
            return False
    concat = producer(root)
    if concat is not None and concat.op == "Concat" and len(concat.inputs) == 2 \
            and concat.inputs[0] is concat.inputs[1] and root.shape is not None \
            and concat_axis(concat, len(root.shape)) == len(root.shape) - 1:
        return True
    value = small_const_value(root) if is_const(root) else None
    return value is not None and value.ndim >= 1 and value.shape[-1] == d and \
        np.array_equal(value[..., :d // 2], value[..., d // 2:])


def whole_of_half(t: Tensor, d: int) -> Optional[tuple[Tensor, list[Node]]]:
    """``(u, unsqueezes)`` when the half-width angles ``t`` are ``Unsqueeze(...(Slice(u, 0, d/2) on the last
    axis))`` of full-width angles ``u`` proven equal on both halves: ``Concat(t, t)`` is then those Unsqueezes
    (outermost last) of ``u`` itself. The form :mod:`k3opt.modelio.opset23_down` writes for a RotaryEmbedding
    whose cache fuse-rotary sliced from the full-width angles."""
    unsqueezes: list[Node] = []
    node = producer(t)
    while node is not None and node.op == "Unsqueeze" and (node.domain or "") in ("", "ai.onnx"):
        unsqueezes.append(node)
        node = producer(node.inputs[0])
    if node is None or node.op != "Slice" or (node.domain or "") not in ("", "ai.onnx"):
        return None
    u = node.inputs[0]
    if u.shape is None or not u.shape or checks.last_dim(u) != d:
        return None
    rank = len(u.shape)
    values = [small_const_value(x) if i < len(node.inputs) and is_const(x) else None
              for i, x in enumerate(node.inputs[1:5], 1)]
    starts, ends = values[0], values[1]
    axes = values[2] if len(node.inputs) > 3 and not is_empty(node.inputs[3]) else np.array([0] if rank == 1 else [])
    steps = values[3] if len(node.inputs) > 4 and not is_empty(node.inputs[4]) else np.array([1])
    if starts is None or ends is None or axes is None or steps is None or \
            [int(v) for v in np.asarray(starts).reshape(-1)] != [0] or \
            [int(v) for v in np.asarray(ends).reshape(-1)] != [d // 2] or \
            [int(a) % rank for a in np.asarray(axes).reshape(-1)] != [rank - 1] or \
            [int(v) for v in np.asarray(steps).reshape(-1)] != [1]:
        return None
    return (u, unsqueezes[::-1]) if _symmetric(_chain(u), d) else None


def _paired_chain(dims: Dims, t: Tensor, d: int) -> Optional[tuple[list[tuple[Node, int]], Tensor]]:
    """The chain of a full-width angle tensor ``t`` whose pairs ``(2i, 2i+1)`` are proven equal: element-wise
    steps along the last axis of ``repeat_interleave(f, 2)`` (then followed on into ``f``), or of a constant
    with equal pairs; None otherwise."""
    steps, root = _chain(t)
    if not all(_spares_last_axis(node, d) for node, _ in steps):
        return None
    if is_const(root):
        value = small_const_value(root)
        paired = value is not None and value.ndim >= 1 and value.shape[-1] == d \
            and np.array_equal(value[..., 0::2], value[..., 1::2])
        return (steps, root) if paired else None
    half = _repeated(dims, root, d)
    if half is None:
        return None
    below, base = _chain(half)
    return steps + below, base


def _repeated(dims: Dims, t: Tensor, d: int) -> Optional[Tensor]:
    """``f`` when ``t`` is ``repeat_interleave(f, 2)`` along its last axis (of ``d`` elements), as exporters
    write it: ``Reshape(Tile|Expand(Unsqueeze(f, -1), [1, ..., 1, 2]))`` flattening the last two axes."""
    node = producer(t)
    if node is None or node.op != "Reshape" or _last_dim(dims, t) != d or not flattens_last_pair(dims, node):
        return None
    repeat = producer(node.inputs[0])
    if repeat is None or repeat.op not in ("Tile", "Expand") or _repeats_last_axis_only(dims, repeat) != 2:
        return None
    unsqueeze = producer(repeat.inputs[0])
    if unsqueeze is None or unsqueeze.op != "Unsqueeze" or (unsqueeze_axes(unsqueeze, 5) or [])[-1:] != [4]:
        return None
    return unsqueeze.inputs[0]


def _repeats_last_axis_only(dims: Dims, node: Node) -> Optional[int]:
    """How many times a Tile or Expand (of a known-rank input, same rank out) repeats its last axis, when its
    constant repeats/shape are 1 on every other axis (an Expand's input then has a last dim of 1); else None."""
    src = node.inputs[0]
    value = small_const_value(node.inputs[1]) if len(node.inputs) == 2 and is_const(node.inputs[1]) else None
    if value is None or src.shape is None or value.ndim != 1 or value.size != len(src.shape) \
            or any(int(v) != 1 for v in value[:-1]):
        return None
    if node.op == "Expand" and dims.at(src, len(src.shape) - 1) != 1:
        return None
    return int(value[-1])


def _spares_last_axis(node: Node, d: int) -> bool:
    """``node`` (a step of an angle chain) computes each element along the last axis from the same position of
    its followed input, whose last dim is ``d``."""
    if node.op in _ANGLE_SCALAR or node.op in ("Cast", "Cos", "Sin", "Identity"):
        return True
    src = node.inputs[0]
    if src.shape is None or checks.last_dim(src) != d:
        return False
    rank = len(src.shape)
    if node.op == "Gather":
        return concat_axis(node, rank) not in (None, rank - 1)
    if node.op == "Transpose":
        return [int(p) for p in node.attrs.get("perm", ())][-1:] == [rank - 1]
    if node.op == "Unsqueeze":
        axes = unsqueeze_axes(node, rank + len(_raw_axes(node) or []))
        return axes is not None and rank + len(axes) - 1 not in axes
    if node.op == "Slice":
        return _slice_spares(node, rank, rank - 1)
    return node.op in ("Squeeze", "Expand")  # the last dim is d before and after (checked on both sides)


def _slice_spares(node: Node, rank: int, axis: int) -> bool:
    """The Slice (of a rank-``rank`` tensor) leaves axis ``axis`` whole: its constant axes do not include it."""
    if len(node.inputs) < 4 or is_empty(node.inputs[3]):
        starts = small_const_value(node.inputs[1]) if is_const(node.inputs[1]) else None
        return starts is not None and starts.size <= axis
    axes = small_const_value(node.inputs[3]) if is_const(node.inputs[3]) else None
    return axes is not None and all((int(a) + rank if a < 0 else int(a)) != axis for a in axes.reshape(-1))
