"""Shape values element by element: what is known of a small integer tensor computed from shapes.

:func:`elements` evaluates ``Shape``, ``Size``, ``Gather``, ``Slice``, ``Concat``, ``Unsqueeze``, ``Squeeze``,
``Cast`` (to an integer type), ``ReduceProd``, ``Reshape`` (to one dim or a scalar) and ``Add``/``Sub``/
``Mul``/``Div`` of such values (:data:`ELEMENTS`), exactly: an element is a number, or a dim (a symbol, or
None when unknown; never negative), and what is not exactly known (a dim less a number, an inexact division)
makes the whole value unknown.

:func:`fold` gives the constant value of a ``Shape``/``Size`` node whose dims are known, of a
``Gather``/``Slice`` of a shape when the dims it picks are (the common "batch is dynamic, hidden size is not"
case), and of an ``Equal`` of two shape values when every element pair is decided: two known numbers
compare, a symbol equals itself, and an unknown dim (never negative) differs from any negative number. This
is TorchScript's ``expand`` spelling ``Where(Equal(shape, -1), 1, shape)``, whose ``Equal`` is all known
even when the batch and sequence are not.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence

import numpy as np

from ..ir import Node, Tensor, as_int_list, const_tensor, producer
from .algebra import Dim, Elements, as_dim, dim_product, dim_sum, factors, known, quotient

if TYPE_CHECKING:
    from .dims import Dims

#: Longest integer constant read as part of a shape computation.
MAX_SHAPE_ELEMENTS = 64
#: ONNX integer element types (TensorProto codes): a Cast of a shape computation to one keeps its elements.
_INTEGER_TYPES = frozenset({2, 3, 4, 5, 6, 7, 12, 13})

#: ``(dims, node, depth) -> elements`` of the node's output, its inputs read at ``depth - 1``.
Evaluator = Callable[["Dims", Node, int], Optional[Elements]]
#: Positions a Gather/Slice picks from a 1-D value, flat, and the result's shape.
Picked = tuple[list[int], tuple[int, ...]]


def elements(dims: Dims, t: Tensor, depth: int) -> Optional[Elements]:
    """What is known of ``t``, a small integer tensor computed from shapes (see :meth:`Dims.elements`)."""
    c = const_tensor(t)
    if c is not None and not _may_be_shape(c):
        return None  # told by its dtype and shape alone: a weight's data is never read here
    v = dims.const(t)
    if v is not None:
        v = np.asarray(v)
        if v.dtype.kind not in "iu" or v.ndim > 1 or v.size > MAX_SHAPE_ELEMENTS:
            return None
        return [int(x) for x in v.ravel()], v.shape
    node = producer(t)
    if node is not None:
        dims.depth_test(depth)
    if node is None or depth <= 0 or (node.domain or "") not in ("", "ai.onnx") or not node.inputs:
        return None
    evaluate = ELEMENTS.get(node.op)
    return None if evaluate is None else evaluate(dims, node, depth)


def _may_be_shape(c) -> bool:
    """Could constant ``c`` be a shape computation's elements (integer, rank <= 1, at most
    :data:`MAX_SHAPE_ELEMENTS`)? Asked of its metadata, before any data is read."""
    shape = c.shape
    if shape is None or len(shape) > 1 or (shape and not isinstance(shape[0], int)):
        return False
    if shape and shape[0] > MAX_SHAPE_ELEMENTS:
        return False
    try:
        return np.dtype(c.dtype).kind in "iu"
    except TypeError:  # None, or a type numpy lacks (bfloat16, 4-bit...): not a shape
        return False


def _shape(dims: Dims, node: Node, depth: int) -> Optional[Elements]:
    found = shape_node_dims(dims, node, depth - 1)
    return None if found is None else (found, (len(found),))


def _picked(dims: Dims, node: Node, depth: int) -> Optional[Elements]:
    """A Gather/Slice of a ``Shape`` (only the dims it picks are traced), else of any 1-D shape value."""
    return picked_dims(dims, node, depth - 1) or _picked_elements(dims, node, depth - 1)


def _unsqueezed(dims: Dims, node: Node, depth: int) -> Optional[Elements]:
    """An Unsqueeze of a scalar to one element."""
    inner = dims.elements(node.inputs[0], depth - 1)
    for x in node.inputs[1:]:
        dims.read(x)  # the axes
    # the axes (attribute before opset 13), an axes input read through the remembered small values
    axes = ([int(a) for a in node.attrs["axes"]] if "axes" in node.attrs else
            None if len(node.inputs) < 2 else as_int_list(dims.const(node.inputs[1])))
    if inner is None or inner[1] != () or axes not in ([0], [-1]):
        return None
    return inner[0], (1,)


def _reshaped(dims: Dims, node: Node, depth: int) -> Optional[Elements]:
    """A Reshape of a shape computation to one dim (``[-1]`` or its length) or to a scalar: same elements.

    TorchScript reshapes the pieces of an ``expand`` target so (``Reshape(Concat(...), [-1])``) before
    the ``Equal(shape, -1)``; without this the Equal folds only once remove-noop-ops has dropped the
    Reshape, a fixed-point round later.
    """
    if len(node.inputs) != 2:
        return None
    inner = dims.elements(node.inputs[0], depth - 1)
    to = as_int_list(dims.const(node.inputs[1]))
    if inner is None or to is None:
        return None
    n = len(inner[0])
    if to in ([-1], [n]):
        return inner[0], (n,)
    if to == [] and n == 1:
        return inner[0], ()
    return None


def _cast(dims: Dims, node: Node, depth: int) -> Optional[Elements]:
    """A Cast to an integer type keeps the elements (tf2onnx computes shapes in int32)."""
    return dims.elements(node.inputs[0], depth - 1) if node.attrs.get("to") in _INTEGER_TYPES else None


def _squeezed(dims: Dims, node: Node, depth: int) -> Optional[Elements]:
    """A Squeeze of one element to a scalar."""
    inner = dims.elements(node.inputs[0], depth - 1)
    return (inner[0], ()) if inner is not None and inner[1] == (1,) else None


def _size(dims: Dims, node: Node, depth: int) -> Optional[Elements]:
    """``Size(x)``: the product of x's dims, when none is unknown."""
    found = dims.complete(node.inputs[0], depth - 1)
    product = None if found is None else dim_product(*factors(found))
    return None if product is None else ([product], ())


