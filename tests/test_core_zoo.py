"""The core pipeline (opset conversion, shapes written to the output) on the zoo's real exports."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import k3opt
from k3opt.modelio import opset as opsets
from k3opt.report import Report
from tests.helpers import assert_equivalent, assert_value_info_holds, run_ort
from tests.zoo import zoo_inputs, zoo_model

#: The dynamo exports at opset 18 whose ReduceMean axes are a Reshape of constants until folding.
DOWN_TO_17 = [pytest.param(n, marks=pytest.mark.slow) for n in ("llama", "qwen2", "deepseek_v3")]


@pytest.mark.parametrize("name", DOWN_TO_17)
def test_dynamo_exports_go_down_to_17_after_the_passes(name):
    path = zoo_model(name, "dynamo")
    report = Report()
    cann = k3opt.optimize(str(path), target="cann", verify=True, input_data=zoo_inputs(name), report=report)
    # lower-attention-npu's auto form writes an RMSNorm LLM at opset 16 (NPUPromptFlashAttention has no 17/18
    # parser), DeepSeek-V3's MLA included (v padded to the q/k head dim)
    assert [(o.domain, o.version) for o in cann.opset_import] == [("", 16)]
    assert report.verification["status"] == "passed" and "opset converted from 18 to 17" in report.notes
    out = k3opt.optimize(str(path), opset=17)
    assert opsets.model_opset(out) == 17
    onnx.checker.check_model(out)
    assert_equivalent(onnx.load(str(path)), out, feeds=zoo_inputs(name))


@pytest.mark.slow
@pytest.mark.parametrize("skip", [(), ("sequence-to-split",)], ids=["default", "sequences-kept"])
def test_deepseek_v3_dynamo_runs_with_all_onnxruntime_optimizations(skip):
    """Its SequenceAt outputs once got one made-up symbolic shape: onnxruntime's buffer reuse then failed."""
    path = zoo_model("deepseek_v3", "dynamo")
    out = k3opt.optimize(str(path), skip=skip)
    feeds = zoo_inputs("deepseek_v3")
    assert_value_info_holds(out, feeds)
    session = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])  # all optimizations
    expected = run_ort(onnx.load(str(path)), feeds)
    for a, b in zip(expected, session.run(None, feeds)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
