"""fold-constants: dims shape inference leaves unknown are traced through their producers (Reshape, Transpose, broadcasts)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T, helper

from tests.helpers import assert_equivalent, assert_optimizes_within, make_model, op_counts
from tests.test_fold_constants import fold
from tests.zoo import needs_torch, zoo_inputs, zoo_model

F, I64 = T.FLOAT, T.INT64


def _heads_model(third: int, last: int = 8, x_shape: tuple = ("N", "S", 16), pick: int = 1) -> onnx.ModelProto:
    """y = dim ``pick`` of Transpose(Reshape(x, [dim0(x), dim1(x), third, last])), as float."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "i0"], ["g0"], axis=0),
        helper.make_node("Gather", ["s", "i1"], ["g1"], axis=0),
        helper.make_node("Unsqueeze", ["g0", "ax"], ["u0"]),
        helper.make_node("Unsqueeze", ["g1", "ax"], ["u1"]),
        helper.make_node("Concat", ["u0", "u1", "third", "last"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["r"]),
        helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1, 3]),
        helper.make_node("Shape", ["t"], ["ts"]),
        helper.make_node("Gather", ["ts", "pick"], ["d"], axis=0),
        helper.make_node("Cast", ["d"], ["y"], to=F),
    ]
    inits = dict(i0=np.int64(0), i1=np.int64(1), ax=np.int64([0]), third=np.int64([third]), last=np.int64([last]),
                 pick=np.int64(pick))
    return make_model(nodes, [("x", F, list(x_shape))], [("y", F, [])], inits, opset=14)


def _feeds(shape: tuple) -> dict:
    return {"x": np.random.rand(*shape).astype(np.float32)}


@pytest.mark.parametrize("third", [-1, 2], ids=["minus-one", "literal"])
def test_reshape_target_dim_traced_through_transpose(third):
    model = _heads_model(third)
    out, _ = fold(model)
    assert set(op_counts(out)) <= {"Constant"}
    for shape in ((2, 3, 16), (1, 5, 16)):
        assert_equivalent(model, out, feeds=_feeds(shape))


def test_minus_one_refused_when_symbols_do_not_cancel():
    """Reshape(x[N, S, 16], [N, 4, -1, 8]): the -1 is S / 2, not a number."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "i0"], ["g0"], axis=0),
        helper.make_node("Unsqueeze", ["g0", "ax"], ["u0"]),
        helper.make_node("Concat", ["u0", "four", "m1", "eight"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["r"]),
        helper.make_node("Shape", ["r"], ["rs"]),
        helper.make_node("Gather", ["rs", "i2"], ["d"], axis=0),
        helper.make_node("Cast", ["d"], ["y"], to=F),
    ]
    inits = dict(i0=np.int64(0), i2=np.int64(2), ax=np.int64([0]), four=np.int64([4]), m1=np.int64([-1]),
                 eight=np.int64([8]))
    model = make_model(nodes, [("x", F, ["N", "S", 16])], [("y", F, [])], inits, opset=14)
    out, _ = fold(model)
    assert "Reshape" in op_counts(out) and "Shape" in op_counts(out)
    for shape in ((2, 4, 16), (1, 8, 16)):
        assert_equivalent(model, out, feeds=_feeds(shape))


@pytest.mark.parametrize("a_shape,b_shape,folds", [
    (["N", 4], ["N", 1], True), (["N", 4], [1, "M"], True), (["N", "K"], [1, "M"], False), (["N", "K"], ["N", 1], False),
], ids=["one-broadcasts", "number-wins-over-symbol", "different-symbols", "symbol-not-folded"])
def test_broadcast_dim(a_shape, b_shape, folds):
    """Dim 1 of Add(a, b): a number other than 1 is the result (the other side is 1 or equal), symbols never fold."""
    nodes = [
        helper.make_node("Add", ["a", "b"], ["c"]),
        helper.make_node("Shape", ["c"], ["s"]),
        helper.make_node("Gather", ["s", "i1"], ["d"], axis=0),
        helper.make_node("Cast", ["d"], ["y"], to=F),
    ]
    model = make_model(nodes, [("a", F, a_shape), ("b", F, b_shape)], [("y", F, [])], {"i1": np.int64(1)})
    out, _ = fold(model)
    assert ("Add" not in op_counts(out)) == folds
    size = {"N": 3, "K": 4, "M": 4}
    feeds = {k: np.zeros([size.get(d, d) for d in shape], np.float32) for k, shape in (("a", a_shape), ("b", b_shape))}
    assert_equivalent(model, out, feeds=feeds)


@pytest.mark.parametrize("b_dim,folds", [("N", True), ("M", False)], ids=["same-symbol", "different-symbols"])
def test_equal_of_shapes_with_symbols(b_dim, folds):
    nodes = [
        helper.make_node("Shape", ["a"], ["sa"]),
        helper.make_node("Shape", ["b"], ["sb"]),
        helper.make_node("Equal", ["sa", "sb"], ["eq"]),
        helper.make_node("Cast", ["eq"], ["y"], to=F),
    ]
    model = make_model(nodes, [("a", F, ["N", 4]), ("b", F, [b_dim, 4])], [("y", F, [2])])
    out, _ = fold(model)
    assert ("Equal" not in op_counts(out)) == folds
    assert_equivalent(model, out)


@needs_torch
def test_llama_torchscript_head_counts_fold():
    """The Llama TorchScript export's head dims (Reshape to [b, s, -1, 8]) fold in every layer: 255 -> 239 nodes."""
    assert_optimizes_within(zoo_model("llama", "torchscript"), zoo_inputs("llama"), max_nodes=239)