def _concat(dims: Dims, node: Node, depth: int) -> Optional[Elements]:
    """A Concat of 1-D shape values."""
    if int(node.attrs.get("axis", 0)) not in (0, -1):
        return None
    parts = [dims.elements(x, depth - 1) for x in node.inputs]
    if any(p is None or len(p[1]) != 1 for p in parts):
        return None
    joined = [e for p in parts for e in p[0]]
    return joined, (len(joined),)


def _picked_elements(dims: Dims, node: Node, depth: int) -> Optional[Elements]:
    """A Gather/Slice of any 1-D shape computation (a ``Cast`` of a ``Shape``, a ``Concat``...): the picked
    elements. tf2onnx computes shapes in int32 and picks from the cast."""
    src = dims.elements(node.inputs[0], depth)
    if src is None or len(src[1]) != 1:
        return None
    picked = _positions(dims, node, len(src[0]))
    return None if picked is None else ([src[0][i] for i in picked[0]], picked[1])


def _product(dims: Dims, node: Node, depth: int) -> Optional[Elements]:
    """``ReduceProd`` of a 1-D shape computation over its only axis: the product of the dims
    (:func:`~.algebra.dim_product`), when none is unknown or negative."""
    inner = dims.elements(node.inputs[0], depth - 1)
    if len(node.inputs) > 1 and node.inputs[1].name:
        axes = as_int_list(dims.const(node.inputs[1]))
    else:
        axes = node.attrs.get("axes")
        if axes is None and node.attrs.get("noop_with_empty_axes", 0):
            return None
    if inner is None or len(inner[1]) != 1 or (axes is not None and list(axes) not in ([0], [-1])):
        return None
    if any(d is None or (isinstance(d, int) and d < 0) for d in inner[0]):
        return None
    product = dim_product(*factors(inner[0]))
    if product is None:
        return None
    return [product], ((1,) if node.attrs.get("keepdims", 1) else ())


def _arithmetic(dims: Dims, node: Node, depth: int) -> Optional[Elements]:
    """``Add``/``Sub``/``Mul``/``Div`` of two shape computations (a scalar or one element broadcast).

    Numbers compute (``Div`` only when exact and non-negative); with a dim (never negative): a dim plus a
    number of at least 0 is their sum (:func:`~.algebra.dim_sum`), a dim times a number of at least 0 or times
    a dim their product (:func:`~.algebra.dim_product`), a product divided by one of its factors the rest, a
    dim less itself 0. Anything else is not known."""
    if len(node.inputs) != 2:
        return None
    a, b = (dims.elements(x, depth - 1) for x in node.inputs)
    if a is None or b is None:
        return None
    if len(a[0]) == 1 and len(b[1]) >= len(a[1]):
        a = (a[0] * len(b[0]), b[1])
    if len(b[0]) == 1 and len(a[1]) >= len(b[1]):
        b = (b[0] * len(a[0]), a[1])
    if a[1] != b[1]:
        return None
    out: list[Dim] = []
    op = _ELEMENT_OPS[node.op]
    for x, y in zip(a[0], b[0]):
        d = op(x, y)
        if d is _NOT_KNOWN:
            return None
        out.append(d)
    return out, a[1]


