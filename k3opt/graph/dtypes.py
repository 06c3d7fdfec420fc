"""The one mapping between ONNX element types and numpy dtypes.

Every element type ONNX defines maps to one numpy dtype (ml_dtypes' for bfloat16, the float8, float6 and
float4 variants and the 2- and 4-bit ints) and back. The tables are built once from onnx's own
``helper.tensor_dtype_to_np_dtype``, which is right for each of them; gs's ``dtype_to_onnx`` is not (it
maps ml_dtypes' float8_e4m3fnuz to FLOAT8E4M3FN), so k3opt never asks it. A tensor's gs dtype is a numpy
dtype or, for types gs does not convert on import, already an ONNX enum: :func:`onnx_type` takes both.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
from onnx import TensorProto, helper

# Immutable tables, built at import: module-level is right for them (no run changes them).
_NUMPY: dict[int, np.dtype] = {elem: np.dtype(helper.tensor_dtype_to_np_dtype(elem))
                                for elem in TensorProto.DataType.values() if elem != TensorProto.UNDEFINED}
_ONNX: dict[np.dtype, int] = {dtype: elem for elem, dtype in _NUMPY.items()}

#: Types stored packed, several elements a byte: their bits per element.
PACKED_BITS: dict[int, int] = {elem: bits for name, bits in (("INT4", 4), ("UINT4", 4), ("FLOAT4E2M1", 4),
                                                             ("INT2", 2), ("UINT2", 2), ("FLOAT6E2M3", 6),
                                                             ("FLOAT6E3M2", 6))
                               if (elem := getattr(TensorProto, name, None)) is not None}


def numpy_dtype(elem_type: int) -> np.dtype:
    """The numpy dtype of an ONNX element type; KeyError for UNDEFINED or an unknown number."""
    return _NUMPY[int(elem_type)]


def onnx_type(dtype: Any) -> Optional[int]:
    """The ONNX element type of a numpy dtype, a numpy scalar type or an ONNX enum (returned as an int);
    None for None and for anything that is no ONNX type."""
    if dtype is None:
        return None
    if isinstance(dtype, (int, np.integer)):
        return int(dtype) if int(dtype) in _NUMPY else None
    try:
        elem = _ONNX.get(dtype)  # a numpy dtype, the common case: one lookup
        return elem if elem is not None else _ONNX.get(np.dtype(dtype))
    except TypeError:  # not a dtype at all
        return None


def bits(elem_type: int) -> int:
    """Bits one element of ``elem_type`` takes in raw form (strings: 0, they have no fixed size)."""
    if elem_type == TensorProto.STRING:
        return 0
    return PACKED_BITS.get(elem_type) or 8 * numpy_dtype(elem_type).itemsize
