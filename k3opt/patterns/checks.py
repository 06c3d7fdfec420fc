"""Helpers for rule checks: constant values, static shapes, "vector over the last axis", reduce axes.

Each helper answers conservatively: when a fact cannot be established
statically (unknown shape, non-constant axes) the answer is "no", so a check
built from them declines rather than rewrites unsafely.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np
from onnx import TensorProto

from ..graph import dtypes
from ..graph.ir import Node, Tensor
# The graph's constant readers, under the names rules use (docs/writing-rules.md): the same functions.
from ..graph.ir import const_scalar, const_value, rank
from ..graph.ir import const_shape as static_shape
from .matcher import is_empty

#: ``reduce_axes`` result for a reduction over every axis (axes omitted, noop_with_empty_axes=0).
ALL = "all"


def last_dim(t: Tensor) -> Optional[int]:
    """The static size of the last axis (None if rank or that dim is unknown)."""
    if not t.shape:
        return None
    d = t.shape[-1]
    return int(d) if isinstance(d, (int, np.integer)) and d >= 0 else None


def is_float(t: Tensor) -> bool:
    """True when ``t``'s element type is known and floating point (bfloat16 and float8, which gs gives as
    ONNX enums, included)."""
    elem = dtypes.onnx_type(t.dtype)
    if elem is None:
        return False
    name = TensorProto.DataType.Name(elem)
    return name.startswith("FLOAT") or name in ("DOUBLE", "BFLOAT16")


def single_consumer(t: Tensor) -> bool:
    return len(t.outputs) == 1


def vector_over_last_axis(t: Tensor, x: Tensor) -> bool:
    """``t`` is a 1-D tensor (leading 1s allowed) whose length is ``x``'s static last dim.

    Such a ``t`` multiplies/adds along ``x``'s last axis without changing
    ``x``'s shape (its rank is at most ``x``'s): exactly LayerNorm's scale/bias.
    """
    ts, xr, xl = static_shape(t), rank(x), last_dim(x)
    if not ts or xr is None or xl is None or len(ts) > xr:
        return False
    return all(d == 1 for d in ts[:-1]) and ts[-1] == xl


def broadcasts_into(t: Tensor, x: Tensor) -> bool:
    """Broadcasting ``t`` against ``x`` leaves ``x``'s shape unchanged (checked on static dims)."""
    ts, xs = static_shape(t), x.shape
    if ts is None or xs is None or len(ts) > len(xs):
        return False
    for dt, dx in zip(reversed(ts), reversed(xs)):
        if dt != 1 and not (isinstance(dx, (int, np.integer)) and dx == dt):
            return False
    return True


def reduce_axes(node: Node) -> Union[tuple[int, ...], str, None]:
    """The axes a Reduce* node reduces, as written: from the ``axes`` attribute (older opsets) or the
    constant ``axes`` input (ReduceSum >= 13, the others >= 18).

    Returns ``()`` when it reduces nothing (axes empty and noop_with_empty_axes=1),
    :data:`ALL` when it reduces every axis, None when the axes are not constant.
    """
    axes: Optional[Sequence[int]]
    if "axes" in node.attrs:
        axes = list(node.attrs["axes"])
    elif len(node.inputs) > 1 and not is_empty(node.inputs[1]):
        value = const_value(node.inputs[1])
        if value is None:
            return None
        axes = value.reshape(-1).tolist()
    else:
        axes = []
    if not axes:
        return () if node.attrs.get("noop_with_empty_axes", 0) else ALL
    return tuple(int(a) for a in axes)


def normalized_axes(axes: Sequence[int], data_rank: int) -> Optional[tuple[int, ...]]:
    """Axes made non-negative and sorted; None if one is out of range."""
    out = sorted(a + data_rank if a < 0 else a for a in axes)
    return tuple(out) if all(0 <= a < data_rank for a in out) and len(set(out)) == len(out) else None


def reduces_trailing_axes(node: Node, count: int = 1) -> bool:
    """The Reduce* node reduces exactly the last ``count`` axes of its input, however it is written.

    With the input rank known, positive and negative axes are compared after
    normalization (and "all axes" counts when rank == count); with the rank
    unknown, only negative axes -count..-1 can be proven trailing.
    """
    axes = reduce_axes(node)
    if axes is None or axes == ():
        return False
    data_rank = rank(node.inputs[0])
    if axes == ALL:
        return data_rank == count
    if data_rank is None:
        return sorted(axes) == list(range(-count, 0))
    return normalized_axes(axes, data_rank) == tuple(range(data_rank - count, data_rank))
