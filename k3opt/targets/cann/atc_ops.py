"""Data: which ONNX nodes ATC's parser accepts, keyed by op type, as the set of model opsets.

ATC keys a node as ``<domain>::<model opset>::<OpType>`` (the model's opset
import, not a per-node version), so an op parses only when the model's
default-domain opset is one its plugin registers.

Sources (see docs/cann.md): the ATC reference (/work/shared/docs/atc-reference.md:
documented opset range v9..v18; Gemm, MatMul, Softmax, Einsum, Trilu,
ScatterND, Split, ReduceMean registered up to 18; LayerNormalization 17 and
18 only; the NPU ops and their opsets) and the op names of the public ONNX
plugin folder of Ascend's operator sources. An op in the list parses at every
model opset from max(9, the opset that introduced it) to 18. Ops of opset
19+ only (Gelu-20, RMSNormalization-23, Attention-23...) and every op of
another domain (``com.microsoft``...) have no parser. An op missing here is
reported as "not in k3opt's table", which may be conservative.
"""
from __future__ import annotations

#: The model opsets ATC documents for ONNX.
MIN_OPSET, MAX_OPSET = 9, 18

#: Standard ops with a parser, and the opset that introduced each (for the lower bound).
_STANDARD_SINCE = {
    "Abs": 1, "Acos": 7, "Acosh": 9, "Add": 1, "And": 1, "ArgMax": 1, "ArgMin": 1, "Asin": 7, "Asinh": 9,
    "Atan": 7, "Atanh": 9, "AveragePool": 1, "BatchNormalization": 1, "BitShift": 11, "Cast": 1, "Ceil": 1,
    "Celu": 12, "Clip": 1, "Compress": 9, "Concat": 1, "Constant": 1, "ConstantOfShape": 9, "Conv": 1,
    "ConvTranspose": 1, "Cos": 7, "Cosh": 9, "CumSum": 11, "DepthToSpace": 1, "Div": 1,
    "Dropout": 1, "Einsum": 12, "Elu": 1, "Equal": 1, "Erf": 9, "Exp": 1, "Expand": 8, "EyeLike": 9,
    "Flatten": 1, "Floor": 1, "GRU": 1, "Gather": 1, "GatherElements": 11, "GatherND": 11, "Gemm": 1,
    "GlobalAveragePool": 1, "GlobalLpPool": 1, "GlobalMaxPool": 1, "Greater": 1, "GreaterOrEqual": 12,
    "GridSample": 16, "HardSigmoid": 1, "HardSwish": 14, "Hardmax": 1, "Identity": 1, "If": 1,
    "InstanceNormalization": 1, "IsInf": 10, "IsNaN": 9, "LRN": 1, "LSTM": 1, "LeakyRelu": 1, "Less": 1,
    "LessOrEqual": 12, "Log": 1, "LogSoftmax": 1, "LpNormalization": 1, "LpPool": 1, "MatMul": 1, "Max": 1,
    "MaxPool": 1, "MaxRoiPool": 1, "MaxUnpool": 9, "Mean": 1, "MeanVarianceNormalization": 9, "Min": 1,
    "Mod": 10, "Mul": 1, "Multinomial": 7, "Neg": 1, "NonMaxSuppression": 10, "NonZero": 9, "Not": 1,
    "OneHot": 9, "Or": 1, "PRelu": 1, "Pad": 1, "Pow": 1, "RNN": 1, "Range": 11,
    "Reciprocal": 1, "ReduceL1": 1, "ReduceL2": 1, "ReduceLogSum": 1, "ReduceLogSumExp": 1, "ReduceMax": 1,
    "ReduceMean": 1, "ReduceMin": 1, "ReduceProd": 1, "ReduceSum": 1, "ReduceSumSquare": 1, "Relu": 1,
    "Reshape": 1, "Resize": 10, "ReverseSequence": 10, "RoiAlign": 10, "Round": 11, "ScatterElements": 11,
    "ScatterND": 11, "Selu": 1, "Shape": 1, "Shrink": 9, "Sigmoid": 1, "Sign": 9, "Sin": 7, "Sinh": 9,
    "Size": 1, "Slice": 1, "Softmax": 1, "Softplus": 1, "Softsign": 1, "SpaceToDepth": 1, "Split": 1,
    "Sqrt": 1, "Squeeze": 1, "Sub": 1, "Sum": 1, "Tan": 7, "Tanh": 1, "ThresholdedRelu": 10, "Tile": 1,
    "TopK": 1, "Transpose": 1, "Trilu": 14, "Unsqueeze": 1, "Where": 9, "Xor": 1,
}

