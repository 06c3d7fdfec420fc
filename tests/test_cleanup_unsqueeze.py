"""merge-unsqueezes: Unsqueeze(Unsqueeze(x, a1), a2) becomes one Unsqueeze; every axes layout checked with onnxruntime."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T, helper

from k3opt.passes.cleanup.merge_unsqueezes import MergeUnsqueezes, merged_axes
from tests.helpers import assert_equivalent, assert_optimizes_within, op_counts
from tests.test_cleanup_chains import _chain
from tests.test_cleanup_ops import apply
from tests.zoo import needs_torch, zoo_inputs, zoo_model

F = T.FLOAT


def _unsqueezes(a1: list[int], a2: list[int], x_shape: list, opset: int = 17, extra_out: bool = False) -> onnx.ModelProto:
    r = len(x_shape) + len(a1) + len(a2)
    if opset >= 13:
        first = helper.make_node("Unsqueeze", ["x", "a1"], ["m"])
        second = helper.make_node("Unsqueeze", ["m", "a2"], ["o"])
        inits = {"a1": np.int64(a1), "a2": np.int64(a2)}
    else:
        first = helper.make_node("Unsqueeze", ["x"], ["m"], axes=a1)
        second = helper.make_node("Unsqueeze", ["m"], ["o"], axes=a2)
        inits = {}
    mid = ("m", F, [None] * (len(x_shape) + len(a1))) if extra_out else None
    return _chain(first, second, ("x", F, x_shape), ("y", F, [None] * r), inits, mid, opset)


@pytest.mark.parametrize("a1,a2", [
    ([0], [0]), ([0], [1]), ([1], [0]), ([2], [0, 4]), ([-1], [-1]), ([0, 3], [-2]), ([1], [3, 0]), ([-3], [1, -1]),
])
@pytest.mark.parametrize("opset", [11, 17])
def test_unsqueezes_merge_exactly(a1, a2, opset):
    model = _unsqueezes(a1, a2, [2, 3], opset)
    out, n = apply(model, MergeUnsqueezes())
    assert n == 1 and op_counts(out)["Unsqueeze"] == 1
    assert_equivalent(model, out)


def test_merged_axes_refuses_out_of_range_or_repeated_axes():
    assert merged_axes(2, [0], [0]) == [0, 1]
    assert merged_axes(2, [5], [0]) is None
    assert merged_axes(2, [0], [1, 1]) is None


def test_refused_when_rank_unknown():
    model = _unsqueezes([-1], [0], [2, 3])
    model.graph.input[0].type.tensor_type.ClearField("shape")
    out, n = apply(model, MergeUnsqueezes())
    assert n == 0 and op_counts(out)["Unsqueeze"] == 2


def test_refused_when_middle_is_read_elsewhere():
    model = _unsqueezes([0], [0], [2, 3], extra_out=True)
    out, n = apply(model, MergeUnsqueezes())
    assert n == 0 and op_counts(out)["Unsqueeze"] == 2
    assert_equivalent(model, out)


@needs_torch
def test_llama_torchscript_unsqueeze_chains_merge():
    """The Llama TorchScript export's rotary/mask Unsqueeze pairs merge: 239 -> 234 nodes."""
    assert_optimizes_within(zoo_model("llama", "torchscript"), zoo_inputs("llama"), max_nodes=234)
