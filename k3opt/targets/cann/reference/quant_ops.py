"""numpy reference of ``NPUWeightQuantBatchMatmulV2``, the weight-only quantized matmul that
``lower-weight-quant-npu`` emits (sources by short name in :mod:`..npu_contract`, [WQBMM-*])."""
from __future__ import annotations

import numpy as np
from onnx.reference.op_run import OpRun

from ..npu_contract import WQBMM_GROUP_MULTIPLE, WQBMM_MAX_DIM, WQBMM_MAX_INPUTS, unpack_int4_words
from ..target_form import STAGING_DOMAIN
from .registry import ReferenceError, reference_op


@reference_op("NPUWeightQuantBatchMatmulV2", domains=("", STAGING_DOMAIN))  # npu::1 names it WeightQuantBatchMatmulV2
class NPUWeightQuantBatchMatmulV2(OpRun):
    """``y = x @ ((weight + antiquant_offset) * antiquant_scale)`` ([WQBMM-doc] formula), as the plugin hands
    it on ([WQBMM-plugin]: weight (k, n), not transposed; ``antiquant_group_size``; ``dtype`` -1 = x's).

    x fp16/bf16 (m, k); weight int8 (k, n) or int32 (k, n / 8) carrying int4; scale and offset of x's dtype,
    (1,)/(n,)/(1, n) per channel or (ceil(k / g), n) per group. The product is accumulated in float32 and
    cast to x's dtype (the kernel's own rounding of the dequantized weight is not documented: the
    verification tolerance is fp16's). quant_scale/quant_offset/bias are not modelled.
    """


    def _run(self, x, weight, scale, offset=None, *rest, antiquant_group_size=0, dtype=-1,  # noqa: D102
             inner_precise=0):
        if len(rest) > WQBMM_MAX_INPUTS - 4 or any(r is not None and np.size(r) for r in rest):
            raise ReferenceError("quant_scale, quant_offset and bias are not modelled")
        if x.dtype != np.float16 or x.ndim != 2:
            raise ReferenceError(f"x must be 2-D float16 (bfloat16 is not modelled), not {x.dtype} {list(x.shape)}")
        if scale.dtype != x.dtype or (offset is not None and (offset.dtype != x.dtype or offset.shape != scale.shape)):
            raise ReferenceError("antiquant_scale/antiquant_offset must have x's dtype, and one shape")
        if dtype not in (-1, 1):
            raise ReferenceError(f"dtype {dtype}: only the float16 output (-1 or 1) is modelled")
        w = unpack_int4_words(weight) if weight.dtype == np.int32 else weight
        if w.dtype != np.int8 or w.ndim != 2 or w.shape[0] != x.shape[1]:
            raise ReferenceError(f"weight {weight.dtype} {list(weight.shape)} is not int8/int32-packed (k, n) "
                                 f"for x {list(x.shape)}")
        k, n = w.shape
        if not (1 <= k <= WQBMM_MAX_DIM and 1 <= n <= WQBMM_MAX_DIM):
            raise ReferenceError(f"k={k}, n={n}: the kernel takes [1, {WQBMM_MAX_DIM}]")
        g = int(antiquant_group_size)
        if g:
            if g % WQBMM_GROUP_MULTIPLE or not WQBMM_GROUP_MULTIPLE <= g <= k - 1:
                raise ReferenceError(f"antiquant_group_size {g} is not a multiple of 32 in [32, k-1={k - 1}]")
            if scale.shape != (-(-k // g), n):
                raise ReferenceError(f"per-group antiquant_scale {list(scale.shape)} is not (ceil(k/g), n)")
            rows = np.arange(k) // g
            s, o = scale.astype(np.float32)[rows], None if offset is None else offset.astype(np.float32)[rows]
        else:
            if scale.size not in (1, n) or scale.ndim > 2 or (scale.ndim == 2 and scale.shape[0] != 1):
                raise ReferenceError(f"antiquant_scale {list(scale.shape)} is not (1,), (n,) or (1, n)")
            s = scale.astype(np.float32).reshape(1, -1)
            o = None if offset is None else offset.astype(np.float32).reshape(1, -1)
        wf = w.astype(np.float32) if o is None else w.astype(np.float32) + o
        return ((x.astype(np.float32) @ (wf * s)).astype(x.dtype),)


@reference_op("DequantizeLinear", domains=("",))
class DequantizeLinear(OpRun):
    """The standard op at every opset (per-tensor, per-axis, and opset 21's blocked form): onnx 1.23's reference
    evaluator has no DequantizeLinear below opset 19, and a cann model is at 16/17, so a weight's
    DequantizeLinear the lowering kept could not be verified. ``y = (x - zero_point) * scale``, in scale's dtype."""

    def _run(self, x, scale, zero_point=None, axis=1, block_size=0, output_dtype=0, precision=0):  # noqa: D102
        xf = np.asarray(x).astype(np.float32)
        s = np.asarray(scale)
        axis = axis % xf.ndim if xf.ndim else 0

        def spread(v: np.ndarray) -> np.ndarray:
            """``v`` (a scale or zero point) broadcastable to x: per tensor, per axis, or per block."""
            v = np.asarray(v).astype(np.float32)
            if v.size == 1 and not block_size:
                return v.reshape(())
            if block_size:
                return np.repeat(v, block_size, axis=axis)
            shape = [1] * xf.ndim
            shape[axis] = -1
            return v.reshape(shape)

        zf = spread(zero_point) if zero_point is not None else np.float32(0)
        return (((xf - zf) * spread(s)).astype(s.dtype),)
