"""Shape computations that fold from inferred shapes, without the data.

``Shape(x)`` (with ``start``/``end``) and ``Size(x)`` become constants when
the dims they read are statically known; ``Gather(Shape(x), i)`` and
``Slice(Shape(x), ...)`` fold when only the selected dims are known (the
common "batch is dynamic, hidden size is not" case). Everything downstream
then folds as ordinary constants.

``Equal`` of a shape computation (``Shape``, ``Gather``/``Slice`` of it,
``Unsqueeze`` of a scalar, ``Concat`` of 1-D pieces, small integer
constants) with another folds when every element pair is decided: two known
numbers compare, and an unknown dim (never negative) differs from any
negative number. This is TorchScript's ``expand`` spelling
``Where(Equal(shape, -1), 1, shape)``, whose ``Equal`` is all known even
when the batch and sequence are not.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..ir import Node, Tensor, const_value, producer


def _dim(d: object) -> Optional[int]:
    return int(d) if isinstance(d, (int, np.integer)) and d >= 0 else None


def shape_dims(node: Node) -> Optional[list[Optional[int]]]:
    """The dims a ``Shape`` node returns, None for unknown ones; None when the rank is unknown."""
    shape = node.inputs[0].shape
    if shape is None:
        return None
    dims = [_dim(d) for d in shape]
    n = len(dims)
    start = int(node.attrs.get("start", 0))
    end = node.attrs.get("end")
    start = min(max(start + n if start < 0 else start, 0), n)
    end = n if end is None else min(max(int(end) + n if end < 0 else int(end), 0), n)
    return dims[start:end]


def fold_shape_value(node: Node) -> Optional[np.ndarray]:
    """The constant value of a Shape/Size/Gather-of-Shape/Slice-of-Shape node, if its dims are known."""
    if node.op == "Shape":
        dims = shape_dims(node)
        if dims is None or any(d is None for d in dims):
            return None
        return np.array(dims, dtype=np.int64)
    if node.op == "Size":
        shape = node.inputs[0].shape
        dims = None if shape is None else [_dim(d) for d in shape]
        if dims is None or any(d is None for d in dims):
            return None
        return np.array(int(np.prod(dims, dtype=np.int64)), dtype=np.int64)
    if node.op in ("Gather", "Slice") and node.inputs:
        picked = _picked_dims(node)
        if picked is None or any(d is None for d in picked[0]):
            return None
        return np.array(picked[0], dtype=np.int64).reshape(picked[1])
    if node.op == "Equal" and len(node.inputs) == 2:
        return _fold_equal(node)
    return None


def _picked_dims(node: Node) -> Optional[tuple[list[Optional[int]], tuple[int, ...]]]:
    """The dims a Gather/Slice of a ``Shape`` picks (None for unknown ones) and the result's shape."""
    src = producer(node.inputs[0])
    if src is None or src.op != "Shape":
        return None
    dims = shape_dims(src)
    if dims is None:
        return None
    picked = _gather(node, len(dims)) if node.op == "Gather" else _slice(node, len(dims))
    if picked is None:
        return None
    return [dims[i] for i in picked.ravel()], picked.shape


#: Longest integer constant read as part of a shape computation.
MAX_SHAPE_ELEMENTS = 64
#: How many producers deep :func:`shape_elements` looks.
MAX_SHAPE_DEPTH = 8

#: Elements of a shape computation (None: a dim known only to be >= 0) and its tensor shape.
Elements = tuple[list[Optional[int]], tuple[int, ...]]


