"""What the documentation of the NPU ops k3opt emits says of them: limits, modes, the template mask.

Read by the ``--target cann`` lowerings (what they may emit) and by :mod:`.reference` (what it
runs): a module of its own, so that the lowerings do not import onnx's reference evaluator.
Sources, by short name in the comments:

- [PFA-plugin] cann/ops-transformer (mirror yuanfang-chen/ops-transformer)
  ``attention/prompt_flash_attention/framework/npu_prompt_flash_attention_onnx_plugin.cpp``
- [PFA-IR] same repository, ``attention/prompt_flash_attention/op_graph/prompt_flash_attention_proto.h``
- [PFA-doc] same repository, ``attention/prompt_flash_attention/docs/aclnnPromptFlashAttentionV3.md``
- [PFA-torch] torch_npu ``npu_prompt_flash_attention``:
  https://hiascend.com/document/detail/zh/Pytorch/60RC1/apiref/apilist/ptaoplist_000453.html and
  https://gitcode.com/Ascend/op-plugin/blob/7.3.0/docs/context/torch_npu-npu_prompt_flash_attention.md
- [IFA-plugin] ``attention/incre_flash_attention/framework/npu_incre_flash_attention_onnx_plugin.cpp``
- [IFA-IR] ``attention/incre_flash_attention/op_graph/incre_flash_attention_proto.h``
- [IFA-torch] torch_npu ``npu_incre_flash_attention``:
  https://hiascend.com/document/detail/zh/Pytorch/60RC1/apiref/apilist/ptaoplist_000451.html
- [RMS-plugin] hicann/ops-nn ``norm/rms_norm/framework/npu_rms_norm_onnx_plugin.cpp`` and
  ``norm/rms_norm/op_graph/rms_norm_proto.h`` (see docs/cann.md, "Lowerings")
- [RoPE-plugin] cann/ops-transformer (mirror yuanfang-chen/ops-transformer)
  ``posembedding/rotary_position_embedding/framework/npu_rotary_position_embedding_onnx_plugin.cpp``
- [RoPE-IR] same repository, ``posembedding/rotary_position_embedding/op_graph/rotary_position_embedding_proto.h``
- [RoPE-doc] same repository, ``posembedding/rotary_position_embedding/docs/aclnnRotaryPositionEmbedding.md``
- [RoPE-tiling] same repository, ``posembedding/rotary_position_embedding/op_host/rope_rotate_half_tiling.cpp``
  and the kernel ``op_kernel/rotate_half.h``
- [MGS-plugin] cann/ops-transformer (mirror yuanfang-chen/ops-transformer)
  ``moe/moe_gating_top_k_softmax/framework/npu_moe_gating_top_k_softmax_onnx_plugin.cpp``; [MGS-IR]
  ``moe/moe_gating_top_k_softmax/op_graph/moe_gating_top_k_softmax_proto.h``; [MGS-doc]
  ``moe/moe_gating_top_k_softmax/docs/aclnnMoeGatingTopKSoftmax.md``
- [MIR-plugin] ``moe/moe_init_routing/framework/npu_moe_init_routing_onnx_plugin.cpp``; [MIR-IR]
  ``moe/moe_init_routing/op_graph/moe_init_routing_proto.h``; [MIR-doc] ``moe/moe_init_routing/docs/aclnnMoeInitRouting.md``
  and torch_npu's reference (Ascend/op-plugin ``test/test_custom_ops/test_npu_moe_init_routing.py``: a stable sort)
- [MFR-plugin] ``moe/moe_finalize_routing/framework/npu_moe_finalize_routing_onnx_plugin.cpp`` (reads no
  attribute); [MFR-IR] ``moe/moe_finalize_routing/op_graph/moe_finalize_routing_proto.h``; [MFR-doc]
  ``moe/moe_finalize_routing/docs/aclnnMoeFinalizeRouting.md``
- [WQBMM-plugin] hicann/ops-nn ``matmul/weight_quant_batch_matmul_v2/framework/
  npu_weight_quant_batchmatmul_v2_onnx_plugin.cpp``
- [WQBMM-IR] same repository, ``matmul/weight_quant_batch_matmul_v2/op_graph/weight_quant_batch_matmul_v2_proto.h``
- [WQBMM-doc] same repository, ``matmul/weight_quant_batch_matmul_v2/docs/aclnnWeightQuantBatchMatmulV2.md``
- [INT4Pack-doc] same repository, ``matmul/convert_weight_to_int4_pack/docs/aclnnConvertWeightToINT4Pack_en.md``
"""
from __future__ import annotations

import numpy as np

