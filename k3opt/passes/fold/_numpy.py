"""Exact numpy kernels for fold-constants: nodes whose value numpy computes bit for bit as onnxruntime does.

An onnxruntime session costs about a quarter of a millisecond per node to
build; the shape arithmetic exporters leave behind (``Mul``/``Div`` of int64
scalars, ``ConstantOfShape``, ``Cast``, reshapes and transposes of weights)
is hundreds of such nodes on a deep model, and each is one numpy call.

A kernel returns None whenever it is not sure numpy gives onnxruntime's
exact result, and the node then goes to onnxruntime as before:

- data movement (Identity, Unsqueeze, Squeeze, Reshape, Transpose, Concat,
  ConstantOfShape) copies bits, so any numeric dtype numpy holds natively;
  invalid arguments (bad axes, a size mismatch) are left for onnxruntime to
  refuse;
- ``Add``/``Sub``/``Mul``/``Div`` of int32/int64 only while no result can
  overflow (operands below the square root of the type's range), ``Div``
  truncating toward zero and never by zero; of float32/float64 (IEEE
  operations are correctly rounded everywhere) unless a result is NaN, whose
  bits are the hardware's choice;
- ``Cast`` between bool, integers, float32 and float64 only when every value
  converts exactly or by the one rounding both agree on (float -> int
  truncation of finite, in-range values; int -> float only within the
  float's exact integer range; float64 -> float32 round-to-nearest-even);
  no float16, bfloat16, float8 or string targets.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
from ... import graph as gs
from ...graph import dtypes
from ...graph.ir import Graph, Node, Tensor, peek
from ...graph.small_constants import small_const_value

#: Element kinds numpy holds exactly as onnxruntime returns them (no strings, no ml_dtypes types).
_PLAIN_KINDS = frozenset("biuf")
#: Cast targets numpy produces exactly (see the module docstring).
_CAST_TARGETS = frozenset(np.dtype(t) for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float32, np.float64))
#: Float dtypes numpy's arithmetic computes exactly as IEEE requires (float16 goes through float32 in numpy).
_IEEE = frozenset((np.dtype(np.float32), np.dtype(np.float64)))
#: Integer dtypes of onnxruntime's arithmetic kernels that numpy's match below overflow.
_INTS = frozenset((np.dtype(np.int32), np.dtype(np.int64)))

Value = Callable[[Tensor], Optional[np.ndarray]]
Kernel = Callable[[Node, int, Value], Optional[np.ndarray]]


def numpy_values(graph: Graph, nodes: Sequence[Node], known: dict) -> dict[str, np.ndarray]:
    """Outputs of the nodes among ``nodes`` (in order) that have a kernel here and whose inputs are known
    numeric arrays (``known`` values, constants, or outputs computed before them here).

    Results are numpy arrays, possibly views of the inputs or of the shared decoded small constants
    (:func:`~k3opt.graph.small_constants.small_const_value`): never modify them.
    """
    computed: dict[str, np.ndarray] = {}

    def value(t: Tensor) -> Optional[np.ndarray]:
        if not t.name:
            return None
        v = computed.get(t.name)
        if v is None:
            v = known.get(t.name) if t.name in known else small_const_value(t)  # small ones decoded once
        return v if isinstance(v, np.ndarray) and v.dtype.kind in _PLAIN_KINDS and v.dtype.isnative else None

    with np.errstate(all="ignore"):  # once for all nodes (~2 us a time)
        for node in nodes:
            kernel = KERNELS.get(node.op)
            if kernel is None or (node.domain or "") not in ("", "ai.onnx") or len(node.outputs) != 1 \
                    or not node.outputs[0].name:
                continue
            out = kernel(node, graph.opset, value)
            if out is not None:
                computed[node.outputs[0].name] = out
    return computed


def _inputs(node: Node, value: Value, n: int) -> Optional[list[np.ndarray]]:
    """The values of exactly ``n`` inputs, None if there are more or fewer or any is unknown."""
    if len(node.inputs) != n:
        return None
    values = [value(t) for t in node.inputs]
    return None if any(v is None for v in values) else values


def _axes(node: Node, opset: int, since: int, value: Value) -> Optional[list[int]]:
    """An ``axes`` attribute (before opset ``since``) or second input (from it on) as ints; [] when absent,
    None when unknown, or given but empty (whether that means "all" is the runtime's to say)."""
    if opset < since:
        if len(node.inputs) != 1 or set(node.attrs) - {"axes"}:
            return None
        if "axes" not in node.attrs:
            return []
        axes = [int(a) for a in node.attrs["axes"]]
        return axes or None
    if node.attrs or len(node.inputs) > 2:
        return None
    if len(node.inputs) < 2 or not node.inputs[1].name:
        return []
    v = value(node.inputs[1])
    if v is None or v.dtype != np.int64 or v.ndim != 1 or v.size == 0:
        return None
    return [int(a) for a in v]


def _normalized(axes: list[int], rank: int) -> Optional[list[int]]:
    """``axes`` made non-negative; None when one repeats or is out of ``[-rank, rank)``."""
    out = [a + rank if a < 0 else a for a in axes]
    return None if len(set(out)) != len(out) or any(not 0 <= a < rank for a in out) else out


def _identity(node: Node, opset: int, value: Value) -> Optional[np.ndarray]:
    x = _inputs(node, value, 1)
    return None if x is None or node.attrs else x[0]


def _unsqueeze(node: Node, opset: int, value: Value) -> Optional[np.ndarray]:
    axes = _axes(node, opset, 13, value)
    x = value(node.inputs[0]) if node.inputs else None
    if not axes or x is None:  # Unsqueeze requires axes
        return None
    rank = x.ndim + len(axes)
    axes = _normalized(axes, rank)
    if axes is None:
        return None
    dims = iter(x.shape)
    return x.reshape([1 if i in axes else next(dims) for i in range(rank)])


def _squeeze(node: Node, opset: int, value: Value) -> Optional[np.ndarray]:
    axes = _axes(node, opset, 13, value)
    x = value(node.inputs[0]) if node.inputs else None
    if axes is None or x is None:
        return None
    axes = _normalized(axes, x.ndim) if axes else [i for i, d in enumerate(x.shape) if d == 1]
    if axes is None or any(x.shape[a] != 1 for a in axes):
        return None
    return x.reshape([d for i, d in enumerate(x.shape) if i not in axes])


def _reshape(node: Node, opset: int, value: Value) -> Optional[np.ndarray]:
    got = _inputs(node, value, 2)
    if opset < 5 or got is None or set(node.attrs) - {"allowzero"}:
        return None
    x, shape = got
    if shape.dtype != np.int64 or shape.ndim != 1:
        return None
    allowzero = int(node.attrs.get("allowzero", 0))
    dims = [int(d) for d in shape]
    if not allowzero:
        if any(d == 0 and i >= x.ndim for i, d in enumerate(dims)):
            return None
        dims = [x.shape[i] if d == 0 else d for i, d in enumerate(dims)]
    if dims.count(-1) > 1 or any(d < -1 for d in dims) or (allowzero and -1 in dims and 0 in dims):
        return None
    if -1 in dims:
        rest = int(np.prod([d for d in dims if d != -1], dtype=np.int64))
        if rest == 0 or x.size % rest:
            return None
        dims[dims.index(-1)] = x.size // rest
    return x.reshape(dims) if int(np.prod(dims, dtype=np.int64)) == x.size else None


def _transpose(node: Node, opset: int, value: Value) -> Optional[np.ndarray]:
    x = _inputs(node, value, 1)
    if x is None or set(node.attrs) - {"perm"}:
        return None
    x = x[0]
    perm = node.attrs.get("perm")
    perm = list(range(x.ndim))[::-1] if perm is None else [int(p) for p in perm]
    return x.transpose(perm) if sorted(perm) == list(range(x.ndim)) else None


def _concat(node: Node, opset: int, value: Value) -> Optional[np.ndarray]:
    values = [value(t) for t in node.inputs]
    if not values or any(v is None for v in values) or set(node.attrs) != {"axis"}:
        return None
    rank, dtype = values[0].ndim, values[0].dtype
    axis = int(node.attrs["axis"])
    axis = axis + rank if axis < 0 and opset >= 11 else axis
    if rank == 0 or not 0 <= axis < rank or any(v.ndim != rank or v.dtype != dtype for v in values):
        return None
    others = {v.shape[:axis] + v.shape[axis + 1:] for v in values}
    return np.concatenate(values, axis=axis) if len(others) == 1 else None


def _constant_of_shape(node: Node, opset: int, value: Value) -> Optional[np.ndarray]:
    got = _inputs(node, value, 1)
    if got is None or set(node.attrs) - {"value"} or got[0].dtype != np.int64 or got[0].ndim != 1:
        return None
    fill = node.attrs.get("value")
    fill = np.zeros(1, np.float32) if fill is None else peek(fill) if isinstance(fill, gs.Constant) else None
    if not isinstance(fill, np.ndarray) or fill.size != 1 or fill.dtype.kind not in _PLAIN_KINDS \
            or not fill.dtype.isnative:
        return None
    shape = [int(d) for d in got[0]]
    return None if any(d < 0 for d in shape) else np.full(shape, fill.reshape(()), dtype=fill.dtype)


def _cast(node: Node, opset: int, value: Value) -> Optional[np.ndarray]:
    got = _inputs(node, value, 1)
    if got is None or set(node.attrs) - {"to", "saturate"}:
        return None
    x = got[0]
    try:
        to = dtypes.numpy_dtype(int(node.attrs["to"]))
    except (KeyError, ValueError, TypeError):
        return None
    if to not in _CAST_TARGETS or not _casts_exactly(x, to):
        return None
    return x.astype(to)


def _casts_exactly(x: np.ndarray, to: np.dtype) -> bool:
    """True when numpy's ``x.astype(to)`` is what onnxruntime's Cast gives, value for value."""
    if x.dtype.kind == "f" and np.isnan(x).any():
        return False  # NaN payloads, NaN -> bool or int: onnxruntime's to decide
    if x.size == 0 or x.dtype == to or to.kind == "b" or x.dtype.kind == "b":
        return True
    if to.kind in "iu":
        info = np.iinfo(to)
        if x.dtype.kind == "f":  # truncation of finite values that land in range
            return bool(np.isfinite(x).all() and x.min() >= info.min and x.max() < float(info.max) + 1)
        return int(x.min()) >= info.min and int(x.max()) <= info.max
    if x.dtype.kind in "iu":  # within the float's exact integers
        exact = 2 ** (np.finfo(to).nmant + 1)
        return -exact <= int(x.min()) and int(x.max()) <= exact
    # float -> float: widening is exact; float64 -> float32 rounds to nearest, unless it would overflow
    return x.dtype in _IEEE and (to.itemsize >= x.dtype.itemsize or bool(np.abs(x).max() <= np.finfo(to).max))


def _truncating_div(a: np.ndarray, b: np.ndarray) -> Optional[np.ndarray]:
    """Integer ``a / b`` rounded toward zero (C++, onnxruntime); None for a division by zero."""
    if (b == 0).any():
        return None
    q = a // b  # floor: one less than the truncation when inexact and negative
    return q + ((q < 0) & (q * b != a))


def _arithmetic(float_op: Callable[[np.ndarray, np.ndarray], np.ndarray],
                int_op: Optional[Callable[[np.ndarray, np.ndarray], Optional[np.ndarray]]] = None) -> Kernel:
    """A kernel for an elementwise binary op: ``float_op`` for float32/float64, ``int_op`` (default
    ``float_op``) for int32/int64 values small enough that no result overflows."""
    int_op = int_op or float_op

    def kernel(node: Node, opset: int, value: Value) -> Optional[np.ndarray]:
        got = _inputs(node, value, 2)
        if opset < 7 or got is None or node.attrs:
            return None
        a, b = got
        if a.dtype != b.dtype:
            return None
        try:
            np.broadcast_shapes(a.shape, b.shape)
        except ValueError:
            return None
        if a.dtype in _INTS:
            bound = 2 ** ((a.dtype.itemsize * 8 - 2) // 2)  # |a|, |b| < bound: no result overflows
            if any(v.size and (int(v.min()) <= -bound or int(v.max()) >= bound) for v in (a, b)):
                return None
            out = int_op(a, b)
        elif a.dtype in _IEEE:
            out = float_op(a, b)
            if np.isnan(out).any():
                return None
        else:
            return None
        return None if out is None else np.asarray(out, dtype=a.dtype)

    return kernel


#: ``op -> kernel(node, opset, value) -> result or None`` (None: leave the node to onnxruntime).
KERNELS: dict[str, Kernel] = {
    "Identity": _identity,
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Reshape": _reshape,
    "Transpose": _transpose,
    "Concat": _concat,
    "ConstantOfShape": _constant_of_shape,
    "Cast": _cast,
    "Add": _arithmetic(np.add),
    "Sub": _arithmetic(np.subtract),
    "Mul": _arithmetic(np.multiply),
    "Div": _arithmetic(np.divide, _truncating_div),
}
