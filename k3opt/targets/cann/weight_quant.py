"""``k3opt quantize --target cann`` (the cann target's :meth:`~k3opt.targets.base.Target.lower_quantized` and
``verify_quantized``): the quantized model's DequantizeLinear -> MatMul pairs lowered to
``NPUWeightQuantBatchMatmulV2`` while the model is still at the opset its DequantizeLinear needs.

Blocked (int4) DequantizeLinear exists from opset 21 only, and the cann target is opset 17: the pairs are
lowered first (the ``lower-weight-quant-npu`` pass, run here on the quantized model), then
``k3opt optimize --target cann`` does the rest: its passes, opset 17, the NPU nodes moved to the default
domain. The result is verified here against the quantized model: the lowered output run
under the NPU reference ops, the quantized one in onnxruntime, at fp16's tolerance.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx

from ... import modelio
from ...errors import VerificationError
from ...graph import ir
from ...graph.lifetime import graph_scope
from ...modelio import opset as opsets
from ...pipeline import shapes
from ...pipeline import verify as verifier
from ...pipeline.pass_base import PassContext
from .. import get_target
from .passes.lower_weight_quant_npu import FP16_TOLERANCE, LowerWeightQuantNPU


def lower(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """``model`` (quantized, any opset) with its DequantizeLinear -> MatMul pairs lowered, the NPU nodes still
    in the staging domain (``optimize --target cann`` brings the model to opset 17 after its passes and moves
    them to the default domain); and the lowering lines."""

    ctx = PassContext(opset=opsets.model_opset(model), target=get_target("cann"))
    with graph_scope():
        graph = modelio.import_graph(model)
        tensors = ir.tensor_map(graph)
        ctx.names = ir.NameScope(graph, tensors)
        shapes.ShapeRefresher().seed(graph, model, tensors)
        lowering = LowerWeightQuantNPU()
        lowering.run(graph, ctx)
        lowering.finish(graph, ctx)
        out = modelio.export_graph(graph, model)
    return out, list(ctx.notes)


def verify(quantized: Path, lowered: Path, seed: int = 0) -> dict[str, Any]:
    """Compare the lowered file (NPU reference ops) with the quantized one (onnxruntime) on seeded inputs;
    raises VerificationError beyond fp16's tolerance."""
    from .reference import evaluator

    proto = onnx.load(str(quantized))
    reference = verifier.session(quantized)
    feeds = dict(verifier.make_feeds(proto, seed=seed, run=lambda f: verifier.run(reference, f)))
    expected = verifier.run(reference, feeds)
    model = onnx.load(str(lowered))
    actual = evaluator(model).run(None, feeds)
    names = [o.name for o in proto.graph.output]
    rtol, atol = FP16_TOLERANCE
    result = verifier.compare(expected, [np.asarray(a) for a in actual], names, rtol=rtol, atol=atol)
    if result["status"] != "passed":
        raise VerificationError("the NPU form differs from the quantized model under the reference ops ("
                                + verifier.failure_detail(result) + "); nothing was written")
    return result
