"""The Ascend NPU target (``--target cann``): contract, form, checks, lowering passes and reference ops.

- :mod:`.npu_contract`: the documented limits of the NPU ops the lowerings emit (sources cited there).
- :mod:`.target_form`: the opset and domains of a cann file, its invariants, and the checks a written file passes.
- :mod:`.atc_ops`, :mod:`.compat`: what ATC's ONNX parser accepts, and the pre-flight check against it.
- :mod:`.passes`: the lowering passes (``lower-*-npu``, ``conv1d-to-conv2d``).
- :mod:`.reference`: numpy implementations of every NPU op k3opt emits, for onnx's reference evaluator.
- :mod:`.weight_quant`, :mod:`.valid_lengths`: what ``k3opt quantize`` and ``k3opt llm`` ask of the target
  (the quantized weights' lowering and its check; the serving pair's bounded cache reads).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import onnx

from ..base import Target
from .target_form import CANN_OPSET

if TYPE_CHECKING:
    from ...report import Report


class CannTarget(Target):
    """Opset 17 and NPU lowerings for ATC: ATC fuses 2-D MatMul + Add, has no CastLike parser and runs NPU
    flash attention, RMSNorm and rotary ops instead of opset 23's standard ones."""

    name = "cann"
    summary = "opset 17 and lowering for Ascend ATC"
    fixed_opset = CANN_OPSET
    fuses_to_standard_ops = False
    matmul_add_nd = "flatten"
    prefers_2d_matmuls = True
    fuses_computed_matmul_add = False
    runs_castlike = False
    honours_gemm_scales = False  # ATC's Gemm: alpha/beta other than 1 are not known to be honoured
    lowers_attention = True
    merges_projection_pairs = True
    lowers = True
    compiler = "atc"
    quantized_gather_refusal = "k3opt has no NPU lowering for a quantized Gather"
    ops_kind = "NPU ops"

    def own_ops(self, model: onnx.ModelProto) -> list[str]:
        from ...modelio.opset_nodes import all_graphs
        from .atc_ops import NPU_OPS

        return sorted({n.op_type for g in all_graphs(model.graph) for n in g.node if n.op_type in NPU_OPS})

    def adopt_input(self, model: onnx.ModelProto, report: "Report") -> None:
        """A cann output read back in keeps its NPU nodes (staged out of the default domain for the run)."""
        ops = self.own_ops(model)
        if ops:
            from .target_form import stage_npu_nodes

            stage_npu_nodes(model)
            report.notes.append(f"NPU nodes of the input kept as they are ({', '.join(ops)})")

    def check_record(self, path: "str | Path") -> Optional[dict]:
        from .compat import check_record

        return check_record(path)

    def quant_group_refusal(self, group: int) -> Optional[str]:
        from .npu_contract import WQBMM_GROUP_MULTIPLE

        return f"the NPU kernel takes groups that are multiples of {WQBMM_GROUP_MULTIPLE}" \
            if group % WQBMM_GROUP_MULTIPLE else None

    def quant_weight_refusal(self, k: int, n: int, bits: int) -> Optional[str]:
        """NPUWeightQuantBatchMatmulV2's limits (docs/passes/lower-weight-quant-npu.md)."""
        from .npu_contract import WQBMM_INT4_PER_INT32, WQBMM_MAX_DIM

        if k > WQBMM_MAX_DIM or n > WQBMM_MAX_DIM:
            return f"breaks the NPU kernel's contract: k and n must be at most {WQBMM_MAX_DIM}"
        if bits == 4 and n % WQBMM_INT4_PER_INT32:
            return f"breaks the NPU kernel's contract: int4 is packed {WQBMM_INT4_PER_INT32} to an int32 along n"
        return None

    def lower_quantized(self, model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
        """The DequantizeLinear -> MatMul pairs lowered to NPUWeightQuantBatchMatmulV2 at the quantized opset."""
        from .weight_quant import lower

        return lower(model)

    def verify_quantized(self, quantized: Path, lowered: Path) -> Optional[str]:
        """The lowered file under the NPU reference ops against the quantized one in onnxruntime (fp16's
        tolerance)."""
        from ...pipeline.verify import summary_line
        from .weight_quant import verify

        return ("NPU form verified against the quantized model under the reference ops: "
                + summary_line(verify(quantized, lowered)))

    def bound_cache_reads(self, decode: onnx.ModelProto, position: str) -> int:
        """NPUPromptFlashAttention's ``actual_seq_lengths_kv`` = position + 1 (:mod:`.valid_lengths`)."""
        from .valid_lengths import pass_valid_lengths

        return pass_valid_lengths(decode, position)

    def finish(self, model: onnx.ModelProto) -> onnx.ModelProto:
        from .target_form import finish_model

        return finish_model(model)

    def reference_evaluator(self) -> Optional[Callable[[onnx.ModelProto], Any]]:
        from .reference import evaluator

        return evaluator

    def written_check(self, report: "Report") -> Callable[[Path], None]:
        """Read back under onnx's checker and the target's invariants (onnxruntime has no NPU ops)."""
        from .target_form import check_written

        return check_written


TARGET = CannTarget()