#: Standard ops ATC does not take from ONNX, and why (``k3opt check`` says it): /work/shared/docs/atc-reference.md,
#: "Weight-only quantization": Huawei's docs say a QuantizeLinear/DequantizeLinear model must be converted
#: (AMCT) before ATC, and no QDQ plugin was found.
NO_PARSER = {
    op: "Huawei's docs say a QuantizeLinear/DequantizeLinear model must be converted (AMCT) before ATC; "
        "`k3opt optimize --target cann` lowers a weight's DequantizeLinear -> MatMul to NPUWeightQuantBatchMatmulV2"
    for op in ("DequantizeLinear", "QuantizeLinear")
}

#: Ops whose registered opsets differ from the default range (reference, "Which ONNX graphs ATC accepts").
_SPECIAL = {
    "LayerNormalization": range(17, 19),
    "NPURmsNorm": range(11, 19),
    "NPUAddRmsNorm": range(11, 19),
    # Registered for 11..16 and 19, NOT 17/18 (the OriginOpType lists of
    # attention/{prompt,incre}_flash_attention/framework/npu_*_flash_attention_onnx_plugin.cpp in
    # cann/ops-transformer, mirror yuanfang-chen/ops-transformer): a model with one is at 16, or uses npu::1.
    "NPUPromptFlashAttention": [*range(11, 17), 19],
    "NPUIncreFlashAttention": [*range(11, 17), 19],
    "NPUFusedAttentionScore": range(11, 19),
    # OriginOpType list of posembedding/rotary_position_embedding/framework/
    # npu_rotary_position_embedding_onnx_plugin.cpp (cann/ops-transformer): ai.onnx::11..18 and npu::1.
    "NPURotaryPositionEmbedding": range(11, 19),
    # OriginOpType lists of moe/{moe_gating_top_k_softmax,moe_init_routing,moe_finalize_routing}/framework/
    # npu_*_onnx_plugin.cpp (cann/ops-transformer): ai.onnx::11..18 and npu::1.
    "NPUMoeInitRouting": range(11, 19),
    "NPUMoeGatingTopKSoftmax": range(11, 19),
    "NPUMoeFinalizeRouting": range(11, 19),
    # OriginOpType list of matmul/weight_quant_batch_matmul_v2/framework/
    # npu_weight_quant_batchmatmul_v2_onnx_plugin.cpp (hicann/ops-nn): ai.onnx::11..19 (and
    # npu::1::WeightQuantBatchMatmulV2, a name without the NPU prefix that k3opt does not emit).
    "NPUWeightQuantBatchMatmulV2": range(11, 20),
}

#: op type -> the default-domain model opsets at which ATC has a parser for it.
ATC_PARSERS: dict[str, frozenset[int]] = {
    **{op: frozenset(range(max(MIN_OPSET, since), MAX_OPSET + 1)) for op, since in _STANDARD_SINCE.items()},
    **{op: frozenset(versions) for op, versions in _SPECIAL.items()},
}

#: NPU-specific ops ATC maps directly; the only non-standard ops a cann-target model may contain.
NPU_OPS = frozenset(op for op in _SPECIAL if op.startswith("NPU"))

#: NPU ops whose plugin also registers ``npu::1::<Op>`` (torch_npu's exporter domain), as read in the plugin
#: sources: the two flash attentions, the rotary embedding and the MoE ops (above) and NPURmsNorm (hicann/ops-nn
#: norm/rms_norm/framework).
NPU_DOMAIN_OPS = frozenset({"NPURmsNorm", "NPUPromptFlashAttention", "NPUIncreFlashAttention",
                            "NPURotaryPositionEmbedding", "NPUMoeGatingTopKSoftmax", "NPUMoeInitRouting",
                            "NPUMoeFinalizeRouting"})

#: Graph-input element types the ONNX parser maps to a GE type (``onnx.TensorProto`` names).
ACCEPTED_INPUT_DTYPES = frozenset({
    "FLOAT", "FLOAT16", "BFLOAT16", "DOUBLE", "INT8", "INT16", "INT32", "INT64",
    "UINT8", "UINT16", "UINT32", "UINT64", "BOOL",
})
