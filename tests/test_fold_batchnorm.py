"""fold-batchnorm and merge-conv-bias on hand-made graphs: every producer, every refusal, onnxruntime numerics."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from k3opt.passes.fold.fold_batchnorm import FoldBatchNorm
from k3opt.passes.fold.merge_conv_bias import MergeConvBias
from tests.helpers import assert_equivalent, make_model, op_counts, run_passes

F, H = TensorProto.FLOAT, TensorProto.FLOAT16
RNG = np.random.default_rng(3)


def w(*shape, dtype=np.float32) -> np.ndarray:
    return RNG.standard_normal(shape).astype(dtype)


def bn_inits(c: int, dtype=np.float32, var=None) -> dict:
    return {"s": (1 + 0.3 * w(c)).astype(dtype), "B": w(c, dtype=dtype), "mean": w(c, dtype=dtype),
            "var": (0.5 + RNG.random(c)).astype(dtype) if var is None else np.asarray(var, dtype)}


def bn_node(x="p", y="bnout", **attrs):
    return helper.make_node("BatchNormalization", [x, "s", "B", "mean", "var"], [y], name="bn", **attrs)


def model_with(producer, x_shape, out_shape, inits, tail=None, dtype=F, outputs=None, opset=17):
    """``producer`` -> tail (default BatchNormalization) -> Relu -> y."""
    tail = [bn_node()] if tail is None else tail
    nodes = [producer] + tail + [helper.make_node("Relu", [tail[-1].output[0]], ["y"])]
    outs = [("y", dtype, out_shape)] + list(outputs or [])
    return make_model(nodes, [("x", dtype, x_shape)], outs, inits, opset=opset)


def folded(model, passes=None):
    out, pm, ctx = run_passes(model, passes or [FoldBatchNorm()])
    return out, sum(s.rewrites for s in pm.stats.values()), ctx


def conv(bias=True, group=1, cin=4, cout=6):
    inits = {"W": w(cout, cin // group, 3, 3)}
    if bias:
        inits["b"] = w(cout)
    node = helper.make_node("Conv", ["x", "W"] + (["b"] if bias else []), ["p"], name="conv", pads=[1, 1, 1, 1],
                            group=group)
    return node, inits


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("group", [1, 2])
def test_conv_bn(bias, group):
    node, inits = conv(bias, group)
    model = model_with(node, [2, 4, 5, 5], [2, 6, 5, 5], {**inits, **bn_inits(6)})
    out, n, _ = folded(model)
    assert n == 1 and op_counts(out) == {"Conv": 1, "Relu": 1}
    assert_equivalent(model, out)


def test_conv1d_bn_as_graph_output():
    inits = {"W": w(6, 4, 3), **bn_inits(6)}
    nodes = [helper.make_node("Conv", ["x", "W"], ["p"]), bn_node(y="y")]
    model = make_model(nodes, [("x", F, ["N", 4, 9])], [("y", F, ["N", 6, 7])], inits)
    out, n, _ = folded(model)
    assert n == 1 and op_counts(out) == {"Conv": 1} and out.graph.output[0].name == "y"
    assert_equivalent(model, out)


@pytest.mark.parametrize("group", [1, 2])
def test_conv_transpose_bn(group):
    inits = {"W": w(4, 6 // group, 3, 3), "b": w(6), **bn_inits(6)}
    node = helper.make_node("ConvTranspose", ["x", "W", "b"], ["p"], group=group, strides=[2, 2])
    model = model_with(node, [2, 4, 5, 5], [2, 6, 11, 11], inits)
    out, n, _ = folded(model)
    assert n == 1 and op_counts(out) == {"ConvTranspose": 1, "Relu": 1}
    assert_equivalent(model, out)


@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("c_shape", [None, (6,), (1, 6), (3, 6), (3, 1)], ids=["noC", "N", "1xN", "MxN", "Mx1"])
def test_gemm_bn(trans_b, c_shape):
    inits = {"W": w(6, 8) if trans_b else w(8, 6), **bn_inits(6)}
    inputs = ["x", "W"]
    if c_shape is not None:
        inits["C"] = w(*c_shape)
        inputs.append("C")
    node = helper.make_node("Gemm", inputs, ["p"], transB=trans_b, alpha=0.7, beta=1.3)
    model = model_with(node, [3, 8], [3, 6], inits)
    out, n, _ = folded(model)
    assert n == 1 and op_counts(out) == {"Gemm": 1, "Relu": 1}
    assert_equivalent(model, out)


def test_matmul_bn_becomes_gemm():
    node = helper.make_node("MatMul", ["x", "W"], ["p"])
    model = model_with(node, [3, 8], [3, 6], {"W": w(8, 6), **bn_inits(6)})
    out, n, _ = folded(model)
    assert n == 1 and op_counts(out) == {"Gemm": 1, "Relu": 1}
    assert_equivalent(model, out)


def test_fp16_conv_bn():
    node, inits = conv()
    inits = {k: v.astype(np.float16) for k, v in inits.items()}
    model = model_with(node, [2, 4, 5, 5], [2, 6, 5, 5], {**inits, **bn_inits(6, np.float16)}, dtype=H)
    out, n, _ = folded(model)
    assert n == 1
    assert_equivalent(model, out, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("shape", [(6, 1, 1), (1, 6, 1, 1), (), (1,), (1, 1, 1)], ids=["C11", "1C11", "scalar", "1", "111"])
@pytest.mark.parametrize("const_first", [False, True])
def test_conv_mul(shape, const_first):
    node, inits = conv()
    inits["k"] = w(*shape)
    mul = helper.make_node("Mul", ["k", "p"] if const_first else ["p", "k"], ["m"])
    model = model_with(node, [2, 4, 5, 5], [2, 6, 5, 5], inits, tail=[mul])
    out, n, _ = folded(model)
    assert n == 1 and op_counts(out) == {"Conv": 1, "Relu": 1}
    assert_equivalent(model, out)


@pytest.mark.parametrize("shape", [(6, 1, 1), (1, 6, 1, 1), (), (1,)], ids=["C11", "1C11", "scalar", "1"])
@pytest.mark.parametrize("bias", [True, False])
def test_conv_bias_add(shape, bias):
    node, inits = conv(bias)
    inits["k"] = w(*shape)
    add = helper.make_node("Add", ["k", "p"], ["a"])
    model = model_with(node, [2, 4, 5, 5], [2, 6, 5, 5], inits, tail=[add])
    out, n, _ = folded(model, [MergeConvBias()])
    assert n == 1 and op_counts(out) == {"Conv": 1, "Relu": 1}
    assert_equivalent(model, out)


def test_gemm_bias_add_and_convtranspose_bias_add():
    gemm = helper.make_node("Gemm", ["x", "W", "C"], ["p"], transB=1, beta=0.5)
    model = model_with(gemm, [3, 8], [3, 6], {"W": w(6, 8), "C": w(6), "k": w(1, 6)},
                       tail=[helper.make_node("Add", ["p", "k"], ["a"])])
    out, n, _ = folded(model, [MergeConvBias()])
    assert n == 1 and op_counts(out) == {"Gemm": 1, "Relu": 1}
    assert_equivalent(model, out)
    ct = helper.make_node("ConvTranspose", ["x", "W"], ["p"], group=2)
    model = model_with(ct, [2, 4, 5, 5], [2, 6, 7, 7], {"W": w(4, 3, 3, 3), "k": w(6, 1, 1)},
                       tail=[helper.make_node("Add", ["p", "k"], ["a"])])
    out, n, _ = folded(model, [MergeConvBias()])
    assert n == 1 and op_counts(out) == {"ConvTranspose": 1, "Relu": 1}
    assert_equivalent(model, out)


def test_bn_then_bias_then_mul_chain():
    """All three fold into one Conv: the Mul follows the Conv once the Add is its bias."""
    node, inits = conv(False)
    inits.update(bn_inits(6), k=w(1, 6, 1, 1), m=w(6, 1, 1))
    tail = [bn_node(), helper.make_node("Add", ["bnout", "k"], ["a"]), helper.make_node("Mul", ["a", "m"], ["q"])]
    model = model_with(node, [2, 4, 5, 5], [2, 6, 5, 5], inits, tail=tail)
    out, n, _ = folded(model, [FoldBatchNorm(), MergeConvBias()])
    assert op_counts(out) == {"Conv": 1, "Relu": 1}
    assert_equivalent(model, out)


# ----------------------------------------------------------------------------------------------- refusals

def _refused(model, passes=None, note=None):
    out, n, ctx = folded(model, passes)
    assert n == 0 and op_counts(out) == op_counts(model)
    if note:
        assert any(note in m for m in ctx.notes), ctx.notes
    assert_equivalent(model, out)


def test_refuses_non_constant_statistics():
    node, inits = conv()
    stats = bn_inits(6)
    model = make_model([node, helper.make_node("BatchNormalization", ["p", "s", "B", "mean", "v"], ["y"])],
                       [("x", F, [2, 4, 5, 5]), ("v", F, [6])], [("y", F, [2, 6, 5, 5])],
                       {**inits, "s": stats["s"], "B": stats["B"], "mean": stats["mean"]})
    out, n, _ = folded(model)
    assert n == 0


def test_refuses_training_mode_and_used_statistics():
    node, inits = conv()
    bn = helper.make_node("BatchNormalization", ["p", "s", "B", "mean", "var"], ["y", "rm", "rv"], training_mode=1)
    model = make_model([node, bn], [("x", F, [2, 4, 5, 5])],
                       [("y", F, [2, 6, 5, 5]), ("rm", F, [6]), ("rv", F, [6])], {**inits, **bn_inits(6)})
    _refused(model, note="running mean/var")


def test_refuses_nonpositive_variance():
    node, inits = conv()
    stats = bn_inits(6, var=[-1.0, 1, 1, 1, 1, 1])
    out, n, ctx = folded(model_with(node, [2, 4, 5, 5], [2, 6, 5, 5], {**inits, **stats}))
    assert n == 0 and any("not positive" in m for m in ctx.notes)


def test_refuses_shared_or_output_conv():
    node, inits = conv()
    model = model_with(node, [2, 4, 5, 5], [2, 6, 5, 5], {**inits, **bn_inits(6)}, outputs=[("p", F, [2, 6, 5, 5])])
    _refused(model)
    model = model_with(node, [2, 4, 5, 5], [2, 6, 5, 5], {**inits, **bn_inits(6)},
                       tail=[bn_node(), helper.make_node("Add", ["bnout", "p"], ["sum"])])
    _refused(model)


def test_refuses_non_constant_weight():
    node = helper.make_node("Conv", ["x", "W"], ["p"])
    model = make_model([node, bn_node(y="y")], [("x", F, [2, 4, 5, 5]), ("W", F, [6, 4, 1, 1])],
                       [("y", F, [2, 6, 5, 5])], bn_inits(6))
    _refused(model, note="weight is not a constant")


def test_refuses_matmul_rank3_bn():
    node = helper.make_node("MatMul", ["x", "W"], ["p"])
    model = model_with(node, [2, 6, 8], [2, 6, 6], {"W": w(8, 6), **bn_inits(6)})
    _refused(model, note="axis 1")


@pytest.mark.parametrize("shape", [(1, 1, 1, 6), (6,), (1, 6, 1), (2, 6, 1, 1), (1, 1, 6, 1, 1)],
                         ids=["last", "vec", "1C1-on-rank4", "batch", "rank5"])
def test_refuses_mul_not_over_channels(shape):
    node, inits = conv(cin=4, cout=6)
    inits["W"] = w(6, 4, 1, 1)
    inits["k"] = w(*shape)
    mul = helper.make_node("Mul", ["p", "k"], ["m"])
    out_shape = list(np.broadcast_shapes((2, 6, 6, 6), shape))
    model = model_with(node, [2, 4, 6, 6], out_shape, inits, tail=[mul])
    model.graph.node[0].attribute.pop()  # no pads attribute: 1x1 kernel keeps 6x6
    _refused(model, note="channel axis")


def test_refuses_fp16_overflow():
    node, inits = conv()
    inits = {k: v.astype(np.float16) for k, v in inits.items()}
    stats = bn_inits(6, np.float16, var=[1e-7] * 6)
    stats["s"] = np.full(6, 60000, np.float16)
    model = model_with(node, [2, 4, 5, 5], [2, 6, 5, 5], {**inits, **stats}, dtype=H)
    out, n, ctx = folded(model)
    assert n == 0 and any("do not fit" in m for m in ctx.notes)


def test_idle_is_zero():
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [("x", F, [2])], [("y", F, [2])])
    assert folded(model, [FoldBatchNorm(), MergeConvBias()])[1] == 0


def test_refuses_fp16_subnormal_weights():
    node, inits = conv()
    inits = {k: v.astype(np.float16) for k, v in inits.items()}
    stats = bn_inits(6, np.float16)
    stats["s"] = np.full(6, 1e-4, np.float16)  # W * 1e-4 / sqrt(var): many weights below fp16's 6.1e-5
    model = model_with(node, [2, 4, 5, 5], [2, 6, 5, 5], {**inits, **stats}, dtype=H)
    out, n, ctx = folded(model)
    assert n == 0 and any("do not fit" in m for m in ctx.notes)
