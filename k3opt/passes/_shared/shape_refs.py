"""A small integer tensor (a shape) element by element, and what is provable about its elements' sizes.

The attention recogniser reads head-split Reshape targets with it, and the NPU attention lowering names the
same dims the same way: one reading for both.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ...graph import ir
from ...graph.ir import Node, Tensor, producer
from ...graph.small_constants import small_const_value
from ...graph.symbolic.dims import Dims
from ...patterns import checks


def shape_refs(t: Tensor) -> Optional[list]:
    """A small integer tensor (a shape) element by element: ints for constants, ``("dim", x, axis)`` for
    dims of a Shape(x), ``("elem", t, i)`` for an element of anything else (equal only to itself)."""
    value = small_const(t)
    if value is not None:
        return [int(v) for v in value.reshape(-1)] if value.dtype.kind in "iu" and value.size <= 8 else None
    n = producer(t)
    refs = None if n is None else _computed_refs(n)
    if refs is None and ir.const_shape(t) is not None and len(t.shape) <= 1 and math.prod(t.shape) <= 8:
        refs = [("elem", t, i) for i in range(math.prod(t.shape))]
    return refs


def _computed_refs(n: Node) -> Optional[list]:
    """:func:`shape_refs` of the output of ``n``, from its op."""
    if n.op == "Concat" and int(n.attrs.get("axis", 0)) in (0, -1):
        parts = [shape_refs(i) for i in n.inputs]
        return None if any(p is None for p in parts) else [e for p in parts for e in p]
    if n.op == "Shape":
        r = checks.rank(n.inputs[0])
        if r is None:
            return None
        start, end = int(n.attrs.get("start", 0)), n.attrs.get("end")
        axes = range(r)[slice(start, None if end is None else int(end))]
        return [("dim", n.inputs[0], a) for a in axes]
    if n.op == "Slice" and len(n.inputs) in (3, 4) and (len(n.inputs) < 4 or small_ints(n.inputs[3]) == [0]):
        src, starts, ends = shape_refs(n.inputs[0]), small_ints(n.inputs[1]), small_ints(n.inputs[2])
        if src is None or starts is None or ends is None or len(starts) != 1 or len(ends) != 1:
            return None
        return src[slice(max(starts[0], -len(src) - 1), min(ends[0], len(src)))]
    if n.op == "Gather" and int(n.attrs.get("axis", 0)) == 0:
        src, idx = shape_refs(n.inputs[0]), small_ints(n.inputs[1])
        return None if src is None or idx is None or len(idx) != 1 or not -len(src) <= idx[0] < len(src) \
            else [src[idx[0]]]
    if n.op in ("Unsqueeze", "Reshape", "Squeeze") and len(n.outputs[0].shape or (0, 0)) <= 1:
        return shape_refs(n.inputs[0])  # a 0-D or 1-D result has the elements in their order
    if n.op == "Where":  # TorchScript's expand target: Where(Equal(shape, -1), 1, shape), the Equal folded
        cond, parts = small_const(n.inputs[0]), [shape_refs(i) for i in n.inputs[1:]]
        if cond is None or cond.ndim != 1 or any(p is None or len(p) not in (1, cond.size) for p in parts):
            return None
        pick = [p * cond.size if len(p) == 1 else p for p in parts]
        return [pick[0][i] if c else pick[1][i] for i, c in enumerate(cond.tolist())]
    return None


def small_const(t: Tensor) -> Optional[np.ndarray]:
    """The value of a small constant (decoded once per process), else None."""
    c = ir.const_tensor(t)
    return None if c is None or math.prod(c.shape) > 64 else small_const_value(t)


def small_ints(t: Tensor) -> Optional[list[int]]:
    """The elements of a small integer constant, else None."""
    value = small_const(t)
    return None if value is None or value.dtype.kind not in "iu" else [int(v) for v in value.reshape(-1)]


def is_dim_of(dims: Dims, ref: object, x: Tensor, axis: int) -> bool:
    """``ref`` (from :func:`shape_refs`) is dim ``axis`` of ``x``: read from ``x``'s shape, or equal to it as a
    number or a symbol (equal ``dim_param`` names are equal sizes) as ``dims`` traces them."""
    return same_size(dims, ref, ("dim", x, axis))


def same_size(dims: Dims, a: object, b: object) -> bool:
    """Two :func:`shape_refs` elements are provably the same size: one element of one tensor, or equal
    numbers or symbols (equal ``dim_param`` names are equal sizes)."""
    if isinstance(a, tuple) and isinstance(b, tuple) and a[0] == b[0] and a[1] is b[1] and a[2] == b[2]:
        return True
    a, b = ref_size(dims, a), ref_size(dims, b)
    return a is not None and a == b and not (isinstance(a, int) and a < 0)


def ref_size(dims: Dims, ref: object) -> object:
    """What is known of a ref's size: a number, a symbol, or None."""
    if isinstance(ref, tuple):
        return dims.at(ref[1], ref[2]) if ref[0] == "dim" else None
    return ref
