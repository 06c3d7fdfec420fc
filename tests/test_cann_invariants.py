"""The cann target's invariants, and when an RMSNorm may become NPURmsNorm (refusal reasons)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from k3opt.targets.cann.target_form import invariant_violations
from k3opt.targets.cann.passes.lower_rmsnorm_npu import refusal
from tests.helpers import make_model

F = TensorProto.FLOAT


def model_with(nodes, opsets=(("", 17),), functions=()):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [1, 4])],
                              [helper.make_tensor_value_info(nodes[-1].output[0], F, [1, 4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets],
                             functions=list(functions))


def test_clean_cann_model():
    relu = helper.make_node("Relu", ["x"], ["y"], name="r")
    npu = helper.make_node("NPURmsNorm", ["y", "x"], ["z", "rstd"], name="n")
    assert invariant_violations(model_with([relu, npu])) == []
    assert invariant_violations(make_model([relu], [("x", F, [1, 4])], [("y", F, [1, 4])])) == []


@pytest.mark.parametrize("nodes, opsets, expected", [
    ([helper.make_node("Relu", ["x"], ["y"])], (("", 18),), "opset imports [('ai.onnx', 18)]"),
    ([helper.make_node("Relu", ["x"], ["y"])], (("", 17), ("com.microsoft", 1)), "expected exactly"),
    ([helper.make_node("FastGelu", ["x"], ["y"], name="fg", domain="com.microsoft")], (("", 17),),
     "node 'fg' (com.microsoft::FastGelu) is not in the default domain"),
    ([helper.make_node("Gelu", ["x"], ["y"], name="g")], (("", 17),),
     "node 'g' (Gelu) is neither a standard opset-17 op nor an NPU op"),
    ([helper.make_node("RMSNormalization", ["x", "x"], ["y"], name="r")], (("", 17),), "(RMSNormalization)"),
])
def test_violations(nodes, opsets, expected):
    found = invariant_violations(model_with(nodes, opsets))
    assert any(expected in f for f in found), found


def test_model_local_functions_violate():
    fn = helper.make_function("local", "F", ["a"], ["b"], [helper.make_node("Relu", ["a"], ["b"])],
                              [helper.make_opsetid("", 17)])
    found = invariant_violations(model_with([helper.make_node("Relu", ["x"], ["y"])], functions=[fn]))
    assert any("model-local function" in f for f in found)


@pytest.mark.parametrize("args, why", [
    ((1e-6, np.float32, np.float32), None),
    ((1e-5, np.float32, np.float32), "epsilon 1e-05 is not the NPURmsNorm plugin's fixed 1e-06"),
    ((1e-6 * (1 + 1e-9), np.float32, np.float32), None),  # equal as float32: the plugin's attribute is a float
    ((1e-6, np.float16, np.float16), None),
    ((1e-6, np.float16, np.float32), None),
    ((1e-6, TensorProto.BFLOAT16, TensorProto.BFLOAT16), None),
    ((1e-6, TensorProto.BFLOAT16, TensorProto.FLOAT), None),
    ((1e-6, np.float32, np.float16), "no kernel for x float32 with gamma float16"),
    ((1e-6, np.float64, np.float64), "no kernel for x float64"),
])
def test_refusal(args, why):
    got = refusal(*args)
    assert got == why if why is None else why in (got or "")


def _pfa(domain=""):
    return helper.make_node("NPUPromptFlashAttention", ["x", "x", "x"], ["y"], name="pfa", num_heads=1,
                            input_layout="BSH", domain=domain)


@pytest.mark.parametrize("nodes, opsets, expected", [
    ([_pfa()], (("", 16),), None),
    ([_pfa("npu")], (("", 17), ("npu", 1)), None),
    ([_pfa()], (("", 17),), "NPU op ATC does not register at opset 17"),
    ([_pfa("npu")], (("", 17),), "not an op ATC registers as npu::1"),
    ([helper.make_node("LayerNormalization", ["x", "x"], ["y"], name="ln")], (("", 16),),
     "neither a standard opset-16 op"),
    ([_pfa("npu")], (("", 17), ("npu", 2)), "expected exactly one default-domain import"),
])
def test_flash_attention_forms(nodes, opsets, expected):
    found = invariant_violations(model_with(nodes, opsets))
    assert found == [] if expected is None else any(expected in f for f in found), found


def test_the_staged_form_moves_to_opset_16_only_when_nothing_differs():
    from k3opt.cann_bridge import finish_model
    from k3opt.targets.cann.target_form import STAGING_DOMAIN
    from k3opt.errors import CompileError

    out = finish_model(model_with([_pfa(STAGING_DOMAIN)], (("", 17), (STAGING_DOMAIN, 1))))
    assert [(o.domain, o.version) for o in out.opset_import] == [("", 16)] and not out.graph.node[0].HasField("domain")
    ln = helper.make_node("LayerNormalization", ["y", "x"], ["z"], name="ln")
    with pytest.raises(CompileError, match="LayerNormalization differ"):
        finish_model(model_with([_pfa(STAGING_DOMAIN), ln], (("", 17), (STAGING_DOMAIN, 1))))
