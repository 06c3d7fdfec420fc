"""The cann target's invariants, and when an RMSNorm may become NPURmsNorm (refusal reasons)."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper

from k3opt.cann_bridge.lowering import invariant_violations, refusal
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


def x_tensor(shape=(2, 8, 16)):
    return gs.Variable("x", dtype=np.float32, shape=list(shape))


@pytest.mark.parametrize("kwargs, why", [
    (dict(), None),
    (dict(epsilon=1e-5), "epsilon 1e-05 is not the NPURmsNorm plugin's fixed 1e-06"),
    (dict(epsilon=1e-6 * (1 + 1e-9)), None),  # equal as float32: the plugin's attribute is a float
    (dict(x_dtype=np.float16, gamma_dtype=np.float16), None),
    (dict(x_dtype=np.float16, gamma_dtype=np.float32), None),
    (dict(x_dtype=np.float32, gamma_dtype=np.float16), "no kernel for x float32 with gamma float16"),
    (dict(x_dtype=np.float64, gamma_dtype=np.float64), "no kernel for x float64"),
    (dict(axes=(1,)), "normalized axes [1] are not the trailing axes"),
    (dict(axes=(-2, -1), gamma_shape=(8, 16)), None),
    (dict(axes=(-2, -1), gamma_shape=(16,)), "weight shape (16,) is not the normalized dims (8, 16)"),
    (dict(gamma_shape=(1, 16)), "weight shape (1, 16)"),
    (dict(gamma_shape=None), "weight's shape is unknown"),
])
def test_refusal(kwargs, why):
    args = dict(epsilon=1e-6, x=x_tensor(), gamma_shape=(16,), x_dtype=np.float32, gamma_dtype=np.float32,
                axes=(-1,))
    args.update(kwargs)
    got = refusal(**args)
    assert got == why if why is None else why in (got or "")


def test_refusal_unknown_rank():
    assert "rank is unknown" in refusal(1e-6, gs.Variable("x"), (16,), np.float32, np.float32, (-1,))
