"""Small constants read once per process: the integers of shape computations, which a deep model's passes
read thousands of times.

:func:`small_const_value` is :func:`~k3opt.graph.ir.const_value` for a constant of at most
:data:`MAX_DECODED_BYTES`, remembered by the constant's lazy value holder (weak keys: an entry goes with its
graph; the holder of an initializer never changes, so an answer cannot go stale). A bigger constant is read
as :func:`~k3opt.graph.ir.peek` reads it, every time.
"""
from __future__ import annotations

import sys
import weakref
from typing import Optional

import numpy as np
import onnx_graphsurgeon as gs
from onnx import TensorProto
from onnx_graphsurgeon.ir.tensor import LazyValues

from . import dtypes
from .ir import Tensor, as_int_list, as_scalar, bad_data, const_tensor, peek

#: The largest constant remembered: 64 int64s, the longest shape a shape computation is traced for.
MAX_DECODED_BYTES = 8 * 64

#: Small values decoded, by their lazy holder: a process-wide cache, safe to share between runs and threads
#: because an answer cannot change. The key is the holder of one TensorProto, which nothing edits in place (a
#: rewrite gives a constant a new holder, ``ir.store_values``, or makes a new one, ``ir.as_constant``); the
#: values are read-only arrays; weak keys drop an entry with its holder.
_decoded: "weakref.WeakKeyDictionary[LazyValues, np.ndarray]" = weakref.WeakKeyDictionary()

#: Element types whose raw little-endian bytes onnx's ``to_array`` reads as they are (no unpacking).
_RAW_DTYPES = {elem: dtypes.numpy_dtype(elem) for elem in (
    TensorProto.INT64, TensorProto.INT32, TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.BOOL,
    TensorProto.INT8, TensorProto.UINT8)} if sys.byteorder == "little" else {}


def small_const_value(t: Tensor) -> Optional[np.ndarray]:
    """The value of constant ``t`` (None when it is none), a small one decoded once per process and
    read-only (a bigger one is read afresh)."""
    return constant_value(const_tensor(t))


def small_int_list(t: Tensor) -> Optional[list[int]]:
    """:func:`~k3opt.graph.ir.int_list` of ``t``, a small constant decoded once per process."""
    return as_int_list(small_const_value(t))


def small_const_scalar(t: Tensor) -> Optional[float]:
    """:func:`~k3opt.graph.ir.const_scalar` of ``t``, a small constant decoded once per process."""
    return as_scalar(small_const_value(t))


def constant_value(c: Optional[gs.Constant]) -> Optional[np.ndarray]:
    """:func:`small_const_value` of the constant ``c`` itself (None for None)."""
    if c is None:
        return None
    if not is_small(c):
        return peek(c)
    value = _decoded.get(c._values)
    if value is None:
        value = _decoded[c._values] = _read_only(_decode(c))
    return value


def is_small(c: gs.Constant) -> bool:
    """Is ``c`` a model's or k3opt's lazy constant of at most :data:`MAX_DECODED_BYTES` (remembered)?"""
    nbytes = getattr(c._values, "nbytes", None)
    return isinstance(c._values, LazyValues) and isinstance(nbytes, int) and nbytes <= MAX_DECODED_BYTES


def remember_value(c: gs.Constant, value: np.ndarray) -> None:
    """Constant ``c`` was just built from ``value`` (``ir.as_constant``): when small and numeric (what
    decoding gives back exactly), :func:`small_const_value` answers it without decoding, so a folded result
    is not decoded again by every later pass that reads it."""
    if is_small(c) and value.dtype.kind in "biuf" and value.dtype.isnative:
        _decoded[c._values] = _read_only(value.copy())  # the caller's array may change: the answer may not


def _read_only(value: np.ndarray) -> np.ndarray:
    """``value``, made read-only: an answer is shared by every later reader of the constant, so a reader
    changing it in place would change what the others read (it raises instead)."""
    value.flags.writeable = False
    return value


def _decode(c: gs.Constant) -> np.ndarray:
    """``peek(c)`` for a small constant: raw little-endian numbers are read directly, as ``to_array`` reads
    them (its generic path and gs's copy cost more than the decode)."""
    lazy = c._values
    t = lazy.tensor
    dtype = _RAW_DTYPES.get(t.data_type) if type(lazy) is LazyValues else None
    if dtype is None or not t.HasField("raw_data") or t.data_location == TensorProto.EXTERNAL \
            or t.HasField("segment"):
        return peek(c)
    try:
        return np.frombuffer(t.raw_data, dtype).reshape(tuple(t.dims)).copy()  # a copy, as gs's load gives
    except ValueError as exc:  # raw_data of the wrong length
        raise bad_data(c, exc) from None
