"""The peers' classic rewrites (issue #34 item 3/4), each on a hand-made graph with its refusals:
fold-scalar-scale, swap-where-not, remove-broadcast-expands, zero Pad into a MaxPool of a Relu, no-op Slice,
unbounded Clip, CSE of empty optional inputs, rank-2 MatMul+Add of computed operands, and the opset kept
where raising it would cost nodes."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import k3opt
from k3opt.report import Report
from tests.helpers import assert_equivalent, make_model, op_counts, run_ort

F, I64, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
RNG = np.random.default_rng(34)


def _w(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _optimized(model, **kw):
    out = k3opt.optimize(model, **kw)
    assert_equivalent(model, out)
    return out


# fold-scalar-scale
@pytest.mark.parametrize("op,scale", [("Mul", 0.125), ("Div", 8.0)])
def test_scale_goes_into_matmul_add(op, scale):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["a"]),
             helper.make_node(op, ["a", "s"], ["y"])]
    model = make_model(nodes, [("x", F, ["B", 3, 8])], [("y", F, ["B", 3, 4])],
                       {"w": _w(8, 4), "b": _w(4), "s": np.array(scale, np.float32)})
    assert op_counts(_optimized(model)) == {"MatMul": 1, "Add": 1}


def test_scale_goes_into_gemm_alpha_and_beta():
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["g"], alpha=2.0), helper.make_node("Mul", ["s", "g"], ["y"])]
    model = make_model(nodes, [("x", F, [3, 8]), ("w", F, [8, 4]), ("b", F, [4])], [("y", F, [3, 4])],
                       {"s": np.array([0.5], np.float32)})
    out = _optimized(model)
    assert op_counts(out) == {"Gemm": 1}
    attrs = {a.name: a.f for a in out.graph.node[0].attribute}
    assert attrs["alpha"] == 1.0 and attrs["beta"] == 0.5


@pytest.mark.parametrize("case", ["shared-weight", "vector-scale", "zero-divisor", "wider-scale", "read-twice"])
def test_scale_refusals(case):
    s = {"vector-scale": _w(4), "zero-divisor": np.array(0.0, np.float32),
         "wider-scale": np.array([[[[0.5]]]], np.float32)}.get(case, np.array(0.5, np.float32))
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]),
             helper.make_node("Div" if case == "zero-divisor" else "Mul", ["m", "s"], ["y"])]
    outputs = [("y", F, [1, 1, 3, 4] if case == "wider-scale" else [3, 4])]
    if case == "shared-weight":
        nodes.append(helper.make_node("MatMul", ["x2", "w"], ["y2"]))
        outputs.append(("y2", F, [3, 4]))
    if case == "read-twice":
        nodes.append(helper.make_node("Relu", ["m"], ["y2"]))
        outputs.append(("y2", F, [3, 4]))
    model = make_model(nodes, [("x", F, [3, 8]), ("x2", F, [3, 8])], outputs, {"w": _w(8, 4), "s": s})
    out = k3opt.optimize(model, passes=["fold-scalar-scale"])
    assert op_counts(out).get("Mul", 0) + op_counts(out).get("Div", 0) == 1


# swap-where-not
def test_where_not_swaps_branches():
    nodes = [helper.make_node("Not", ["c"], ["n"]), helper.make_node("Where", ["n", "a", "b"], ["y"])]
    model = make_model(nodes, [("c", BOOL, [2, 3]), ("a", F, [2, 3]), ("b", F, [1, 3])], [("y", F, [2, 3])])
    assert op_counts(_optimized(model)) == {"Where": 1}


# remove-broadcast-expands
def test_expand_wider_than_the_others_stays():
    nodes = [helper.make_node("Expand", ["b", "s"], ["e"]), helper.make_node("Add", ["x", "e"], ["y"])]
    model = make_model(nodes, [("x", F, ["N", 7, 1]), ("b", F, [1])], [("y", F, ["N", 7, 16])],
                       {"s": np.array([1, 7, 16], np.int64)})
    assert op_counts(_optimized(model)) == {"Expand": 1, "Add": 1}


def test_expand_to_the_others_shape_goes_for_broadcast_readers_only():
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Expand", ["b", "s"], ["e"]),
             helper.make_node("Mul", ["x", "e"], ["y"]), helper.make_node("Relu", ["e"], ["z"])]
    model = make_model(nodes, [("x", F, ["N", 7, 16])], [("y", F, ["N", 7, 16]), ("z", F, ["N", 7, 16])],
                       {"b": _w(1, 16)})
    out = _optimized(model)
    mul = next(n for n in out.graph.node if n.op_type == "Mul")
    assert "b" in mul.input and op_counts(out)["Expand"] == 1


# fold-pad: zero padding into a MaxPool of a non-negative tensor
@pytest.mark.parametrize("producer,folds", [("Relu", True), ("Sigmoid", True), ("Neg", False)])
def test_zero_pad_into_maxpool_only_over_non_negative(producer, folds):
    nodes = [helper.make_node(producer, ["x"], ["r"]), helper.make_node("Pad", ["r", "p"], ["rp"]),
             helper.make_node("MaxPool", ["rp"], ["y"], kernel_shape=[2, 2], strides=[2, 2])]
    model = make_model(nodes, [("x", F, [1, 2, 5, 5])], [("y", F, [1, 2, 3, 3])],
                       {"p": np.array([0, 0, 1, 1, 0, 0, 0, 0], np.int64)})
    out = _optimized(model)
    assert ("Pad" not in op_counts(out)) == folds


# remove-noop-ops: Slice and Clip
@pytest.mark.parametrize("dim,removed", [(1, True), (2, False)])
def test_reversing_slice_is_a_noop_only_over_a_dim_of_one(dim, removed):
    nodes = [helper.make_node("Slice", ["x", "st", "en", "ax", "step"], ["s"]), helper.make_node("Relu", ["s"], ["y"])]
    model = make_model(nodes, [("x", F, ["N", dim, 4])], [("y", F, ["N", dim, 4])],
                       {"st": np.array([-1], np.int64), "en": np.array([-(2 ** 63)], np.int64),
                        "ax": np.array([1], np.int64), "step": np.array([-1], np.int64)})
    assert ("Slice" not in op_counts(_optimized(model))) == removed


def test_bounded_clip_stays_and_empty_optional_inputs_merge():
    nodes = [helper.make_node("Clip", ["x", "", "hi"], ["a"]), helper.make_node("Clip", ["x", "", "hi", ], ["b"]),
             helper.make_node("Clip", ["x", "lo"], ["c"]), helper.make_node("Clip", ["x", "lo", ""], ["d"]),
             helper.make_node("Sum", ["a", "b", "c", "d"], ["y"])]
    model = make_model(nodes, [("x", F, [2, 3])], [("y", F, [2, 3])],
                       {"lo": np.array(-0.2, np.float32), "hi": np.array(0.3, np.float32)})
    assert op_counts(_optimized(model)) == {"Clip": 2, "Sum": 1}


# fuse-matmul-add with computed operands
@pytest.mark.parametrize("bias_shape,fused", [([4], True), (["M", 1], True), (["M", 4], True), ([3, 4], False)])
def test_rank2_matmul_add_of_computed_operands(bias_shape, fused):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])]
    out_m = 3 if bias_shape == [3, 4] else "M"
    model = make_model(nodes, [("x", F, [out_m, 8]), ("w", F, [8, 4]), ("b", F, bias_shape)],
                       [("y", F, [out_m, 4])])
    out = k3opt.optimize(model)
    assert ("Gemm" in op_counts(out)) == (fused or bias_shape == [3, 4])  # [3, 4] with M = 3 is exact too
    assert_equivalent(model, out, feeds={"x": _w(3, 8), "w": _w(8, 4),
                                         "b": _w(*[3 if d == "M" else d for d in bias_shape])})


def test_computed_matmul_add_stays_for_cann():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])]
    model = make_model(nodes, [("x", F, [3, 8]), ("w", F, [8, 4]), ("b", F, [4])], [("y", F, [3, 4])])
    assert "Gemm" not in op_counts(k3opt.optimize(model, target="cann", verify=False))


# opset kept where raising costs nodes
def _softmax(axis: int, opset: int = 12, layernorm: bool = False):
    nodes = [helper.make_node("Softmax", ["x"], ["s"], axis=axis), helper.make_node("Relu", ["s"], ["y"])]
    if layernorm:
        nodes += [helper.make_node("ReduceMean", ["y"], ["m"], axes=[-1]), helper.make_node("Sub", ["y", "m"], ["z"])]
    outputs = [("y", F, ["N", 4, 8])] + ([("z", F, ["N", 4, 8])] if layernorm else [])
    return make_model(nodes, [("x", F, ["N", 4, 8])], outputs, opset=opset)


@pytest.mark.parametrize("axis,layernorm,kept", [(1, False, True), (-1, False, False), (2, False, False),
                                                  (1, True, False)])
def test_opset_kept_only_when_raising_costs_nodes_and_no_pass_needs_it(axis, layernorm, kept):
    report = Report()
    model = _softmax(axis, layernorm=layernorm)
    out = k3opt.optimize(model, report=report)
    assert_equivalent(model, out)
    opset = next(o.version for o in out.opset_import if o.domain in ("", "ai.onnx"))
    assert (opset == 12) == kept
    assert any(n.startswith("opset kept at 12: converting to 17 would add 2 node") for n in report.notes) == kept
    if kept:
        assert op_counts(out) == {"Softmax": 1, "Relu": 1}


def test_ir3_opset9_batchnorm_of_constant_nodes_converts():
    """An IR-3 opset-9 CNN export: BatchNormalization reads Constant nodes and an initializer that is also a
    graph input. onnx's converter called the sub-model's constants undefined; now it converts to 17."""
    def const(name):
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(_w(3) ** 2 + 0.5, name + "_v"))
    nodes = [const(n) for n in "sbm"] + [helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["N", 3, 4, 4]),
                                           helper.make_tensor_value_info("v", F, [3])],
                              [helper.make_tensor_value_info("y", F, ["N", 3, 4, 4])],
                              [numpy_helper.from_array(_w(3) ** 2 + 0.5, "v")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)])
    model.ir_version = 3
    report = Report()
    out = k3opt.optimize(model, report=report)
    assert "opset converted from 9 to 17" in report.notes
    feeds = {"x": _w(2, 3, 4, 4)}
    np.testing.assert_allclose(run_ort(out, feeds)[0], run_ort(model, feeds)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("src,removed", [("x", True), ("z", False)])
def test_expand_to_its_own_symbolic_shape_and_unit_tile_go(src, removed):
    nodes = [helper.make_node("Shape", [src], ["s"]), helper.make_node("Expand", ["x", "s"], ["e"]),
             helper.make_node("Tile", ["e", "r"], ["t"]), helper.make_node("Relu", ["t"], ["y"])]
    model = make_model(nodes, [("x", F, ["N", 1, 4]), ("z", F, ["N", 3, 4])], [("y", F, ["N", None, 4])],
                       {"r": np.array([1, 1, 1], np.int64)})
    out = k3opt.optimize(model)
    assert_equivalent(model, out)
    assert "Tile" not in op_counts(out) and ("Expand" not in op_counts(out)) == removed


def test_scale_goes_into_a_gemms_own_constants_and_not_alpha_for_cann():
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["g"]), helper.make_node("Mul", ["g", "s"], ["y"])]
    model = make_model(nodes, [("x", F, [3, 8])], [("y", F, [3, 4])],
                       {"w": _w(8, 4), "b": _w(4), "s": np.array(0.25, np.float32)})
    out = _optimized(model)
    assert op_counts(out) == {"Gemm": 1} and not out.graph.node[0].attribute
    computed = make_model(nodes, [("x", F, [3, 8]), ("w", F, [8, 4])], [("y", F, [3, 4])],
                          {"b": _w(4), "s": np.array(0.25, np.float32)})
    assert op_counts(k3opt.optimize(computed, passes=["fold-scalar-scale"], target="cann"))["Mul"] == 1


@pytest.mark.parametrize("dims,unwrapped", [([4, 1, 8], True), ([4, 2, 8], False), ([4, "d", 8], False),
                                            ([4, 1, 1], True)])
def test_flattened_softmax_unwraps_when_one_trailing_dim_is_not_1(dims, unwrapped):
    nodes = [helper.make_node("Flatten", ["x"], ["f"], axis=2), helper.make_node("Softmax", ["f"], ["p"], axis=-1),
             helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Reshape", ["p", "s"], ["y"])]
    model = make_model(nodes, [("x", F, ["N"] + dims)], [("y", F, ["N"] + dims)])
    out = k3opt.optimize(model)
    assert_equivalent(model, out, feeds={"x": _w(2, *[3 if d == "d" else d for d in dims])})
    assert (op_counts(out) == {"Softmax": 1}) == unwrapped


def _dense(back, split: bool = False, out_2d: bool = False):
    """Keras/tf2onnx Dense on x [B, 7, 16]: Reshape [-1, 16], MatMul, (Split,) Reshape ``back``, Add."""
    nodes = [helper.make_node("Reshape", ["x", "flat"], ["x2"]), helper.make_node("MatMul", ["x2", "w"], ["m"])]
    inits = {"flat": np.array([-1, 16], np.int64), "w": _w(16, 8), "back": np.array(back, np.int64), "b": _w(4)}
    outputs = [("y", F, None)]
    if split:
        nodes += [helper.make_node("Split", ["m"], ["m1", "m2"], axis=1),
                  helper.make_node("Reshape", ["m1", "back"], ["r1"]), helper.make_node("Reshape", ["m2", "back"], ["r2"]),
                  helper.make_node("Add", ["r1", "b"], ["a1"]), helper.make_node("Add", ["r2", "b"], ["y"]),
                  helper.make_node("Relu", ["a1"], ["z"])]
        outputs.append(("z", F, None))
    else:
        inits["b"] = _w(back[-1])
        nodes += [helper.make_node("Reshape", ["m", "back"], ["r"]), helper.make_node("Add", ["r", "b"], ["y"])]
    if out_2d:
        outputs.append(("m", F, None))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["B", 7, 16])],
                              [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("back,split,out_2d,target,unflattened", [
    ([-1, 7, 8], False, False, "onnx", True), ([-1, 7, 2, 4], False, False, "onnx", True),
    ([-1, 7, 4], True, False, "onnx", True), ([0, 8], False, False, "onnx", False),
    ([-1, 7, 8], False, True, "onnx", False), ([-1, 7, 8], False, False, "cann", False)])
def test_unflatten_matmul(back, split, out_2d, target, unflattened):
    model = _dense(back, split, out_2d)
    out = k3opt.optimize(model, target=target, verify=target == "onnx")
    if target == "onnx":
        assert_equivalent(model, out, feeds={"x": _w(3, 7, 16)})
    mm = next(n for n in out.graph.node if n.op_type in ("MatMul", "Gemm"))
    assert (mm.input[0] == "x") == unflattened
