"""transpose-to-reshape: a Transpose moving only unit dims becomes a Reshape, then merges; and its refusals."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T, helper

import k3opt
from k3opt.passes.cleanup.merge_reshapes import MergeReshapes
from k3opt.passes.cleanup.transpose_to_reshape import TransposeToReshape, reshape_target
from k3opt.pipeline.shapes import fix_inputs
from k3opt.report import Report
from tests.helpers import assert_equivalent, make_model, op_counts, run_passes
from tests.test_cleanup_ops import apply
from tests.zoo import needs_torch, zoo_decode_inputs, zoo_decode_model, zoo_one_token_decode_model

F = T.FLOAT


def _transpose(x_shape, perm, y_shape, opset: int = 17) -> onnx.ModelProto:
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=perm), helper.make_node("Neg", ["t"], ["y"])]
    return make_model(nodes, [("x", F, x_shape)], [("y", F, y_shape)], opset=opset)


def _feeds(shape, seed: int = 0) -> dict:
    return {"x": np.random.default_rng(seed).standard_normal(shape).astype(np.float32)}


@pytest.mark.parametrize("dims,perm,target", [
    (["b", 1, 4, 8], [0, 2, 1, 3], [0, 4, 1, 8]),   # a decode step's (B, 1, H, D) -> (B, H, 1, D)
    ([2, 4, 1, 8], [0, 2, 1, 3], [2, 1, 4, 8]),      # and back after attention
    ([1, "s", 8], [1, 0, 2], [-1, 1, 8]),            # the moved symbolic dim is the -1: all others known
    ([3, 1, 1, 5], [0, 2, 3, 1], [3, 1, 5, 1]),
])
def test_targets(dims, perm, target) -> None:
    assert reshape_target(dims, perm) == target


@pytest.mark.parametrize("dims,perm,why", [
    ([2, 3, 4], [0, 2, 1], "3 and 4 swap"),
    (["b", "s", 4, 8], [0, 2, 1, 3], "s may not be 1"),
    (["b", None, 1, 8], [0, 2, 1, 3], "unknown dim moves past a unit one: fine, but then needs a -1 next to a 0"),
    ([1, "a", "c", 1], [1, 2, 0, 3], "two moved symbolic dims: two -1"),
    ([2, 1, 3], [0, 1, 2], "identity: remove-noop-ops' job"),
])
def test_refused_targets(dims, perm, why) -> None:
    assert reshape_target(dims, perm) is None, why


@pytest.mark.parametrize("batch", [1, 3])
def test_unit_transpose_becomes_reshape(batch: int) -> None:
    model = _transpose(["b", 1, 4, 8], [0, 2, 1, 3], ["b", 4, 1, 8])
    out, n = apply(model, TransposeToReshape())
    assert n == 1 and op_counts(out) == {"Reshape": 1, "Neg": 1}
    assert_equivalent(model, out, feeds=_feeds((batch, 1, 4, 8)))
    assert apply(out, TransposeToReshape())[1] == 0


def test_graph_output_keeps_its_name() -> None:
    model = make_model([helper.make_node("Transpose", ["x"], ["y"], perm=[1, 0, 2])],
                       [("x", F, [1, 3, 2])], [("y", F, [3, 1, 2])])
    out, n = apply(model, TransposeToReshape())
    assert n == 1 and [o.name for o in out.graph.output] == ["y"] and op_counts(out) == {"Reshape": 1}
    assert_equivalent(model, out, feeds=_feeds((1, 3, 2)))


def test_then_merges_with_the_reshape_before() -> None:
    """q = Reshape(linear, [2, 1, 4, 8]); Transpose(q, [0, 2, 1, 3]): one Reshape left."""
    nodes = [helper.make_node("Reshape", ["x", "s"], ["q"]),
             helper.make_node("Transpose", ["q"], ["t"], perm=[0, 2, 1, 3]),
             helper.make_node("Neg", ["t"], ["y"])]
    model = make_model(nodes, [("x", F, [2, 1, 32])], [("y", F, [2, 4, 1, 8])], {"s": np.array([2, 1, 4, 8])})
    out, _ = apply(model, TransposeToReshape(), MergeReshapes())
    assert op_counts(out) == {"Reshape": 1, "Neg": 1}
    assert_equivalent(model, out, feeds=_feeds((2, 1, 32)))


@pytest.mark.parametrize("shape,perm", [([2, 3, 4], [0, 2, 1]), (["b", "s", 4, 8], [0, 2, 1, 3])])
def test_transpose_of_non_unit_dims_is_kept(shape, perm) -> None:
    model = _transpose(shape, perm, [None] * len(shape))
    out, n = apply(model, TransposeToReshape())
    assert n == 0 and op_counts(out) == {"Transpose": 1, "Neg": 1}


def test_unknown_shape_is_refused() -> None:
    model = _transpose([1, 3, 2], [1, 0, 2], [3, 1, 2])
    model.graph.input[0].type.tensor_type.ClearField("shape")
    model.graph.output[0].type.tensor_type.ClearField("shape")
    assert apply(model, TransposeToReshape())[1] == 0


def test_opset_without_reshape_shape_input_is_skipped() -> None:
    out, pm, _ = run_passes(_transpose([1, 3, 2], [1, 0, 2], [3, 1, 2], opset=4), [TransposeToReshape()])
    assert op_counts(out)["Transpose"] == 1 and pm.stats["transpose-to-reshape"].rewrites == 0


@needs_torch
def test_decode_step_keeps_only_the_key_transposes() -> None:
    """Llama decode with one new token: q/k/v and the attention output Transposes go; k^T stays (one per layer)."""
    model = onnx.load(zoo_decode_model("llama"))
    fix_inputs(model, {"input_ids": [2, 1]})
    report = Report()
    out = k3opt.optimize(model, verify=True, report=report)
    assert report.verification["status"] == "passed"
    assert op_counts(out).get("Transpose", 0) == 2
    feeds = zoo_decode_inputs("llama", past=5, new=1)
    assert_equivalent(model, out, feeds=feeds)


def _into_reshape_model(target_at_moved_axis: bool = False, second_reader: bool = False) -> onnx.ModelProto:
    """o [B, H, 1, D] -> Transpose [0,2,1,3] -> Reshape to [Shape(x)[0], 1, -1] (computed): the decode step's
    attention output, whose batch is dynamic (the moved dim H is known, but beside a copied 0 and a -1)."""
    x_shape = ["b", 4, None, 8]
    nodes = [helper.make_node("Relu", ["x"], ["o"]),
             helper.make_node("Reshape", ["o", "unit"], ["o1"]),  # [b, -1, 1, 8]: H is unknown to inference
             helper.make_node("Transpose", ["o1"], ["t"], perm=[0, 2, 1, 3]),
             helper.make_node("Shape", ["x"], ["sx"]), helper.make_node("Gather", ["sx", "zero"], ["b0"], axis=0),
             helper.make_node("Concat", ["b0", "one" if not target_at_moved_axis else "b0", "minus"], ["target"], axis=0),
             helper.make_node("Reshape", ["t", "target"], ["y"])]
    outputs = [("y", F, ["b", 1, 32])]
    if second_reader:
        nodes.append(helper.make_node("Neg", ["t"], ["z"]))
        outputs.append(("z", F, ["b", 1, None, 8]))
    inits = {"unit": np.array([0, -1, 1, 8], np.int64), "zero": np.array([0], np.int64),
             "one": np.array([1], np.int64), "minus": np.array([-1], np.int64)}
    return make_model(nodes, [("x", F, x_shape)], outputs, inits)


def test_unit_transpose_into_a_reshape_goes() -> None:
    model = _into_reshape_model()
    out, n = apply(model, TransposeToReshape())
    assert n == 1 and "Transpose" not in op_counts(out)
    assert_equivalent(model, out, feeds=_feeds((3, 4, 1, 8)))


@pytest.mark.parametrize("kw", [{"target_at_moved_axis": True}, {"second_reader": True}])
def test_unit_transpose_into_a_reshape_refusals(kw) -> None:
    """A computed target element (maybe 0: a copy) at an axis the Transpose moves; another reader of it."""
    out, n = apply(_into_reshape_model(**kw), TransposeToReshape())
    assert n == 0 and op_counts(out)["Transpose"] == 1


@needs_torch
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_static_one_token_decode_no_more_nodes_than_onnxslim(name) -> None:
    """The decode step exported with a static one-token query (batch dynamic): no Transpose of the length-1
    query or of the attention output is left, and no more non-Constant nodes than onnxslim's."""
    onnxslim = pytest.importorskip("onnxslim")
    model = onnx.load(zoo_decode_model(name))
    dim = model.graph.input[0].type.tensor_type.shape.dim[1]
    dim.Clear()
    dim.dim_value = 1
    report = Report()
    out = k3opt.optimize(model, verify=True, report=report)
    assert report.verification["status"] == "passed"
    assert op_counts(out).get("Transpose", 0) == 2  # k^T, one per layer

    def count(m):
        return sum(1 for n in m.graph.node if n.op_type != "Constant")

    assert count(out) <= count(onnxslim.slim(model))


@needs_torch
@pytest.mark.parametrize("name, most", [("llama", 158), ("qwen2", 160)])
def test_one_token_decode_export_no_more_nodes_than_onnxslim(name, most) -> None:
    """The decode step exported with a static one-token query (TorchScript): no more non-Constant nodes than
    onnxslim's (Llama 158 = 158, Qwen2 160 < 164); the attention output's per-layer Reshape to [B, -1, 1, D] by
    Shape(probs @ v)[0] merges into the next one, so neither it nor its Shape arithmetic is left."""
    onnxslim = pytest.importorskip("onnxslim")
    model = onnx.load(zoo_one_token_decode_model(name))
    report = Report()
    out = k3opt.optimize(model, verify=True, report=report)
    assert report.verification["status"] == "passed"
    count = _non_constant
    assert count(out) <= min(most, count(onnxslim.slim(model))), op_counts(out)
    assert not [n.name for n in out.graph.node if n.op_type == "Shape" and "/layers." in n.name]  # none per layer


def _non_constant(m: onnx.ModelProto) -> int:
    return sum(1 for n in m.graph.node if n.op_type != "Constant")