def shape_elements(t: Tensor, depth: int = MAX_SHAPE_DEPTH) -> Optional[Elements]:
    """What is known of a small integer tensor computed from shapes, element by element.

    Known elements are ints; None marks a dim of some tensor, unknown but
    never negative. None as a whole when ``t`` is not such a computation.
    """
    v = const_value(t)
    if v is not None:
        v = np.asarray(v)
        if v.dtype.kind not in "iu" or v.ndim > 1 or v.size > MAX_SHAPE_ELEMENTS:
            return None
        return [int(x) for x in v.ravel()], v.shape
    node = producer(t)
    if node is None or depth <= 0 or (node.domain or "") not in ("", "ai.onnx") or not node.inputs:
        return None
    if node.op == "Shape":
        dims = shape_dims(node)
        return None if dims is None else (dims, (len(dims),))
    if node.op in ("Gather", "Slice"):
        return _picked_dims(node)
    if node.op == "Unsqueeze":
        inner = shape_elements(node.inputs[0], depth - 1)
        axes = _unsqueeze_axes(node)
        if inner is None or inner[1] != () or axes not in ([0], [-1]):
            return None
        return inner[0], (1,)
    if node.op == "Concat" and int(node.attrs.get("axis", 0)) in (0, -1):
        parts = [shape_elements(x, depth - 1) for x in node.inputs]
        if any(p is None or len(p[1]) != 1 for p in parts):
            return None
        elements = [e for p in parts for e in p[0]]
        return elements, (len(elements),)
    return None


def _unsqueeze_axes(node: Node) -> Optional[list[int]]:
    if "axes" in node.attrs:
        return [int(a) for a in node.attrs["axes"]]
    axes = const_value(node.inputs[1]) if len(node.inputs) > 1 else None
    return None if axes is None else [int(a) for a in np.asarray(axes).ravel()]


def _fold_equal(node: Node) -> Optional[np.ndarray]:
    """``Equal`` of two same-shaped shape computations, when every element pair is decided."""
    a, b = (shape_elements(x) for x in node.inputs)
    if a is None or b is None or a[1] != b[1]:
        return None
    out = []
    for x, y in zip(a[0], b[0]):
        known = y if x is None else x
        if x is not None and y is not None:
            out.append(x == y)
        elif known is not None and known < 0:
            out.append(False)
        else:
            return None
    return np.array(out, dtype=bool).reshape(a[1])


def _gather(node: Node, n: int) -> Optional[np.ndarray]:
    idx = const_value(node.inputs[1]) if len(node.inputs) > 1 else None
    if idx is None or int(node.attrs.get("axis", 0)) not in (0, -1):
        return None
    idx = np.asarray(idx).astype(np.int64)
    if np.any(idx < -n) or np.any(idx >= n):
        return None
    return np.where(idx < 0, idx + n, idx)


def _slice(node: Node, n: int) -> Optional[np.ndarray]:
    if len(node.inputs) < 3:
        return None
    vals = [const_value(t) for t in node.inputs[1:]]
    if any(v is None for v in vals[:2]) or any(
        v is None and t.name for v, t in zip(vals[2:], node.inputs[3:])
    ):
        return None
    starts, ends = (np.asarray(v).ravel() for v in vals[:2])
    axes = np.asarray(vals[2]).ravel() if len(vals) > 2 and vals[2] is not None else np.array([0])
    steps = np.asarray(vals[3]).ravel() if len(vals) > 3 and vals[3] is not None else np.ones(1, np.int64)
    if starts.size != 1 or ends.size != 1 or axes.size != 1 or steps.size != 1 or int(axes[0]) not in (0, -1):
        return None
    step = int(steps[0])
    if step == 0:
        return None
    start, end = _clamp(int(starts[0]), n, step), _clamp(int(ends[0]), n, step)
    return np.arange(n)[slice(start, end if end >= 0 else None, step)]


def _clamp(v: int, n: int, step: int) -> int:
    """ONNX Slice index clamping (INT64 min/max sentinels included)."""
    if v < 0:
        v += n
    if step > 0:
        return min(max(v, 0), n)
    return min(max(v, -1), n - 1)


def is_shape_consumer(node: Node) -> bool:
    """Ops that read only the shape of their input (their results ignore the data)."""
    return node.op in ("Shape", "Size")


def shape_only_uses(t: Tensor) -> bool:
    """True when every consumer of ``t`` reads only its shape."""
    return bool(t.outputs) and all(is_shape_consumer(n) for n in t.outputs)