#: What an element op returns when the element is not known (None is an element: an unknown dim).
_NOT_KNOWN = object()


def _add(x: Dim, y: Dim) -> object:
    if isinstance(x, int) and isinstance(y, int):
        return x + y
    if any(isinstance(d, int) and d < 0 for d in (x, y)):
        return _NOT_KNOWN  # a dim minus something may be negative: not an element
    return dim_sum([x, y])


def _sub(x: Dim, y: Dim) -> object:
    if isinstance(x, int) and isinstance(y, int):
        return x - y
    return 0 if isinstance(x, str) and x == y else _NOT_KNOWN


def _mul(x: Dim, y: Dim) -> object:
    if isinstance(x, int) and isinstance(y, int):
        return x * y
    if x is None or y is None or any(isinstance(d, int) and d < 0 for d in (x, y)):
        return _NOT_KNOWN
    d = dim_product(*factors([x, y]))
    return _NOT_KNOWN if d is None else d


def _div(x: Dim, y: Dim) -> object:
    if isinstance(x, int) and isinstance(y, int):
        return x // y if x >= 0 and y > 0 and x % y == 0 else _NOT_KNOWN
    if not isinstance(x, str) or y is None or (isinstance(y, int) and y <= 0) or " + " in x:
        return _NOT_KNOWN
    d = quotient([x], [y])
    return _NOT_KNOWN if d is None else d


_ELEMENT_OPS: dict[str, Callable[[Dim, Dim], object]] = {"Add": _add, "Sub": _sub, "Mul": _mul, "Div": _div}

#: The evaluator of each op a shape computation may hold.
ELEMENTS: dict[str, Evaluator] = {
    **dict.fromkeys(("Gather", "Slice"), _picked),
    **dict.fromkeys(_ELEMENT_OPS, _arithmetic),
    "Shape": _shape,
    "Unsqueeze": _unsqueezed,
    "Reshape": _reshaped,
    "Cast": _cast,
    "Squeeze": _squeezed,
    "ReduceProd": _product,
    "Size": _size,
    "Concat": _concat,
}


def shape_axes(dims: Dims, node: Node) -> Optional[range]:
    """The axes of its input a ``Shape`` node returns (``start``/``end`` clamped); None when the rank is unknown.

    Lets a reader trace only the dims it needs (a Gather of a Shape reads one)."""
    x = node.inputs[0]
    if x.shape is None:
        dims.read(x)
        return None
    n = len(x.shape)
    if not node.attrs:  # the usual Shape: every axis
        return range(n)
    start = int(node.attrs.get("start", 0))
    end = node.attrs.get("end")
    start = min(max(start + n if start < 0 else start, 0), n)
    end = n if end is None else min(max(int(end) + n if end < 0 else int(end), 0), n)
    return range(start, max(start, end))


def shape_node_dims(dims: Dims, node: Node, depth: int) -> Optional[list[Dim]]:
    """The dims a ``Shape`` node returns, None for unknown ones; None when the rank is unknown."""
    axes = shape_axes(dims, node)
    return None if axes is None else [dims.at(node.inputs[0], i, depth) for i in axes]


def picked_dims(dims: Dims, node: Node, depth: int) -> Optional[Elements]:
    """The dims a Gather/Slice of a ``Shape`` picks and the result's shape (only those dims are traced)."""
    dims.read(node.inputs[0])
    src = producer(node.inputs[0])
    if src is None or src.op != "Shape":
        return None
    axes = shape_axes(dims, src)
    if axes is None:
        return None
    picked = _positions(dims, node, len(axes))
    if picked is None:
        return None
    return [dims.at(src.inputs[0], axes[i], depth) for i in picked[0]], picked[1]


