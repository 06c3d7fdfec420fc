"""conv1d-to-conv2d: only for --target cann; every attribute form, equal in onnxruntime; 2-D Convs untouched."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import k3opt
from k3opt.targets.cann.passes.conv1d_to_conv2d import Conv1dToConv2d
from tests.helpers import assert_equivalent, make_model, op_counts, run_passes

F = TensorProto.FLOAT
RNG = np.random.default_rng(9)


def conv1d(opset=17, bias=True, const_weight=True, **attrs):
    inits = {"b": RNG.standard_normal(6).astype(np.float32)} if bias else {}
    inputs = [("x", F, ["N", 4, 20])]
    if const_weight:
        inits["W"] = RNG.standard_normal((6, 4 // attrs.get("group", 1), 3)).astype(np.float32)
    else:
        inputs.append(("W", F, [6, 4, 3]))
    node = helper.make_node("Conv", ["x", "W"] + (["b"] if bias else []), ["c"], **attrs)
    return make_model([node, helper.make_node("Relu", ["c"], ["y"])], inputs, [("y", F, ["N", 6, "L"])], inits,
                      opset=opset)


@pytest.mark.parametrize("opset", [11, 17])
@pytest.mark.parametrize("attrs", [{}, dict(pads=[2, 1], strides=[2], dilations=[2]), dict(group=2, kernel_shape=[3]),
                                   dict(auto_pad="SAME_UPPER")], ids=["plain", "pads-strides-dilations", "group", "same"])
def test_lowered_and_equal(opset, attrs):
    model = conv1d(opset, **attrs)
    out, pm, _ = run_passes(model, [Conv1dToConv2d()], target="cann")
    assert pm.stats["conv1d-to-conv2d"].rewrites == 1
    assert op_counts(out) == {"Unsqueeze": 1, "Conv": 1, "Squeeze": 1, "Relu": 1}
    conv = next(n for n in out.graph.node if n.op_type == "Conv")
    assert len(next(i for i in out.graph.initializer if i.name == conv.input[1]).dims) == 4
    assert_equivalent(model, out)


def test_only_for_cann_and_3d_constant_weights():
    model = conv1d()
    assert op_counts(k3opt.optimize(model)) == {"Conv": 1, "Relu": 1}
    assert op_counts(k3opt.optimize(model, target="cann"))["Conv"] == 1
    assert "Unsqueeze" in op_counts(k3opt.optimize(model, target="cann"))
    out, pm, _ = run_passes(conv1d(const_weight=False), [Conv1dToConv2d()], target="cann")
    assert pm.stats["conv1d-to-conv2d"].rewrites == 0
    node = helper.make_node("Conv", ["x", "W"], ["y"])
    two_d = make_model([node], [("x", F, [1, 4, 5, 5])], [("y", F, [1, 6, 3, 3])],
                       {"W": RNG.standard_normal((6, 4, 3, 3)).astype(np.float32)})
    out, pm, _ = run_passes(two_d, [Conv1dToConv2d()], target="cann")
    assert pm.stats["conv1d-to-conv2d"].rewrites == 0
