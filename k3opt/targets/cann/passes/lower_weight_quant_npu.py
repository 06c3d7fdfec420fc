"""lower-weight-quant-npu: ``MatMul(x, DequantizeLinear(Wq, scale[, zero_point]))`` becomes Ascend's
``NPUWeightQuantBatchMatmulV2`` for ``--target cann`` (the weight-only quantized form ``k3opt quantize``
writes).

The contract, from the plugin and the operator's documentation (cited in
:mod:`k3opt.targets.cann.npu_contract`, [WQBMM-*]): the plugin fixes ``transpose_x = transpose_weight =
false``, so the weight stays ``(k, n)``; int8 as it is, int4 packed eight to an int32 ``(k, n / 8)``;
``antiquant_offset = -zero_point`` and ``antiquant_scale`` in x's dtype, ``(n,)`` per channel or
``(ceil(k / g), n)`` per group with ``antiquant_group_size = g`` a multiple of 32 below k (a group of all
k rows is per-channel); x 2-D.

The kernel takes float16/bfloat16 activations. An fp32 graph gets there by a Cast of x to float16
before the op and of y back to float32 after it (flattened to 2-D around it): the activations then
carry fp16's precision, and the lowering is verified with fp16's tolerance (rtol 1e-2, atol 1e-3)
unless the user gives one. Anything outside the contract stays DequantizeLinear + MatMul and the
report's lowering lines say why; so does every MatMul of a model that also quantizes its activations
(a QuantizeLinear of a computed tensor: W8A8 QDQ, as onnxruntime's ``quantize_static`` writes), which is not
weight-only and whose activation rounding the float16 kernel would move.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import onnx

from .... import graph as gs
from ..npu_contract import (WQBMM_GROUP_MULTIPLE, WQBMM_INT4_PER_INT32, WQBMM_MAX_DIM,
                                         pack_int4_words)
from ..target_form import STAGING_DOMAIN
from ....graph.ir import Graph, Node, const_tensor, const_value, disconnect, new_constant, new_variable, producer
from ....passes._rewire import detach, remove
from ....pipeline.analyses import Shapes
from ....pipeline.pass_base import Hints, Pass, PassContext

NPU_OP = "NPUWeightQuantBatchMatmulV2"
#: The tolerance (rtol, atol) the lowering is verified with: the activations are float16 through the op.
FP16_TOLERANCE = (1e-2, 1e-3)


def refusal(node: Node) -> Optional[str]:
    """Why ``node`` (a MatMul) cannot become the NPU op, or None; also None-checked: its B is a DequantizeLinear."""
    dq = producer(node.inputs[1])
    w, scale = const_value(dq.inputs[0]), const_tensor(dq.inputs[1])
    zp = const_tensor(dq.inputs[2]) if len(dq.inputs) > 2 and dq.inputs[2].name else None
    if w is None or scale is None or (len(dq.inputs) > 2 and dq.inputs[2].name and zp is None):
        return "its DequantizeLinear has a non-constant input"
    if w.ndim != 2 or (_bits(w) == 8 and w.dtype != np.int8):
        return f"weight {w.dtype} of rank {w.ndim} (int8 or int4, 2-D, is the kernel's)"
    k, n = w.shape
    if not (k <= WQBMM_MAX_DIM and n <= WQBMM_MAX_DIM):
        return f"k={k}, n={n}: the kernel takes at most {WQBMM_MAX_DIM}"
    if node.inputs[0].dtype not in (np.float32, np.float16):
        return f"x is {node.inputs[0].dtype} (float32 via float16, or float16, is lowered)"
    axis, block = dq.attrs.get("axis", 1), dq.attrs.get("block_size", 0)
    if block:
        if axis != 0 or k % block:
            return f"blocked over axis {axis} with block {block} (groups of rows of the (k, n) weight are the kernel's)"
        if block % WQBMM_GROUP_MULTIPLE and block != k:
            return f"group size {block} is not a multiple of {WQBMM_GROUP_MULTIPLE}"
    elif axis not in (1, -1) and scale.shape not in ((), (1,)):
        return f"per-axis scales over axis {axis} (per-channel scales run over n, axis 1)"
    if _bits(w) == 4 and n % WQBMM_INT4_PER_INT32:
        return f"int4 with n={n}, not a multiple of {WQBMM_INT4_PER_INT32} (packed eight to an int32)"
    x_rank = len(node.inputs[0].shape) if node.inputs[0].shape is not None else None
    if x_rank is None or x_rank < 2:
        return "x's rank is unknown or below 2"
    return None


def _quantized_activation(graph: Graph) -> Optional[str]:
    """The first QuantizeLinear of a computed tensor ("QuantizeLinear of 'x'"), or None: weight-only models have
    none (their weights are stored quantized)."""
    for node in graph.nodes:
        if node.op == "QuantizeLinear" and (node.domain or "") in ("", "ai.onnx") and \
                const_value(node.inputs[0]) is None:
            return f"QuantizeLinear of '{node.inputs[0].name}'"
    return None


def _bits(w: np.ndarray) -> int:
    return 4 if str(w.dtype) == "int4" else 8


def _operands(dq: Node, x_dtype) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray], int]:
    """(weight int8 or int32-packed, antiquant_scale, antiquant_offset or None, antiquant_group_size)."""
    w = const_value(dq.inputs[0])
    values = np.asarray(w).astype(np.int8)
    k = values.shape[0]
    scale = np.asarray(const_value(dq.inputs[1]))
    zp = const_value(dq.inputs[2]) if len(dq.inputs) > 2 and dq.inputs[2].name else None
    offset = None if zp is None else -np.asarray(zp).astype(np.float32)
    group = dq.attrs.get("block_size", 0)
    if group == k:  # one group of every row: per-channel (the kernel wants g <= k - 1)
        group, scale = 0, scale.reshape(-1)
        offset = None if offset is None else offset.reshape(-1)
    if scale.ndim == 0:
        scale = scale.reshape(1)
        offset = None if offset is None else np.broadcast_to(offset, (1,))
    weight = pack_int4_words(values) if _bits(w) == 4 else values
    half = np.dtype(x_dtype)
    return weight, scale.astype(half), None if offset is None else np.asarray(offset).astype(half), group


class LowerWeightQuantNPU(Pass):
    """DequantizeLinear -> MatMul -> NPUWeightQuantBatchMatmulV2 (target cann)."""

    name = "lower-weight-quant-npu"
    description = "DequantizeLinear -> MatMul -> NPUWeightQuantBatchMatmulV2 (target cann; int8/int4 weights)"
    order = 2050
    targets = ("cann",)
    lowering = True
    needs_shapes = True
    _hints = Hints(adds_bodies=False)
    #: Each replaced value keeps its dtype and shape, and the new ones get theirs here: re-inferring would lose
    #: shapes (onnx's inference does not know NPU ops).
    preserves = frozenset({Shapes})
    #: The lowering verification uses this when the user gives no tolerance (see the module doc).
    tolerance = FP16_TOLERANCE

    def __init__(self) -> None:
        self.lowered = 0
        self.kept: dict[str, str] = {}

    def run(self, graph: Graph, ctx: PassContext) -> int:
        count, dead = 0, []
        activations = _quantized_activation(graph)
        for node in list(graph.nodes):
            if node.op != "MatMul" or len(node.inputs) != 2:
                continue
            dq = producer(node.inputs[1])
            if dq is None or dq.op != "DequantizeLinear" or (dq.domain or "") not in ("", "ai.onnx"):
                continue
            why = refusal(node) or (activations and f"the model quantizes its activations too ({activations}): a "
                                    "W8A8 QDQ model, which ATC takes only through AMCT; the weight-only kernel's "
                                    "float16 activations would move values across that QuantizeLinear's rounding")
            if why is not None:
                self.kept[node.name] = f"MatMul '{node.name}' kept with its DequantizeLinear: {why}"
                continue
            _lower(graph, node, dq, ctx)
            detach(node, dead)
            count += 1
        remove(graph, dead)
        self.lowered += count
        return count

    def finish(self, graph: Graph, ctx: PassContext) -> None:
        total = self.lowered + len(self.kept)
        if total:
            ctx.note(f"{NPU_OP}: {self.lowered} of {total} weight-quantized MatMul(s) lowered "
                     f"(activations through float16)")
        for line in self.kept.values():
            ctx.note(line)


def _lower(graph: Graph, node: Node, dq: Node, ctx: PassContext) -> None:
    """``y = Cast(NPU(Cast(x, float16), ...), x's dtype)``, x flattened to ``(-1, k)`` before and y given x's
    leading dims back after when x is not 2-D (the kernel's x and y are 2-D on Atlas A2/A3)."""
    x, y = node.inputs[0], node.outputs[0]
    weight, scale, offset, group = _operands(dq, np.float16)
    k = weight.shape[0]
    n = scale.shape[-1] if group else int(np.asarray(const_value(dq.inputs[0])).shape[1])
    base = ctx.names.fresh(node.name or "wqbmm") if ctx.names is not None else (node.name or "wqbmm")
    rank = len(x.shape)
    rows = list(x.shape[:1]) if rank == 2 else [None]
    y_dtype, y_shape = y.dtype, y.shape
    disconnect(node)  # the caller drops it from the graph

    def const(suffix: str, value: np.ndarray) -> gs.Constant:
        return new_constant(fresh(f"{base}_{suffix}"), np.ascontiguousarray(value))

    made = [0]

    def fresh(name: str) -> str:
        made[0] += 1
        return ctx.names.fresh(name) if ctx.names is not None else f"{name}_{made[0]}"

    def emit(op: str, inputs: list, attrs: dict, dtype, shape, last: bool = False, domain: str = "") -> gs.Tensor:
        out = y if last else new_variable(fresh(f"{base}_{op}_out"))
        if not last:
            out.dtype, out.shape = dtype, shape
        graph.nodes.append(gs.Node(op, fresh(f"{base}_{op}"), attrs, inputs, [out], domain=domain or None))
        return out

    src = x if rank == 2 else emit("Reshape", [x, const("shape_in", np.array([-1, k]))], {}, x.dtype, rows + [k])
    if x.dtype != np.float16:
        src = emit("Cast", [src], {"to": onnx.TensorProto.FLOAT16}, np.float16, rows + [k])
    inputs = [src, const("weight", weight), const("antiquant_scale", scale)]
    if offset is not None:
        inputs.append(const("antiquant_offset", offset))
    cast_back, reshape = x.dtype != np.float16, rank != 2
    out = emit(NPU_OP, inputs, {"antiquant_group_size": int(group)}, np.float16, rows + [n],
               last=not (cast_back or reshape), domain=STAGING_DOMAIN)
    if cast_back:
        out = emit("Cast", [out], {"to": onnx.TensorProto.FLOAT}, x.dtype, rows + [n], last=not reshape)
    if reshape:
        dims = emit("Shape", [x], {"end": -1}, np.int64, [rank - 1])
        full = emit("Concat", [dims, const("n", np.array([n]))], {"axis": 0}, np.int64, [rank])
        emit("Reshape", [out, full], {}, x.dtype, None, last=True)
    y.dtype, y.shape = y_dtype, y_shape  # the MatMul's: onnx's inference cannot see through the NPU op
