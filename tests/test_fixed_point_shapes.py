"""One run reaches the fixed point a second run would: shapes a pass sharpened are inferred again before it ends.

merge-equal-dims and copy-reshape-dims keep every value (they preserve ``Shapes``) but spell a shape
computation so that inference's data propagation reads a dim it had lost; a pass that only inference's
shapes can feed (a MatMul's batch dim is not traced) then rewrites in a second run, unless the first one
infers again before it stops (vit-torchscript's layer-0 Reshape, which merge-equal-dims exposed).
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T, helper

import k3opt
from tests.helpers import assert_equivalent, make_model

H = helper.make_node


def _batch_of(src: str, pos: str, via_reshape: bool = False) -> list[onnx.NodeProto]:
    """``{pos}_b1`` = [dim 0 of ``src``] (Unsqueeze of the Gather; a Reshape to [1], which inference's data
    propagation does not read, with ``via_reshape``)."""
    last = H("Reshape", [f"{pos}_b", "one"], [f"{pos}_b1"]) if via_reshape else \
        H("Unsqueeze", [f"{pos}_b", "ax"], [f"{pos}_b1"])
    return [H("Shape", [src], [f"{pos}_sh"]), H("Gather", [f"{pos}_sh", "i0"], [f"{pos}_b"], axis=0), last]


def _reshaped(src: str, dim0: str, rest: str, out: str, allowzero: int = 0) -> list[onnx.NodeProto]:
    """``out`` = Reshape(``src``, Concat([dim0], ``rest``))."""
    return [H("Concat", [dim0, rest], [f"{out}_target"], axis=0),
            H("Reshape", [src, f"{out}_target"], [out], allowzero=allowzero)]


def _model(sharpener: str) -> onnx.ModelProto:
    """x[B, 6] -> h[B, 2, 3] (inference loses B: a Reshape in the target's arithmetic) -> ... ->
    MatMul -> Reshape(z2, [dim0(z2), -1, 3]) -> Relu: that last Reshape is a no-op once inference names
    z2's batch, which the ``sharpener`` pass's rewrite lets it do."""
    nodes = _batch_of("x", "x", via_reshape=True)
    if sharpener == "copy-reshape-dims":  # h's target becomes [0, 2, 3]: inference copies B
        nodes += _reshaped("x", "x_b1", "rest", "h") + [H("MatMul", ["h", "W"], ["z2"])]
    else:  # allowzero: copy-reshape-dims refuses; merge-equal-dims reads h's batch (traced B) from x instead
        nodes += _reshaped("x", "x_b1", "rest", "h", allowzero=1) + [H("MatMul", ["h", "W"], ["m"])]
        nodes += _batch_of("h", "h") + _reshaped("m", "h_b1", "rest2", "z") + [H("MatMul", ["z", "W"], ["z2"])]
    nodes += _batch_of("z2", "z2") + _reshaped("z2", "z2_b1", "rest2", "r") + [H("Relu", ["r"], ["y"])]
    inits = {"i0": np.array(0, np.int64), "one": np.array([1], np.int64), "ax": np.array([0], np.int64),
             "rest": np.array([2, 3], np.int64), "rest2": np.array([-1, 3], np.int64),
             "W": np.random.default_rng(3).standard_normal((3, 3)).astype(np.float32)}
    return make_model(nodes, [("x", T.FLOAT, ["B", 6])], [("y", T.FLOAT, ["B", 2, 3])], inits)


@pytest.mark.parametrize("sharpener", ["copy-reshape-dims", "merge-equal-dims"])
def test_one_run_reaches_the_fixed_point(sharpener):
    m = _model(sharpener)
    skip = ["copy-reshape-dims"] if sharpener == "merge-equal-dims" else []
    once = k3opt.optimize(m, verify=False, skip=skip)
    twice = k3opt.optimize(once, verify=False, skip=skip)
    assert next(n for n in once.graph.node if n.op_type == "Relu").input[0] == "z2"  # its no-op Reshape went
    assert [n.SerializeToString() for n in twice.graph.node] == [n.SerializeToString() for n in once.graph.node]
    assert_equivalent(m, once, feeds={"x": np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)})
