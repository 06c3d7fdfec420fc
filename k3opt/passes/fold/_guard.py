"""The size guard of fold-constants: never fold what blows the model up.

``Expand``, ``Tile``, ``ConstantOfShape`` and ``Range`` make big tensors from
small ones (a causal mask from a scalar). Folding them would store the big
tensor in the model. The guard predicts their output size from the constant
inputs, before anything is computed, and refuses when the result grows the
model by more than ``fold_max_bytes`` (net: output bytes less the bytes of
the data input it replaces) or has more than ``fold_max_elements`` elements
while being larger than its input; unless every consumer only reads the
shape (then the big tensor never reaches the model).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import numpy as np

from ...graph.ir import Node, Tensor, const_shape, peek
from ...graph.symbolic.values import shape_only_uses

DEFAULT_MAX_BYTES = 1 << 20
DEFAULT_MAX_ELEMENTS = 1 << 20
GROWING_OPS = ("Expand", "Tile", "ConstantOfShape", "Range")

Values = Callable[[Tensor], Optional[np.ndarray]]


def _itemsize(node: Node) -> int:
    """Bytes per element of the output (ConstantOfShape: its ``value``; others: their data input)."""
    if node.op == "ConstantOfShape":
        fill = node.attrs.get("value")
        return peek(fill).dtype.itemsize if fill is not None else 4
    dtype = node.inputs[0].dtype
    try:
        return np.dtype(dtype).itemsize if dtype is not None else 4
    except TypeError:
        return 4


def predicted_elements(node: Node, value: Values) -> Optional[tuple[int, int]]:
    """(output elements, data-input elements) of a growing op, or None when it cannot tell."""
    out_shape = const_shape(node.outputs[0])
    op = node.op
    if op == "ConstantOfShape":
        shape = value(node.inputs[0])
        dims = None if shape is None else [int(d) for d in np.asarray(shape).ravel()]
        if dims is None or any(d < 0 for d in dims):
            return None
        return math.prod(dims), 1  # Python ints: an int64 product of huge dims wraps (to 0 for 2**32 x 2**32)
    data = node.inputs[0]
    data_shape = const_shape(data)
    if op == "Range":
        vals = [value(t) for t in node.inputs[:3]]
        if any(v is None for v in vals):
            return None
        start, limit, delta = (np.asarray(v).item() for v in vals)
        if delta == 0:
            return None
        count = (limit - start) / delta
        if not math.isfinite(count):  # an infinite or NaN bound: math.ceil would raise
            return None
        return max(math.ceil(count), 0), 0
    if data_shape is None:
        return None
    if out_shape is not None:
        return math.prod(out_shape), math.prod(data_shape)
    other = value(node.inputs[1]) if len(node.inputs) > 1 else None
    if other is None:
        return None
    other = [int(v) for v in np.asarray(other).ravel()]
    if op == "Expand":
        try:
            shape = np.broadcast_shapes(data_shape, tuple(other))
        except ValueError:
            return None
        return math.prod(shape), math.prod(data_shape)
    if op == "Tile" and len(other) == len(data_shape):
        return math.prod(d * r for d, r in zip(data_shape, other)), math.prod(data_shape)
    return None


def too_big(node: Node, value: Values, options: dict[str, Any]) -> bool:
    """True when folding ``node`` (a growing op) would grow the model past the configured limits.

    Undecidable sizes count as too big: the guard errs on the side of not folding.
    """
    if node.op not in GROWING_OPS or shape_only_uses(node.outputs[0]):
        return False
    sizes = predicted_elements(node, value)
    if sizes is None:
        return True
    out_elems, in_elems = sizes
    if out_elems <= in_elems:
        return False
    item = _itemsize(node)
    max_bytes = int(options.get("fold_max_bytes", DEFAULT_MAX_BYTES))
    max_elems = int(options.get("fold_max_elements", DEFAULT_MAX_ELEMENTS))
    return (out_elems - in_elems) * item > max_bytes or out_elems > max_elems
