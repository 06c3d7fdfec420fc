"""merge-cast-chains, merge-transposes, merge-reshapes, sequence-to-split: merges and refusals, with numerics."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T, helper

from k3opt.passes.cleanup.merge_cast_chains import MergeCastChains, lossless
from k3opt.passes.cleanup.remove_noop_ops import RemoveNoopOps
from k3opt.passes.cleanup.merge_reshapes import MergeReshapes
from k3opt.passes.cleanup.sequence_to_split import SequenceToSplit
from k3opt.passes.cleanup.merge_transposes import MergeTransposes
from tests.helpers import assert_equivalent, make_model, op_counts
from tests.test_cleanup_ops import apply

F = T.FLOAT


def _chain(first: onnx.NodeProto, second: onnx.NodeProto, x, y, inits=None, extra_out=None, opset=17):
    """x -> first -> "m" -> second -> "o" -> Neg -> y (plus "m" as an output when ``extra_out``)."""
    nodes = [first, second, helper.make_node("Neg", ["o"], ["y"])]
    outs = [y] + ([extra_out] if extra_out else [])
    return make_model(nodes, [x], outs, inits or {}, opset=opset)


# -- Cast chains ----------------------------------------------------------------

@pytest.mark.parametrize("src,mid,dst,merges", [
    (F, T.DOUBLE, F, True),
    (T.FLOAT16, F, T.DOUBLE, True),
    (T.INT32, T.INT64, F, True),
    (T.INT8, T.FLOAT16, T.INT32, True),
    (T.UINT8, T.INT16, F, True),
    (T.BOOL, T.INT32, F, True),
    (F, T.FLOAT16, F, False),
    (T.DOUBLE, F, T.DOUBLE, False),
    (T.INT64, F, T.INT64, False),
    (T.INT32, F, T.INT64, False),
    (F, T.INT32, F, False),
    (T.INT16, T.FLOAT16, F, False),
])
def test_cast_chain(src, mid, dst, merges):
    model = _chain(helper.make_node("Cast", ["x"], ["m"], to=mid), helper.make_node("Cast", ["m"], ["o"], to=dst),
                   ("x", src, [8]), ("y", dst, [8]))
    out, n = apply(model, MergeCastChains())
    assert op_counts(out).get("Cast") == (1 if merges else 2)
    np_src = np.dtype(helper.tensor_dtype_to_np_dtype(src))
    if np_src.kind in "iub":
        info = np.iinfo(np_src) if np_src.kind != "b" else np.iinfo(np.uint8)
        x = np.random.default_rng(0).integers(info.min, info.max, 8, endpoint=True).astype(np_src)
    else:
        x = np.array([1e-8, 0.1, 1 / 3, 70000.7, -3.5, 255, 2.0**25 + 1, 1], dtype=np.float64).astype(np_src)
    assert_equivalent(model, out, feeds={"x": x})


def test_lossless_table_spot_checks():
    assert lossless(F, T.DOUBLE) and not lossless(T.DOUBLE, F)
    assert not lossless(F, T.BFLOAT16) and not lossless(T.FLOAT16, T.BFLOAT16)
    assert lossless(T.UINT32, T.INT64) and not lossless(T.INT32, T.UINT32) and not lossless(T.UINT64, T.INT64)


def test_cast_chain_with_shared_middle_is_refused():
    model = _chain(helper.make_node("Cast", ["x"], ["m"], to=T.DOUBLE), helper.make_node("Cast", ["m"], ["o"], to=F),
                   ("x", F, [3]), ("y", F, [3]), extra_out=("m", T.DOUBLE, [3]))
    out, n = apply(model, MergeCastChains())
    assert n == 0 and out.graph.node == model.graph.node


def test_cast_round_trip_disappears_with_noop_removal():
    model = _chain(helper.make_node("Cast", ["x"], ["m"], to=T.DOUBLE), helper.make_node("Cast", ["m"], ["o"], to=F),
                   ("x", F, [3]), ("y", F, [3]))
    out, _ = apply(model, MergeCastChains(), RemoveNoopOps())
    assert op_counts(out) == {"Neg": 1}
    assert_equivalent(model, out)


# -- Transposes -----------------------------------------------------------------

@pytest.mark.parametrize("p1,p2,left", [([0, 2, 1], [1, 0, 2], 1), ([2, 0, 1], [1, 2, 0], 0), (None, None, 0),
                                         ([1, 2, 0], [1, 2, 0], 1)])
def test_transposes_compose(p1, p2, left):
    a1 = {"perm": p1} if p1 else {}
    a2 = {"perm": p2} if p2 else {}
    model = _no_shape(_chain(helper.make_node("Transpose", ["x"], ["m"], **a1),
                             helper.make_node("Transpose", ["m"], ["o"], **a2), ("x", F, [2, 3, 4]), ("y", F, [1])))
    out, _ = apply(model, MergeTransposes())
    assert op_counts(out).get("Transpose", 0) == left
    assert_equivalent(model, out)


def _no_shape(model: onnx.ModelProto) -> onnx.ModelProto:
    for o in model.graph.output:
        o.type.tensor_type.ClearField("shape")
    return model


def test_transpose_chain_with_shared_middle_is_refused():
    model = _chain(helper.make_node("Transpose", ["x"], ["m"], perm=[1, 0]),
                   helper.make_node("Transpose", ["m"], ["o"], perm=[1, 0]), ("x", F, [2, 3]), ("y", F, [2, 3]),
                   extra_out=("m", F, [3, 2]))
    out, n = apply(model, MergeTransposes())
    assert n == 0 and out.graph.node == model.graph.node


def test_transposes_cancelling_between_input_and_output_are_kept():
    nodes = [helper.make_node("Transpose", ["x"], ["m"], perm=[1, 0]),
             helper.make_node("Transpose", ["m"], ["y"], perm=[1, 0])]
    model = make_model(nodes, [("x", F, [2, 3])], [("y", F, [2, 3])])
    out, n = apply(model, MergeTransposes())
    assert n == 0 and out.graph.node == model.graph.node


# -- Reshapes -------------------------------------------------------------------

@pytest.mark.parametrize("s2,allowzero,merges", [([6, 4], 0, True), ([-1, 4], 0, True), ([0, 12], 0, True),
                                                  ([24, 1], 1, True), ([4, -1], 0, True)])
def test_reshape_chain(s2, allowzero, merges):
    model = _chain(helper.make_node("Reshape", ["x", "s1"], ["m"]),
                   helper.make_node("Reshape", ["m", "s2"], ["o"], allowzero=allowzero),
                   ("x", F, [2, 3, 4]), ("y", F, [1]), {"s1": np.array([2, 12]), "s2": np.array(s2)})
    _no_shape(model)
    out, n = apply(model, MergeReshapes())
    assert op_counts(out)["Reshape"] == (1 if merges else 2)
    assert_equivalent(model, out)


def test_reshape_with_zero_copying_first_result_is_refused():
    """s1 computed at run time: the 0 in s2 copies a dim of the first result nobody knows."""
    nodes = [helper.make_node("Reshape", ["x", "s1"], ["m"]), helper.make_node("Reshape", ["m", "s2"], ["o"]),
             helper.make_node("Neg", ["o"], ["y"])]
    model = make_model(nodes, [("x", F, [2, 3, 4]), ("s1", T.INT64, [2])], [("y", F, [None, 2, None])],
                       {"s2": np.array([0, 2, -1])})
    out, n = apply(model, MergeReshapes())
    assert n == 0 and out.graph.node == model.graph.node


@pytest.mark.parametrize("s1,x_shape,merged", [([0, 3, 2, 2], ["b", 3, 4], [0, 12]), ([-1, 3, 4], [2, 3, 4], [2, 12])],
                         ids=["s1-copies", "known-size"])
def test_reshape_zero_resolved_through_the_first(s1, x_shape, merged):
    """A 0 in s2 copies the middle's dim: kept when that is x's own dim at the index, else its known size."""
    model = _chain(helper.make_node("Reshape", ["x", "s1"], ["m"]), helper.make_node("Reshape", ["m", "s2"], ["o"]),
                   ("x", F, x_shape), ("y", F, ["b", 12]), {"s1": np.array(s1), "s2": np.array([0, 12])})
    out, n = apply(model, MergeReshapes())
    assert n == 1 and op_counts(out)["Reshape"] == 1
    target = next(list(onnx.numpy_helper.to_array(t)) for t in out.graph.initializer if t.name != "s1")
    assert target == merged
    for b in ((1, 5) if x_shape[0] == "b" else (2,)):
        assert_equivalent(model, out, feeds={"x": np.random.default_rng(b).standard_normal((b, 3, 4), np.float32)})


def test_reshape_zero_of_a_symbol_x_lacks_becomes_the_minus_one():
    """x (5, 1, b, 4) -> (5, b, 1, 4) -> [5, 0, 4]: the 0 copies b, which x has at another index; with every other
    element a number it is the rest of the element count: [5, -1, 4] (a GRU's output made batch-major)."""
    model = _chain(helper.make_node("Reshape", ["x", "s1"], ["m"]), helper.make_node("Reshape", ["m", "s2"], ["o"]),
                   ("x", F, [5, 1, "b", 4]), ("y", F, [5, "b", 4]),
                   {"s1": np.array([5, -1, 1, 4]), "s2": np.array([5, 0, 4])})
    out, n = apply(model, MergeReshapes())
    assert n == 1 and op_counts(out)["Reshape"] == 1
    target = next(list(onnx.numpy_helper.to_array(t)) for t in out.graph.initializer if t.name != "s1")
    assert target == [5, -1, 4]
    for b in (1, 3):
        assert_equivalent(model, out, feeds={"x": np.random.default_rng(b).standard_normal((5, 1, b, 4), np.float32)})


# -- SplitToSequence + SequenceAt -------------------------------------------------

def _seq_model(split, keepdims: int, positions: list[int], x_shape, seq_output: bool = False):
    inputs = ["x"] + (["split"] if split is not None else [])
    nodes = [helper.make_node("SplitToSequence", inputs, ["seq"], axis=1, keepdims=keepdims)]
    outs = []
    inits = {"split": np.array(split)} if split is not None else {}
    for i, p in enumerate(positions):
        inits[f"p{i}"] = np.array(p)
        nodes.append(helper.make_node("SequenceAt", ["seq", f"p{i}"], [f"a{i}"]))
        nodes.append(helper.make_node("Neg", [f"a{i}"], [f"y{i}"]))
        outs.append((f"y{i}", F, None))
    model = make_model(nodes, [("x", F, x_shape)], [(n, t, [1]) for n, t, _ in outs], inits)
    if seq_output:
        model.graph.output.append(helper.make_tensor_sequence_value_info("seq", F, None))
    return _no_shape(model)


@pytest.mark.parametrize("split,keepdims,positions", [
    ([2, 3, 1], 1, [0, 2, -2]),
    (2, 1, [0, 1, 2]),
    (4, 1, [1, -1]),
    (None, 1, [3, 0]),
    (None, 0, [5, 1, 1]),
])
def test_sequence_becomes_split(split, keepdims, positions):
    model = _seq_model(split, keepdims, positions, [2, 6])
    out, n = apply(model, SequenceToSplit())
    assert n == 1 and "SplitToSequence" not in op_counts(out) and "SequenceAt" not in op_counts(out)
    assert_equivalent(model, out)


@pytest.mark.parametrize("split,x_shape,seq_output", [(None, [2, "N"], False), (2, [2, "N"], False),
                                                      ([2, 4], [2, 6], True)])
def test_sequence_split_refusals(split, x_shape, seq_output):
    model = _seq_model(split, 1, [0], x_shape, seq_output)
    out, n = apply(model, SequenceToSplit())
    assert n == 0 and "SplitToSequence" in op_counts(out)


def test_sequence_with_other_reader_is_refused():
    model = _seq_model([3, 3], 1, [0], [2, 6])
    model.graph.node.append(helper.make_node("SequenceLength", ["seq"], ["len"]))
    model.graph.output.append(helper.make_tensor_value_info("len", T.INT64, []))
    out, n = apply(model, SequenceToSplit())
    assert n == 0 and "SplitToSequence" in op_counts(out)


def _reshape_chain(first_target: str) -> onnx.ModelProto:
    """x [b, 2, 2, 8] -> Reshape(x, s1) -> Reshape(., [Shape(h)[0], 1, -1]) (a computed second target, whose
    first element is a dim of another tensor: 0 copies, for an empty batch)."""
    nodes = [helper.make_node("Shape", ["h"], ["sh"]), helper.make_node("Gather", ["sh", "zero"], ["b"], axis=0),
             helper.make_node("Unsqueeze", ["b", "axes0"], ["b1"]),
             helper.make_node("Concat", ["b1", "one", "minus"], ["s2"], axis=0)]
    if first_target == "copy-x":  # [Shape(x)[0], -1, 1, 8]: keeps x's dim 0
        nodes += [helper.make_node("Shape", ["x"], ["sx"]), helper.make_node("Gather", ["sx", "zero"], ["bx"], axis=0),
                  helper.make_node("Unsqueeze", ["bx", "axes0"], ["bx1"]),
                  helper.make_node("Concat", ["bx1", "minus", "one", "eight"], ["s1"], axis=0)]
    else:  # [-1, 8]: dim 0 becomes b*4, not x's
        nodes.append(helper.make_node("Identity", ["flat"], ["s1"]))
    nodes += [helper.make_node("Reshape", ["x", "s1"], ["mid"]), helper.make_node("Reshape", ["mid", "s2"], ["y"])]
    inits = {"zero": np.array(0, np.int64), "axes0": np.array([0], np.int64), "one": np.array([1], np.int64),
             "minus": np.array([-1], np.int64), "eight": np.array([8], np.int64), "flat": np.array([-1, 8], np.int64)}
    return make_model(nodes, [("x", T.FLOAT, [None, 2, 2, 8]), ("h", T.FLOAT, ["b", 1, 32])],
                      [("y", T.FLOAT, ["b", 1, 32])], inits)


def test_reshapes_merge_under_a_computed_target_that_copies_x_s_dim():
    model = _reshape_chain("copy-x")
    out, n = apply(model, MergeReshapes())
    assert n == 1 and op_counts(out)["Reshape"] == 1
    rng = np.random.default_rng(0)
    assert_equivalent(model, out, feeds={"x": rng.standard_normal((3, 2, 2, 8)).astype(np.float32),
                                         "h": rng.standard_normal((3, 1, 32)).astype(np.float32)})


def test_reshapes_under_a_computed_target_whose_copy_would_differ_stay():
    out, n = apply(_reshape_chain("flat"), MergeReshapes())
    assert n == 0 and op_counts(out)["Reshape"] == 2
