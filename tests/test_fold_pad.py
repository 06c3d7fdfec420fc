"""fold-pad on hand-made graphs: Conv/AveragePool/MaxPool, both Pad forms, every refusal, onnxruntime numerics."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from k3opt.passes.fold.fold_pad import FoldPad
from tests.helpers import assert_equivalent, make_model, op_counts, run_passes

F = TensorProto.FLOAT
RNG = np.random.default_rng(5)
X = [2, 3, 8, 8]


def pad_node(pads, value=None, mode="constant", opset=17, axes=None):
    """A Pad x -> p; ``pads`` over all 4 axes (or over ``axes``)."""
    inits = {"pads": np.array(pads, np.int64)}
    ins = ["x", "pads"]
    if value is not None or axes is not None:
        ins.append("") if value is None else ins.append("val")
        if value is not None:
            inits["val"] = np.array(value, np.float32)
    if axes is not None:
        ins.append("axes")
        inits["axes"] = np.array(axes, np.int64)
    if opset < 11:
        attrs = dict(pads=pads, mode=mode) | ({} if value is None else dict(value=float(value)))
        return helper.make_node("Pad", ["x"], ["p"], **attrs), {}
    return helper.make_node("Pad", ins, ["p"], mode=mode), inits


def build(reader, pad, pad_inits, inits=None, opset=17, extra_out=()):
    nodes = [pad, reader, helper.make_node("Relu", ["r"], ["y"])]
    return make_model(nodes, [("x", F, X)], [("y", F, ["a", "b", "c", "d"])] + list(extra_out), {**pad_inits, **(inits or {})},
                      opset=opset)


def conv(**attrs):
    return helper.make_node("Conv", ["p", "W"], ["r"], **attrs), {"W": RNG.standard_normal((4, 3, 3, 3)).astype(np.float32)}


def run(model):
    out, pm, ctx = run_passes(model, [FoldPad()])
    return out, pm.stats["fold-pad"].rewrites, ctx


@pytest.mark.parametrize("opset", [10, 13, 18])
def test_conv(opset):
    pad, pi = pad_node([0, 0, 1, 2, 0, 0, 2, 1], opset=opset)
    node, wi = conv(pads=[1, 0, 0, 1])
    model = build(node, pad, pi, wi, opset=opset)
    out, n, _ = run(model)
    assert n == 1 and op_counts(out) == {"Conv": 1, "Relu": 1}
    assert_equivalent(model, out)


def test_conv_axes_input_and_explicit_zero_value():
    pad, pi = pad_node([1, 2, 1, 0], value=0.0, axes=[2, -1], opset=18)
    node, wi = conv(auto_pad="VALID")
    model = build(node, pad, pi, wi, opset=18)
    out, n, _ = run(model)
    assert n == 1 and op_counts(out) == {"Conv": 1, "Relu": 1}
    assert_equivalent(model, out)


@pytest.mark.parametrize("include", [0, 1])
def test_average_pool(include):
    pad, pi = pad_node([0, 0, 1, 1, 0, 0, 1, 1])
    node = helper.make_node("AveragePool", ["p"], ["r"], kernel_shape=[3, 3], count_include_pad=include)
    model = build(node, pad, pi)
    out, n, _ = run(model)
    assert n == 1 and op_counts(out) == {"AveragePool": 1, "Relu": 1}
    assert_equivalent(model, out)


def test_max_pool_with_minus_inf():
    pad, pi = pad_node([0, 0, 1, 1, 0, 0, 1, 1], value=-np.inf)
    node = helper.make_node("MaxPool", ["p"], ["r"], kernel_shape=[3, 3], strides=[2, 2])
    model = build(node, pad, pi)
    out, n, _ = run(model)
    assert n == 1 and op_counts(out) == {"MaxPool": 1, "Relu": 1}
    assert_equivalent(model, out)


def _refused(model, note):
    out, n, ctx = run(model)
    assert n == 0 and op_counts(out) == op_counts(model)
    if note:
        assert any(note in m for m in ctx.notes), ctx.notes
    assert_equivalent(model, out)


@pytest.mark.parametrize("mode", ["reflect", "edge"])
def test_refuses_non_constant_mode(mode):
    pad, pi = pad_node([0, 0, 1, 1, 0, 0, 1, 1], mode=mode)
    node, wi = conv()
    _refused(build(node, pad, pi, wi), "mode")


def test_refuses_nonzero_value_negative_pads_and_channel_pads():
    node, wi = conv()
    pad, pi = pad_node([0, 0, 1, 1, 0, 0, 1, 1], value=1.0)
    _refused(build(node, pad, pi, wi), "pad value")
    pad, pi = pad_node([0, 0, -1, 0, 0, 0, 1, 1])
    _refused(build(node, pad, pi, wi), "negative")
    pad, pi = pad_node([0, 1, 1, 1, 0, 0, 1, 1])
    node2, _ = conv()
    wi2 = {"W": RNG.standard_normal((4, 4, 3, 3)).astype(np.float32)}
    _refused(build(node2, pad, pi, wi2), "batch/channel")


def test_refuses_zero_value_for_max_pool_and_same_auto_pad():
    pad, pi = pad_node([0, 0, 1, 1, 0, 0, 1, 1])
    _refused(build(helper.make_node("MaxPool", ["p"], ["r"], kernel_shape=[3, 3]), pad, pi), "pad value")
    node, wi = conv(auto_pad="SAME_UPPER")
    _refused(build(node, pad, pi, wi), "auto_pad")


def test_refuses_average_pool_excluding_own_pads_or_ceil_mode():
    pad, pi = pad_node([0, 0, 1, 1, 0, 0, 1, 1])
    node = helper.make_node("AveragePool", ["p"], ["r"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    _refused(build(node, pad, pi), "excludes")
    node = helper.make_node("AveragePool", ["p"], ["r"], kernel_shape=[3, 3], count_include_pad=1, ceil_mode=1,
                            strides=[2, 2])
    _refused(build(node, pad, pi), "ceil_mode")


def test_refuses_max_pool_indices_and_wide_pads():
    pad, pi = pad_node([0, 0, 1, 1, 0, 0, 1, 1], value=-np.inf)
    node = helper.make_node("MaxPool", ["p"], ["r", "idx"], kernel_shape=[3, 3])
    _refused(build(node, pad, pi, extra_out=[("idx", TensorProto.INT64, ["a", "b", "c", "d"])]), "Indices")
    pad, pi = pad_node([0, 0, 3, 0, 0, 0, 0, 0], value=-np.inf)
    node = helper.make_node("MaxPool", ["p"], ["r"], kernel_shape=[3, 3])
    _refused(build(node, pad, pi), "kernel extent")


def test_refuses_shared_pad_output_and_non_constant_pads():
    pad, pi = pad_node([0, 0, 1, 1, 0, 0, 1, 1])
    node, wi = conv()
    _refused(build(node, pad, pi, wi, extra_out=[("p", F, ["a", "b", "c", "d"])]), None)
    node, wi = conv()
    model = make_model([helper.make_node("Pad", ["x", "pads"], ["p"]), node, helper.make_node("Relu", ["r"], ["y"])],
                       [("x", F, X), ("pads", TensorProto.INT64, [8])], [("y", F, ["a", "b", "c", "d"])], wi)
    out, n, _ = run(model)
    assert n == 0


def test_pad_of_the_enclosing_graph_stays_there():
    """A body's Conv reading the main graph's Pad: folding would detach a node of the main graph from a body."""
    w = RNG.standard_normal((4, 3, 3, 3)).astype(np.float32)
    body = helper.make_graph([helper.make_node("Conv", ["p", "W"], ["c"]), helper.make_node("Relu", ["c"], ["r"])],
                             "then", [], [helper.make_tensor_value_info("r", F, None)])
    other = helper.make_graph([helper.make_node("Conv", ["x", "W"], ["r2"], pads=[1, 1, 1, 1])], "else", [],
                              [helper.make_tensor_value_info("r2", F, None)])
    pad, pi = pad_node([0, 0, 1, 1, 0, 0, 1, 1])
    nodes = [pad, helper.make_node("ReduceSum", ["x"], ["t"], keepdims=0), helper.make_node("Greater", ["t", "z"], ["cond"]),
             helper.make_node("If", ["cond"], ["y"], then_branch=body, else_branch=other)]
    model = make_model(nodes, [("x", F, X)], [("y", F, ["a", "b", "c", "d"])],
                       {**pi, "W": w, "z": np.array(0.0, np.float32)})
    out, n, _ = run(model)
    assert n == 0 and op_counts(out)["Pad"] == 1
    assert_equivalent(model, out, feeds={"x": np.abs(RNG.standard_normal(X)).astype(np.float32)})
