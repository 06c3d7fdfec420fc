"""remove-noop-ops: nodes whose output provably equals their data input.

Each check proves the output has the input's shape, dtype and values:

- ``Reshape`` to the input's own shape (dim by dim: a literal equal known dim,
  a 0 copying the dim when ``allowzero`` is off, at most one -1, or a
  target element computed from a shape that is the same symbol as the
  input's dim, as in ``Reshape(x, [dim0(x), -1, dim2(x), 8])``); and a
  ``Reshape`` of a Reshape/Squeeze/Unsqueeze/Flatten of x back to x's own
  shape (the pair undoes itself: x replaces the result);
- ``Expand`` whose shape broadcasts to the input's own shape (a constant, or a
  shape computation whose elements are 1 or the input's own dims, symbols
  included: ``Expand(x, Shape(x))``); ``Tile`` with every repeat 1;
- ``Transpose`` with the identity permutation;
- ``Cast``/``CastLike`` to the type the input already has;
- ``Slice`` taking everything: on a dim of known size, the indices it takes are
  the dim's, in order (a step of -1 over a dim of size 1 included); on another
  dim, step 1, start 0 and the INT64 max sentinel as end;
- ``Clip`` with neither bound (no min/max, or empty optional inputs);
- ``Concat`` of a single input;
- ``Flatten`` of a 2-D input at axis 1 (the opset-13 Softmax conversion wraps one);
- ``Add``/``Sub`` of 0, ``Mul``/``Div`` by 1 (``Sub``/``Div``: constant on the
  right only), only when broadcasting the constant cannot change the
  output's shape (every constant dim is 1 or equals the known input dim,
  constant rank not above the input's).

Refused whenever a needed shape or dtype is unknown.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import numpy as np

from ...graph.ir import Graph, Node, Tensor, const_tensor, producer, rank
from ...pipeline.pass_base import PassContext
from ...graph.small_constants import small_const_value, small_int_list
from ...graph.dtypes import onnx_type
from ...graph.symbolic.dims import Dims
from .._rewire import NodeRewritePass, bypass, cast_target

INT64_MAX = np.iinfo(np.int64).max
#: Constants bigger than this are not read to look for an all-0/all-1 operand.
MAX_NEUTRAL_ELEMENTS = 1 << 16


def _known(d: object) -> bool:
    return isinstance(d, (int, np.integer)) and d >= 0


#: Ops that only regroup the dims: their output holds the input's elements in the same order.
REGROUPING = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten"})


def _same_reshape(dims: Dims, node: Node) -> Optional[Tensor]:
    """The Reshape's input when the target is its own shape; else, when the input merely regroups
    some x (Reshape/Squeeze/Unsqueeze/Flatten), x when the target is x's shape (the pair undoes itself)."""
    x = node.inputs[0]
    if _reshapes_to(dims, node, x):
        return x
    src = producer(x)
    if src is not None and src.op in REGROUPING and (src.domain or "") in ("", "ai.onnx") and src.inputs:
        return src.inputs[0] if _reshapes_to(dims, node, src.inputs[0]) else None
    return None


def _reshapes_to(dims: Dims, node: Node, t: Tensor) -> bool:
    """True when Reshape ``node``'s target is exactly ``t``'s shape, element by element (a literal equal
    known dim, the same symbol, a 0 copying an equal dim of the Reshape's input, at most one -1).

    The output's known rank is the target's length: when it is not ``t``'s, the target is not traced (most
    Reshapes change the rank; tracing their targets' dims was most of this pass's time)."""
    out = node.outputs[0].shape
    if t.shape is None or (out is not None and len(out) != len(t.shape)):
        return False
    elements = dims.elements(node.inputs[1])
    if elements is None or len(elements[0]) != len(t.shape) or elements[0].count(-1) > 1:
        return False
    copy = not node.attrs.get("allowzero", 0)
    x = node.inputs[0]
    for i, s in enumerate(elements[0]):  # dims are traced only where the element does not decide alone
        if s == 0 and copy:
            if t is x:
                continue
            s = dims.at(x, i)
        if s != -1 and (s is None or s != dims.at(t, i)):
            return False
    return True


def _broadcast_keeps_shape(x: Tensor, other_shape: tuple) -> bool:
    """Broadcasting ``x`` with a tensor of ``other_shape`` yields ``x``'s shape."""
    if x.shape is None or len(other_shape) > len(x.shape):
        return False
    aligned = x.shape[len(x.shape) - len(other_shape):]
    return all(o == 1 or (_known(d) and o == d) for o, d in zip(other_shape, aligned))


def _same_expand(dims: Dims, node: Node) -> Optional[Tensor]:
    """An Expand to a shape ``x`` already has: a constant that broadcasts onto ``x``'s known dims, or a shape
    computation (``Shape(x)``, pieces of it) whose every element is 1 or ``x``'s dim there (symbols too)."""
    target = small_int_list(node.inputs[1])
    x = node.inputs[0]
    if target is not None:
        return x if _broadcast_keeps_shape(x, tuple(target)) else None
    elements = dims.elements(node.inputs[1])
    if x.shape is None or elements is None or len(elements[1]) != 1 or len(elements[0]) > len(x.shape):
        return None
    lead = len(x.shape) - len(elements[0])
    same = all(e == 1 or (e is not None and e == dims.at(x, lead + i)) for i, e in enumerate(elements[0]))
    return x if same else None


