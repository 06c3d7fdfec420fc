"""copy-reshape-dims, and the dim tracing it relies on (Resize with scale 1, Concat, Slice, Conv's batch)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import k3opt
from tests.helpers import assert_equivalent, make_model, op_counts

F = TensorProto.FLOAT
RNG = np.random.default_rng(11)


def model(upstream: str = "Resize", allowzero: int = 0, pick: int = 0, other_input: bool = False):
    """x[B,4,H,4] -> Conv -> ``upstream`` -> Reshape(y, [dim(src, pick), 2, 2, -1])."""
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"])]
    inits = {"W": RNG.standard_normal((4, 4, 1, 1)).astype(np.float32), "rest": np.array([2, 2, -1], np.int64),
             "i": np.array(pick, np.int64), "ax": np.array([0], np.int64)}
    if upstream == "Resize":
        inits["scales"] = np.array([1, 1, 2, 2], np.float32)
        nodes.append(helper.make_node("Resize", ["c", "", "scales"], ["u"], mode="nearest"))
    elif upstream == "Slice":
        inits.update(st=np.array([1], np.int64), en=np.array([3], np.int64), axs=np.array([1], np.int64))
        nodes.append(helper.make_node("Slice", ["c", "st", "en", "axs"], ["u"]))
    else:
        nodes.append(helper.make_node("Concat", ["c", "c"], ["u"], axis=1))
    src = "x2" if other_input else "u"
    nodes += [helper.make_node("Shape", [src], ["sh"]), helper.make_node("Gather", ["sh", "i"], ["d"], axis=0),
              helper.make_node("Unsqueeze", ["d", "ax"], ["d1"]),
              helper.make_node("Concat", ["d1", "rest"], ["target"], axis=0),
              helper.make_node("Reshape", ["u", "target"], ["y"], allowzero=allowzero)]
    inputs = [("x", F, ["B", 4, "H", 4])] + ([("x2", F, ["C", 4, 4, 4])] if other_input else [])
    return make_model(nodes, inputs, [("y", F, ["B", 2, 2, "r"])], inits, opset=17)


@pytest.mark.parametrize("upstream", ["Resize", "Slice", "Concat"])
def test_batch_copied(upstream):
    m = model(upstream)
    out = k3opt.optimize(m, verify=False)
    counts = op_counts(out)
    assert "Shape" not in counts and "Concat" not in counts or upstream == "Concat" and counts.get("Concat") == 1
    assert "Gather" not in counts
    assert_equivalent(m, out)


@pytest.mark.parametrize("kwargs", [dict(allowzero=1), dict(pick=2, upstream="Concat"), dict(other_input=True)],
                         ids=["allowzero", "other-axis", "other-tensor"])
def test_refused(kwargs):
    m = model(**kwargs)
    out = k3opt.optimize(m, verify=False, passes=["copy-reshape-dims"])
    assert op_counts(out).get("Shape") == 1
    feeds = {"x": RNG.standard_normal((2, 4, 4, 4)).astype(np.float32)}
    if kwargs.get("other_input"):
        feeds["x2"] = RNG.standard_normal((2, 4, 4, 4)).astype(np.float32)
    assert_equivalent(m, out, feeds=feeds)


def paddle_head(second=200, two_unknown=False):
    """PaddleOCR's classifier head: Reshape(pool, Concat(Cast(Slice(Cast(Shape(pool)))), [200])), then the
    opset-13 Softmax conversion's Flatten/Softmax/Reshape-to-Shape."""
    i32 = TensorProto.INT32
    nodes = [helper.make_node("GlobalAveragePool", ["x"], ["pool"]),
             helper.make_node("Shape", ["pool"], ["sh"]), helper.make_node("Cast", ["sh"], ["sh32"], to=i32),
             helper.make_node("Slice", ["sh32", "z", "o", "z", "o"], ["b32"]),
             helper.make_node("Cast", ["b32"], ["b"], to=TensorProto.INT64),
             helper.make_node("Concat", ["b", "b" if two_unknown else "rest"], ["target"], axis=-1),
             helper.make_node("Reshape", ["pool", "target"], ["flat"]),
             helper.make_node("Gemm", ["flat", "W", "bias"], ["logits"]),
             helper.make_node("Shape", ["logits"], ["lsh"]),
             helper.make_node("Flatten", ["logits"], ["lf"], axis=1),
             helper.make_node("Softmax", ["lf"], ["sm"], axis=-1),
             helper.make_node("Reshape", ["sm", "lsh"], ["y"])]
    inits = {"z": np.array([0], np.int32), "o": np.array([1], np.int32), "rest": np.array([second], np.int64),
             "W": RNG.standard_normal((200, 2)).astype(np.float32), "bias": RNG.standard_normal(2).astype(np.float32)}
    return make_model(nodes, [("x", F, ["N", 200, "h", "w"])], [("y", F, ["N", 2])], inits, opset=17)


def test_lone_unknown_becomes_minus_one_and_softmax_wrapping_goes():
    m = paddle_head()
    out = k3opt.optimize(m, verify=False)
    assert op_counts(out) == {"GlobalAveragePool": 1, "Reshape": 1, "Gemm": 1, "Softmax": 1}
    reshape = next(n for n in out.graph.node if n.op_type == "Reshape")
    target = next(i for i in out.graph.initializer if i.name == reshape.input[1])
    # the Casts around the Shape are read through: the batch is a copy of the input's dim 0
    assert list(onnx.numpy_helper.to_array(target)) == [0, 200]
    assert_equivalent(m, out, feeds={"x": RNG.standard_normal((3, 200, 2, 2)).astype(np.float32)})


def test_two_unknowns_stay():
    m = paddle_head(two_unknown=True)
    out = k3opt.optimize(m, verify=False, passes=["copy-reshape-dims"])
    assert op_counts(out)["Concat"] == 1
