"""What the passes may ask of the run's target: its traits, with standard ONNX's answers.

The targets (:mod:`k3opt.targets`, above the passes) subclass :class:`TargetTraits` with their answers and the hooks
the run calls; a pass reads ``ctx.target.<trait>``, never the target's name. A :class:`PassContext
<k3opt.pipeline.pass_base.PassContext>` made without a target gets standard ONNX's traits (``STANDARD``).
"""
from __future__ import annotations

from typing import ClassVar


class TargetTraits:
    """The traits of a target the passes read. Compares equal to its name (a plugin's ``ctx.target == "cann"``)."""

    #: The name ``--target`` takes (empty for :data:`STANDARD`, the traits alone).
    name: ClassVar[str] = ""
    #: The fusions may emit opset 23's standard Attention, RMSNormalization and RotaryEmbedding; False: they
    #: leave those decomposed (the target's lowering passes decide).
    fuses_to_standard_ops: ClassVar[bool] = True
    #: How matmul-add fuses a rank > 2 MatMul + Add when its ``matmul_add_nd`` option is ``auto``.
    matmul_add_nd: ClassVar[str] = "keep"
    #: The target runs a MatMul best on 2-D operands (unflatten-matmul leaves flattened ones as they are).
    prefers_2d_matmuls: ClassVar[bool] = False
    #: matmul-add also fuses a rank-2 MatMul + Add whose weight or bias is computed (into a Gemm).
    fuses_computed_matmul_add: ClassVar[bool] = True
    #: The target has its own attention lowering (einsum-attention then unfolds Einsum attentions for it at any
    #: opset, not only where opset 23's Attention can take them).
    lowers_attention: ClassVar[bool] = False
    #: merge-sibling-matmuls also merges a pair of bias-less projections (gate/up): worth one bigger matmul.
    merges_projection_pairs: ClassVar[bool] = False
    #: A Gemm's alpha and beta other than 1 are honoured (fold-scalar-scale may set them).
    honours_gemm_scales: ClassVar[bool] = True
    #: The target runs CastLike (else castlike-to-cast notes the ones it could not rewrite).
    runs_castlike: ClassVar[bool] = True

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            return other == self.name
        return isinstance(other, TargetTraits) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"<target {self.name}>"


#: Standard ONNX's traits, for a pass context made without a target (tests, a pass run by hand).
STANDARD = TargetTraits()