def _same_tile(dims: Dims, node: Node) -> Optional[Tensor]:
    """A Tile whose repeats are all 1."""
    repeats = small_int_list(node.inputs[1]) if len(node.inputs) > 1 else None
    return node.inputs[0] if repeats is not None and all(r == 1 for r in repeats) else None


def _identity_transpose(dims: Dims, node: Node) -> Optional[Tensor]:
    x = node.inputs[0]
    perm = node.attrs.get("perm")
    if perm is None:
        r = rank(x)
        return x if r is not None and r <= 1 else None
    return x if list(perm) == list(range(len(perm))) else None


def _same_cast(dims: Dims, node: Node) -> Optional[Tensor]:
    x = node.inputs[0]
    src = onnx_type(x.dtype)
    dst = cast_target(node) if node.op == "Cast" else onnx_type(node.inputs[1].dtype)
    return x if src is not None and src == dst else None


def _slice_args(node: Node) -> Optional[list[Optional[list[int]]]]:
    """[starts, ends, axes, steps] as int lists (None for omitted optional ones), or None if not constant."""
    if "starts" in node.attrs:  # opset < 10: attributes
        return [node.attrs.get(k) for k in ("starts", "ends", "axes")] + [None]
    args: list[Optional[list[int]]] = []
    for i in range(1, 5):
        t = node.inputs[i] if i < len(node.inputs) else None
        v = small_int_list(t) if t is not None and t.name else None
        if v is None and (i < 3 or (t is not None and t.name)):
            return None
        args.append(v)
    return args


def _whole_slice(dims: Dims, node: Node) -> Optional[Tensor]:
    x = node.inputs[0]
    args = None if x.shape is None else _slice_args(node)
    if args is None or args[0] is None or args[1] is None:
        return None
    starts, ends, axes, steps = args
    axes = axes if axes is not None else list(range(len(starts)))
    steps = steps if steps is not None else [1] * len(starts)
    r = len(x.shape)
    for s, e, a, st in zip(starts, ends, axes, steps):
        if not -r <= a < r:
            return None
        d = x.shape[a]
        if _known(d) and st != 0:
            if _taken(int(s), int(e), int(st), int(d)) != range(int(d)):
                return None
        elif st != 1 or s != 0 or not e >= INT64_MAX // 2:
            return None
    return x


def _taken(start: int, end: int, step: int, n: int) -> range:
    """The indices a Slice takes of a dim of size ``n`` (ONNX clamping; a step of -1 over a dim of 1 takes
    all of it, in the one order there is)."""
    start, end = start + n if start < 0 else start, end + n if end < 0 else end
    if step > 0:
        start, end = min(max(start, 0), n), min(max(end, 0), n)
    else:
        start, end = min(max(start, -1), n - 1), min(max(end, -1), n - 1)
    taken = range(start, end, step)
    return range(n) if step < 0 and len(taken) == n == 1 else taken


def _unbounded_clip(dims: Dims, node: Node) -> Optional[Tensor]:
    """A Clip with neither bound (no min/max inputs, or empty ones; no attributes before opset 11)."""
    bounded = any(k in node.attrs for k in ("min", "max")) or any(t.name for t in node.inputs[1:])
    return None if bounded else node.inputs[0]


def _same_flatten(dims: Dims, node: Node) -> Optional[Tensor]:
    """A Flatten of a 2-D tensor at axis 1 (or -1): ``(d0, d1)`` is already its own flattening."""
    x = node.inputs[0]
    return x if rank(x) == 2 and int(node.attrs.get("axis", 1)) in (1, -1) else None


def _single_concat(dims: Dims, node: Node) -> Optional[Tensor]:
    return node.inputs[0] if len(node.inputs) == 1 else None


_NEUTRAL = {"Add": 0, "Sub": 0, "Mul": 1, "Div": 1}


def _neutral_arith(dims: Dims, node: Node) -> Optional[Tensor]:
    if len(node.inputs) != 2:
        return None
    sides = [(0, 1), (1, 0)] if node.op in ("Add", "Mul") else [(0, 1)]
    for xi, ci in sides:
        x, c = node.inputs[xi], const_tensor(node.inputs[ci])
        if c is None or math.prod(c.shape) > MAX_NEUTRAL_ELEMENTS or not _broadcast_keeps_shape(x, tuple(c.shape)):
            continue  # decided from the shape alone: a big weight is never read here
        v = np.asarray(small_const_value(c))  # a small one decoded once per process
        if v.dtype.kind in "fiu" and (v == _NEUTRAL[node.op]).all():
            return x
    return None


#: What each op's check reads: the run's dims of the graph and the node; the tensor the node returns unchanged.
CHECKS: dict[str, Callable[[Dims, Node], Optional[Tensor]]] = {
    "Reshape": _same_reshape,
    "Expand": _same_expand,
    "Tile": _same_tile,
    "Transpose": _identity_transpose,
    "Cast": _same_cast,
    "CastLike": _same_cast,
    "Slice": _whole_slice,
    "Clip": _unbounded_clip,
    "Concat": _single_concat,
    "Flatten": _same_flatten,
    **{op: _neutral_arith for op in _NEUTRAL},
}


class RemoveNoopOps(NodeRewritePass):
    name = "remove-noop-ops"
    description = "Remove nodes that provably return their input unchanged."
    order = 220
    ops = frozenset(CHECKS)

    def rewrite(self, graph: Graph, node: Node, ctx: PassContext, dead: list[Node]) -> bool:
        src = CHECKS[node.op](ctx.dims(graph), node)
        if src is None:
            return False
        return bypass(graph, node, src, dead)