def inferred_picked(dims: Dims, node: Node) -> Optional[list[Dim]]:
    """The dims a Gather/Slice of a ``Shape`` picks as shape inference gives them (nothing traced): what
    inference's data propagation knows of its value. None when it is no such pick."""
    src = producer(node.inputs[0]) if node.inputs else None
    axes = None if src is None or src.op != "Shape" else shape_axes(dims, src)
    picked = None if axes is None else _positions(dims, node, len(axes))
    return None if picked is None else [as_dim(src.inputs[0].shape[axes[i]]) for i in picked[0]]


def _positions(dims: Dims, node: Node, n: int) -> Optional[Picked]:
    """Positions (of ``n``) a Gather or a Slice on axis 0 picks and the result's shape; None if not constant."""
    return _gathered(dims, node, n) if node.op == "Gather" else _sliced(dims, node, n)


def _gathered(dims: Dims, node: Node, n: int) -> Optional[Picked]:
    """Positions (of ``n``) a Gather on axis 0 picks, flat, and the result's shape; None if not constant or out of range."""
    idx = dims.const(node.inputs[1]) if len(node.inputs) > 1 else None
    if idx is None or int(node.attrs.get("axis", 0)) not in (0, -1):
        return None
    idx = np.asarray(idx).astype(np.int64)
    flat = idx.ravel().tolist()  # plain ints: numpy is slow on these few elements
    if any(i < -n or i >= n for i in flat):
        return None
    return [i + n if i < 0 else i for i in flat], idx.shape


def _sliced(dims: Dims, node: Node, n: int) -> Optional[Picked]:
    """Positions (of ``n``) a one-axis Slice on axis 0 takes and the result's shape; None if not constant."""
    if len(node.inputs) < 3:
        return None
    vals = [dims.const(t) for t in node.inputs[1:]]
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
    taken = list(range(n))[slice(start, end if end >= 0 else None, step)]
    return taken, (len(taken),)


def _clamp(v: int, n: int, step: int) -> int:
    """ONNX Slice index clamping (INT64 min/max sentinels included)."""
    if v < 0:
        v += n
    if step > 0:
        return min(max(v, 0), n)
    return min(max(v, -1), n - 1)


def fold(dims: Dims, node: Node, depth: int) -> Optional[np.ndarray]:
    """The constant value of a Shape/Size/Gather-of-Shape/Slice-of-Shape/Equal node (of the standard domain),
    if what it reads is known (see :meth:`Dims.fold`)."""
    if node.op in ("Shape", "Size"):
        x = node.inputs[0]
        axes = shape_axes(dims, node) if node.op == "Shape" else (None if x.shape is None else range(len(x.shape)))
        found = _known_dims(dims, x, axes, depth)
        if found is None:
            return None
        return np.array(found if node.op == "Shape" else int(np.prod(found, dtype=np.int64)), dtype=np.int64)
    if node.op in ("Gather", "Slice") and node.inputs:
        # picked_dims(node) at full depth, as the output's elements one level up: remembered across sweeps
        picked = dims.elements(node.outputs[0], depth + 1)
        if picked is None or not known(picked[0]):
            return None
        return np.array(picked[0], dtype=np.int64).reshape(picked[1])
    if node.op == "Equal" and len(node.inputs) == 2:
        return _fold_equal(dims, node)
    return None


def _known_dims(dims: Dims, x: Tensor, axes: Optional[Sequence[int]], depth: int) -> Optional[list[int]]:
    """``x``'s dims at ``axes`` when every one is a number (traced only up to the first that is not), else None."""
    if axes is None:
        return None
    found = []
    for i in axes:
        d = dims.at(x, i, depth)
        if not isinstance(d, int):
            return None
        found.append(d)
    return found


def _fold_equal(dims: Dims, node: Node) -> Optional[np.ndarray]:
    """``Equal`` of two same-shaped shape computations, when every element pair is decided."""
    a, b = (dims.elements(x) for x in node.inputs)
    if a is None or b is None or a[1] != b[1]:
        return None
    out = []
    for x, y in zip(a[0], b[0]):
        numbers = [d for d in (x, y) if isinstance(d, int)]
        if len(numbers) == 2 or (isinstance(x, str) and x == y):
            out.append(x == y)
        elif numbers and numbers[0] < 0:
            out.append(False)
        else:
            return None
    return np.array(out, dtype=bool).reshape(a[1])


def is_shape_consumer(node: Node) -> bool:
    """Ops that read only the shape of their input (their results ignore the data)."""
    return node.op in ("Shape", "Size")


def shape_only_uses(t: Tensor) -> bool:
    """True when every consumer of ``t`` reads only its shape."""
    return bool(t.outputs) and all(is_shape_consumer(n) for n in t.outputs)