#: [RMS-plugin]: the plugin ignores the node's attributes and sets RmsNorm's epsilon to 1e-6.
RMS_EPSILON = 1e-6
#: [PFA-plugin]: the node has 3, 5, 7, 9 or 12 inputs (query, key, value; pse_shift, atten_mask;
#: actual_seq_lengths, actual_seq_lengths_kv; deq_scale1, quant_scale1; deq_scale2, quant_scale2, quant_offset2).
PFA_INPUT_COUNTS = (3, 5, 7, 9, 12)
#: [PFA-IR] / [PFA-doc] "sparseMode": 0 defaultMask, 1 allMask, 2 leftUpCausal, 3 rightDownCausal, 4 band.
#: 2..4 take the optimized 2048 x 2048 mask ``triu(ones, 1)`` instead of a full one.
SPARSE_TEMPLATE = 2048
#: [PFA-doc]: "preTokens ... 2147483647" (the documented "everything" value of pre/next tokens).
ALL_TOKENS = 2147483647
#: [PFA-doc] limits (Atlas A2/A3): D <= 512, N <= 256, numHeads / numKeyValueHeads <= 64.
MAX_HEAD_DIM, MAX_HEADS, MAX_GROUP = 512, 256, 64
#: [RoPE-IR] / [RoPE-doc] "mode": 0 half (rotate-half), 1 interleave; 2 and 3 are Ascend 910_95 only.
ROPE_HALF, ROPE_INTERLEAVE = 0, 1
#: [RoPE-doc] (Atlas A2/A3): "D<896" and a multiple of 2 ([RoPE-IR] and [RoPE-tiling] allow 896 itself).
ROPE_MAX_HEAD_DIM = 895
#: [RoPE-doc] cos/sin shapes per mode for a 4-D x, as which of x's three leading dims they keep ("f") or
#: broadcast ("1"): half takes 11SD, B1SD, BNSD for a BNSD x, 1S1D, BS1D, BSND for BSND, S11D, SB1D, SBND
#: for SBND; interleave only 11SD, 1S1D, S11D.
ROPE_ANGLE_LAYOUTS = {ROPE_HALF: frozenset({"11f", "f1f", "fff", "1f1", "ff1", "f11"}),
                      ROPE_INTERLEAVE: frozenset({"11f", "1f1", "f11"})}


def template_mask() -> np.ndarray:
    """The optimized causal mask sparse modes 2..4 take ([PFA-doc]): bool ``triu(ones(2048, 2048), 1)``."""
    return np.triu(np.ones((SPARSE_TEMPLATE, SPARSE_TEMPLATE), dtype=bool), 1)

#: [MGS-IR] / [MGS-doc]: "k ... not greater than 1024" (and <= the experts).
MOE_MAX_K = 1024
#: [MIR-doc] "expandedXOut ... shape (min(NUM_ROWS, activeNum) * k, H)": an active_num of int32's max keeps every
#: row when the token count is dynamic (active_num is an INT32 attribute, [MIR-IR]).
MOE_ALL_ROWS = 2147483647

#: [WQBMM-plugin]: ``NPUWeightQuantBatchMatmulV2`` inputs (x, weight, antiquant_scale, antiquant_offset,
#: quant_scale, quant_offset, bias); attributes ``antiquant_group_size`` (default 0) and ``dtype`` (default
#: -1: y in x's dtype); the plugin sets transpose_x = transpose_weight = false, so weight is (k, n).
WQBMM_MAX_INPUTS = 7
#: [WQBMM-IR] / [WQBMM-doc]: "antiquant_group_size must in [0, k-1] and antiquant_group_size % 32 == 0"
#: (0: per-tensor or per-channel); k and n in [1, 65535]; x 2-D (m, k) on Atlas A2/A3.
WQBMM_GROUP_MULTIPLE, WQBMM_MAX_DIM = 32, 65535
#: [WQBMM-IR]: x float16 or bfloat16; antiquant_scale/antiquant_offset of x's dtype.
WQBMM_X_DTYPES = ("float16", "bfloat16")
#: [WQBMM-IR] / [INT4Pack-doc]: int4 weights as int32 carrying eight int4 values, shape (k, n / 8); k3opt
#: packs value j of a word in bits 4j..4j+3 (the low nibble first, as ONNX packs INT4 and as the bytes of a
#: little-endian int32 then read).
WQBMM_INT4_PER_INT32 = 8


def unpack_int4_words(words: np.ndarray) -> np.ndarray:
    """int32 ``(k, n / 8)`` words -> the int8 ``(k, n)`` int4 values they carry (see :data:`WQBMM_INT4_PER_INT32`)."""
    u = words.astype(np.uint32)[..., None] >> (4 * np.arange(WQBMM_INT4_PER_INT32, dtype=np.uint32))
    nib = (u & 0xF).astype(np.int8)
    return ((nib ^ 8) - 8).astype(np.int8).reshape(words.shape[0], -1)


def pack_int4_words(values: np.ndarray) -> np.ndarray:
    """The inverse of :func:`unpack_int4_words`: int8 ``(k, n)`` int4 values (n a multiple of 8) -> int32 words."""
    nib = (values.astype(np.int64) & 0xF).reshape(values.shape[0], -1, WQBMM_INT4_PER_INT32)
    words = (nib << (4 * np.arange(WQBMM_INT4_PER_INT32, dtype=np.int64))).sum(axis=-1)
    return words.astype(np.uint32).view(np.int32)

