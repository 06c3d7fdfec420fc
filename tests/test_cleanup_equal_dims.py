"""merge-equal-dims: Gathers of Shapes reading the same symbolic dim become one value; other dims stay apart."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T, helper

import k3opt
from k3opt.passes.cleanup.merge_equal_dims import MergeEqualDims
from tests.helpers import assert_equivalent, make_model, op_counts, run_ort
from tests.test_cleanup_ops import apply
from tests.zoo import NAMES, needs_torch, zoo_inputs, zoo_model

F = T.FLOAT


def _two_dims(b_shape: list, ia: int = 0, ib: int = 0, index_shape: tuple = ()) -> onnx.ModelProto:
    """y = Cast(Gather(Shape(a), ia) + Gather(Shape(b), ib)) for a[N, S, 4] and b of ``b_shape``."""
    nodes = [
        helper.make_node("Shape", ["a"], ["sa"]), helper.make_node("Shape", ["b"], ["sb"]),
        helper.make_node("Gather", ["sa", "ia"], ["ga"], axis=0), helper.make_node("Gather", ["sb", "ib"], ["gb"], axis=0),
        helper.make_node("Add", ["ga", "gb"], ["s"]), helper.make_node("Cast", ["s"], ["y"], to=F),
    ]
    inits = {"ia": np.full(index_shape, ia, np.int64), "ib": np.full(index_shape, ib, np.int64)}
    return make_model(nodes, [("a", F, ["N", "S", 4]), ("b", F, b_shape)], [("y", F, list(index_shape))], inits)


@pytest.mark.parametrize("index_shape", [(), (1,)], ids=["scalar", "one-element"])
def test_same_symbol_merges(index_shape):
    model = _two_dims(["S", "N"], 0, 1, index_shape)
    out, n = apply(model, MergeEqualDims())
    assert n == 1 and op_counts(out)["Gather"] == 1
    feeds = {"a": np.zeros((2, 3, 4), np.float32), "b": np.zeros((3, 2), np.float32)}
    assert_equivalent(model, out, feeds=feeds)


@pytest.mark.parametrize("b_shape,ib", [(["M", "N"], 0), (["N", 5], 1), (["S", "N"], 0)],
                         ids=["other-symbol", "number", "same-tensor-other-dim"])
def test_different_dims_stay(b_shape, ib):
    model = _two_dims(b_shape, 0, ib)
    out, n = apply(model, MergeEqualDims())
    assert n == 0 and op_counts(out)["Gather"] == 2


def test_scalar_and_one_element_gathers_stay_apart():
    nodes = [
        helper.make_node("Shape", ["a"], ["sa"]), helper.make_node("Shape", ["b"], ["sb"]),
        helper.make_node("Gather", ["sa", "i0"], ["ga"], axis=0), helper.make_node("Gather", ["sb", "i1"], ["gb"], axis=0),
        helper.make_node("Add", ["ga", "gb"], ["s"]), helper.make_node("Cast", ["s"], ["y"], to=F),
    ]
    model = make_model(nodes, [("a", F, ["N", 4]), ("b", F, ["N", 4])], [("y", F, [1])],
                       {"i0": np.int64(0), "i1": np.int64([0])})
    out, n = apply(model, MergeEqualDims())
    assert n == 0


@needs_torch
@pytest.mark.parametrize("name", [n for n in NAMES if n != "vit"])
def test_torchscript_zoo_stays_exact(name):
    """TorchScript exports read batch/sequence from nearly every activation (llama 234 -> 202, gpt2 231 -> 219)."""
    model = onnx.load(zoo_model(name, "torchscript"))
    out = k3opt.optimize(model)
    feeds = zoo_inputs(name)
    for a, b in zip(run_ort(model, feeds), run_ort(out, feeds)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
    if name == "llama":
        assert len(out.graph.node) <= 202


@needs_torch
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_declared_symbols_untraced_give_the_traced_keys(name):
    """Under the graph's memo a declared symbol (batch, sequence) is not traced: every Gather of a Shape of a
    real export keys as a full trace keys it."""
    import onnx_graphsurgeon as gs

    from k3opt.passes.cleanup.merge_equal_dims import _dim_key
    from k3opt.passes.analysis.fold_shapes import DimAnalysis

    graph = gs.import_onnx(onnx.shape_inference.infer_shapes(onnx.load(zoo_model(name, "torchscript"))))
    gathers = [n for n in graph.nodes if n.op == "Gather" and len(n.outputs) == 1]
    with DimAnalysis(graph):
        fast = [_dim_key(n) for n in gathers]
    full = DimAnalysis(graph)
    full.memo.declared = frozenset()  # every symbol traced
    with full:
        assert [_dim_key(n) for n in gathers] == fast
    assert sum(k is not None for k in fast) > 2
