"""lower-rmsnorm-npu: a recognised RMSNorm becomes ``NPURmsNorm`` for ``--target cann`` where ATC's plugin
computes exactly the same thing (a target lowering: runs after the verified passes).

Per the plugin sources (hicann/ops-nn ``norm/rms_norm``): the ONNX node ``NPURmsNorm(x, gamma) -> (y,
rstd)`` in the default domain maps to GE ``RmsNorm``; epsilon is hard-coded to 1e-6 (the node's
attributes are ignored); gamma must have exactly the shape of x's trailing normalized dims; y has x's
dtype, rstd is float32 (x's shape with the normalized dims set to 1); (x, gamma) dtypes are one of the
pairs in :data:`DTYPE_PAIRS`. The norm recogniser (:func:`.rms_norm.rmsnorm_rules`) has proved the rest
exact. Anything else stays decomposed and the report's lowering lines say why.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ..target_form import STAGING_DOMAIN
from ....graph import dtypes
from ....graph.ir import Graph, Tensor
from ....patterns import RewriteBuilder, apply_rules
from ....passes._shared.norm_match import NormMatch, affine_input, norm_input
from ....pipeline.pass_base import PassContext
from ....passes._shared.norm_match import rmsnorm_rules
from ._npu_lowering import NPULowering

#: ATC's NPURmsNorm plugin ignores the node's attributes and sets this epsilon.
PLUGIN_EPSILON = 1e-6
#: (x, gamma) dtypes RmsNorm has kernels for on Atlas A2/A3 (310P/910: only the equal pairs without bf16).
DTYPE_PAIRS = frozenset({("float16", "float32"), ("bfloat16", "float32"), ("float16", "float16"),
                         ("bfloat16", "bfloat16"), ("float32", "float32")})


def _dtype_name(dtype: Any) -> str:
    """numpy-style name of a gs/numpy/ONNX dtype (``bfloat16`` included)."""
    if isinstance(dtype, int):
        dtype = dtypes.numpy_dtype(dtype)
    return "bfloat16" if "bfloat16" in str(dtype) else np.dtype(dtype).name


def refusal(epsilon: float, x_dtype: Any, gamma_dtype: Any) -> Optional[str]:
    """Why an (already exact, trailing-axes) RMSNorm cannot become NPURmsNorm, or None when it can."""
    if np.float32(epsilon) != np.float32(PLUGIN_EPSILON):
        return f"epsilon {epsilon:g} is not the NPURmsNorm plugin's fixed {PLUGIN_EPSILON:g}"
    pair = (_dtype_name(x_dtype), _dtype_name(gamma_dtype))
    if pair not in DTYPE_PAIRS:
        return f"RmsNorm has no kernel for x {pair[0]} with gamma {pair[1]}"
    return None


class LowerRMSNormNPU(NPULowering):
    """RMSNorm -> NPURmsNorm (target cann) where the plugin's fixed eps and kernels make it exact."""

    name = "lower-rmsnorm-npu"
    description = "RMSNorm -> NPURmsNorm where exact (target cann; ATC's plugin fixes eps at 1e-6)"
    order = 2000
    npu_op, what, remark = "NPURmsNorm", "RMSNorm", "(ATC's plugin fixes eps at 1e-6)"
    recogniser = staticmethod(rmsnorm_rules)  # one rule per tail: kept is keyed by the reduce node

    def run(self, graph: Graph, ctx: PassContext) -> int:
        return apply_rules(graph, ctx, self.rules, bodies=True)

    def _rewrite(self, op: RewriteBuilder, nm: NormMatch) -> Optional[Tensor]:
        """``NPURmsNorm(x, gamma) -> (y, rstd)`` (+ the bias, if any), or None: stays decomposed, reason kept."""
        where = nm.reduce.name
        why = refusal(nm.epsilon, nm.output_dtype, nm.output_dtype)
        if why is not None:
            self.kept.setdefault(where, f"RMSNorm at '{where}' kept decomposed: {why}")
            return None
        # The recogniser proved the axes trailing and the normalized dims static; these give x in the
        # result's dtype and gamma of exactly the normalized shape, as the plugin requires.
        x = norm_input(op, nm)
        gamma = affine_input(op, nm, nm.weight, 1.0)
        y, rstd = op.NPURmsNorm(x, gamma, _outputs=2, _name="NPURmsNorm", _domain=STAGING_DOMAIN)
        rstd.dtype = np.float32  # and no shape: onnx's inference does not know NPU ops
        if nm.bias is not None:
            y = op.Add(y, affine_input(op, nm, nm.bias, 0.0))
        self.lowered.append(f"RMSNorm at '{where}' -> NPURmsNorm")
        return y
