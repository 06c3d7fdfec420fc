"""``lower``: the NPU lowerings of ``--target cann``, applied after verification, and the target's invariants.

Lowerings: ``CastLike`` -> ``Cast`` (ATC has no CastLike parser); and a
recognised RMSNorm (``x / sqrt(mean(x^2) + eps) * w``, found by
:func:`k3opt.passes.rms_norm.rmsnorm_rules`) becomes ``NPURmsNorm`` when
ATC's plugin computes exactly the same thing. Per the plugin sources
(hicann/ops-nn ``norm/rms_norm``): the ONNX node ``NPURmsNorm(x, gamma) -> (y,
rstd)`` in the default domain maps to GE ``RmsNorm``; epsilon is hard-coded
to 1e-6 (the node's attributes are ignored); gamma must have exactly the
shape of x's trailing normalized dims; y has x's dtype, rstd is float32
(x's shape with the normalized dims set to 1); (x, gamma) dtypes are one
of the pairs in :data:`DTYPE_PAIRS`. Anything else stays decomposed and the
report says why. onnxruntime cannot run the NPU node, which is why the
lowering comes after verification.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from .. import api, io, shapes
from ..errors import CompileError
from ..ir import NameScope
from ..passes.base import PassContext
from ..patterns import RewriteBuilder
from ..passes._norm_common import NormMatch, OrderedRulesPass, affine_input, norm_input
from ..passes.rms_norm import rmsnorm_rules
from .atc_ops import NPU_OPS
from .compat import all_nodes

CANN_OPSET = 17
#: NPU nodes are built in this domain (the rewriter checks default-domain nodes against ONNX's schemas,
#: which do not know them), then moved to the default domain, where ATC's parser looks them up.
_STAGING_DOMAIN = "k3opt.npu"
#: ATC's NPURmsNorm plugin ignores the node's attributes and sets this epsilon.
PLUGIN_EPSILON = 1e-6
#: (x, gamma) dtypes RmsNorm has kernels for on Atlas A2/A3 (310P/910: only the equal pairs without bf16).
DTYPE_PAIRS = frozenset({("float16", "float32"), ("bfloat16", "float32"), ("float16", "float16"),
                         ("bfloat16", "bfloat16"), ("float32", "float32")})


def _dtype_name(dtype: Any) -> str:
    """numpy-style name of a gs/numpy/ONNX dtype (``bfloat16`` included)."""
    if isinstance(dtype, int):
        dtype = onnx.helper.tensor_dtype_to_np_dtype(dtype)
    return "bfloat16" if "bfloat16" in str(dtype) else np.dtype(dtype).name


def refusal(epsilon: float, x_dtype: Any, gamma_dtype: Any) -> Optional[str]:
    """Why an (already exact, trailing-axes) RMSNorm cannot become NPURmsNorm, or None when it can."""
    if np.float32(epsilon) != np.float32(PLUGIN_EPSILON):
        return f"epsilon {epsilon:g} is not the NPURmsNorm plugin's fixed {PLUGIN_EPSILON:g}"
    pair = (_dtype_name(x_dtype), _dtype_name(gamma_dtype))
    if pair not in DTYPE_PAIRS:
        return f"RmsNorm has no kernel for x {pair[0]} with gamma {pair[1]}"
    return None


def invariant_violations(model: onnx.ModelProto) -> list[str]:
    """What breaks the cann target's contract: one default-domain opset import, 17; standard ops or NPU ops only."""
    found = []
    imports = [(o.domain or "ai.onnx", o.version) for o in model.opset_import]
    if imports != [("ai.onnx", CANN_OPSET)]:
        found.append(f"opset imports {imports}, expected exactly [('ai.onnx', {CANN_OPSET})]")
    if model.functions:
        found.append(f"{len(model.functions)} model-local function(s): ATC does not parse functions")
    for node in all_nodes(model.graph):
        if node.domain not in ("", "ai.onnx"):
            found.append(f"node '{node.name}' ({node.domain}::{node.op_type}) is not in the default domain")
        elif node.op_type not in NPU_OPS and not onnx.defs.has(node.op_type, CANN_OPSET, ""):
            found.append(f"node '{node.name}' ({node.op_type}) is neither a standard opset-{CANN_OPSET} op "
                         "nor an NPU op ATC registers")
    return found



class _RmsNormLowering:
    """The rewrite given to the RMSNorm recogniser: emits NPURmsNorm where exact, records why not elsewhere."""

    def __init__(self) -> None:
        self.lowered: list[str] = []
        #: reduce-node name -> reason; each rule (one per tail) may offer the same normalization again.
        self.kept: dict[str, str] = {}

    def rewrite(self, op: RewriteBuilder, nm: NormMatch) -> Optional[gs.Tensor]:
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
        y, rstd = op.NPURmsNorm(x, gamma, _outputs=2, _name="NPURmsNorm", _domain=_STAGING_DOMAIN)
        rstd.dtype = np.float32
        if nm.bias is not None:
            y = op.Add(y, affine_input(op, nm, nm.bias, 0.0))
        self.lowered.append(f"RMSNorm at '{where}' -> NPURmsNorm")
        return y

    def lines(self) -> list[str]:
        total = len(self.lowered) + len(self.kept)
        head = f"NPURmsNorm: {len(self.lowered)} of {total} RMSNorm(s) lowered (ATC's plugin fixes eps at 1e-6)"
        return [head, *self.lowered, *self.kept.values()] if total else ["NPURmsNorm: no RMSNorm found"]


def lower(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """Apply the NPU lowerings to a verified cann-target model; returns (model, one report line per lowering).

    Raises CompileError when the result breaks the target's invariants
    (:func:`invariant_violations`), which would make ATC refuse it.
    """
    graph = io.import_graph(model)
    shapes.ShapeRefresher()(graph)
    ctx = PassContext(opset=CANN_OPSET, target="cann", names=NameScope(graph))
    rms = _RmsNormLowering()
    OrderedRulesPass(rmsnorm_rules(rms.rewrite), name="lower-rmsnorm-npu").run(graph, ctx)
    for node in graph.nodes:
        if node.domain == _STAGING_DOMAIN:
            node.domain = None
    lines = rms.lines() + cast_like_to_cast(graph)
    out = api.export(graph, model)
    violations = invariant_violations(out)
    if violations:
        raise CompileError("the model breaks the cann target's invariants: " + "; ".join(violations[:5]))
    return out, lines


def cast_like_to_cast(graph: gs.Graph) -> list[str]:
    """``CastLike(x, like)`` -> ``Cast(x, to=dtype(like))`` wherever ``like``'s dtype is known (exact).

    ATC has no CastLike parser (k3opt's table; dynamo exports are full of
    them). Returns the report line, if any CastLike was seen.
    """
    done, left = 0, []
    for node in graph.nodes:
        if node.op != "CastLike":
            continue
        dtype = node.inputs[1].dtype
        if dtype is None:
            left.append(node.name)
            continue
        to = dtype if isinstance(dtype, int) else onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        node.op, node.attrs = "Cast", {"to": to}
        del node.inputs[1]  # keeps gs's use-def links right (the like-tensor loses this consumer)
        done += 1
    if not done and not left:
        return []
    kept = f"; {len(left)} kept (dtype of the second input unknown: {', '.join(left[:5])})" if left else ""
    return [f"CastLike -> Cast: {done} lowered{kept}"]
