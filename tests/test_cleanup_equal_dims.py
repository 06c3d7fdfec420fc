"""merge-equal-dims: Gathers of Shapes reading the same symbolic dim become one value; other dims stay apart."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T, helper

import k3opt
from k3opt.passes.cleanup.merge_equal_dims import MergeEqualDims
from tests.helpers import assert_equivalent, body_op_counts, make_model, op_counts, run_ort
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
    """With the graph's Dims a declared symbol (batch, sequence) is not traced: every Gather of a Shape of a
    real export keys as a full trace keys it."""
    import onnx_graphsurgeon as gs

    from k3opt.passes.cleanup.merge_equal_dims import _dim_key
    from k3opt.pipeline.analyses import DimAnalysis

    graph = gs.import_onnx(onnx.shape_inference.infer_shapes(onnx.load(zoo_model(name, "torchscript"))))
    gathers = [n for n in graph.nodes if n.op == "Gather" and len(n.outputs) == 1]
    dims = DimAnalysis(graph)
    fast = [_dim_key(dims, n) for n in gathers]
    full = DimAnalysis(graph)
    full.declared = frozenset()  # every symbol traced
    assert [_dim_key(full, n) for n in gathers] == fast
    assert sum(k is not None for k in fast) > 2


# -- If/Loop/Scan bodies --------------------------------------------------------------------------------------

def _dims_branch(name: str, outputs: tuple[str, ...] = ("y",)) -> onnx.GraphProto:
    """A body reading the outer a[N, S, 4] and b[S, N]: y = Cast(Gather(Shape(a), 0) + Gather(Shape(b), 1))
    (both N); ``outputs`` may name the Gathers' results instead."""
    p = name + "_"
    nodes = [helper.make_node("Shape", ["a"], [p + "sa"]), helper.make_node("Shape", ["b"], [p + "sb"]),
             helper.make_node("Gather", [p + "sa", p + "i0"], [p + "ga"], axis=0),
             helper.make_node("Gather", [p + "sb", p + "i1"], [p + "gb"], axis=0),
             helper.make_node("Add", [p + "ga", p + "gb"], [p + "s"]),
             helper.make_node("Cast", [p + "s"], [p + "y"], to=F)]
    inits = [onnx.numpy_helper.from_array(np.int64(0), p + "i0"), onnx.numpy_helper.from_array(np.int64(1), p + "i1")]
    outs = [helper.make_tensor_value_info(p + o, F if o == "y" else T.INT64, None) for o in outputs]
    return helper.make_graph(nodes, name, [], outs, inits)


def _if_model(then_outputs: tuple[str, ...] = ("y",), outer_gather: bool = False) -> onnx.ModelProto:
    """If(c) over two :func:`_dims_branch` bodies; ``outer_gather`` adds the main graph's own Gather of N."""
    n_out = len(then_outputs)
    nodes = [helper.make_node("If", ["c"], [f"r{k}" for k in range(n_out)],
                              then_branch=_dims_branch("then", then_outputs),
                              else_branch=_dims_branch("else", then_outputs))]
    outputs = [(f"r{k}", F if o == "y" else T.INT64, []) for k, o in enumerate(then_outputs)]
    inits = {}
    if outer_gather:
        nodes += [helper.make_node("Shape", ["a"], ["outer_sa"]),
                  helper.make_node("Gather", ["outer_sa", "outer_i"], ["outer_n"], axis=0)]
        outputs.append(("outer_n", T.INT64, []))
        inits["outer_i"] = np.int64(0)
    return make_model(nodes, [("a", F, ["N", "S", 4]), ("b", F, ["S", "N"]), ("c", T.BOOL, [])], outputs, inits)


_IF_FEEDS = [{"a": np.zeros((2, 3, 4), np.float32), "b": np.zeros((3, 2), np.float32), "c": np.array(c)}
             for c in (True, False)]


def test_gathers_of_one_symbol_merge_inside_if_branches():
    model = _if_model()
    out, n = apply(model, MergeEqualDims())
    assert n == 2  # one per branch
    assert body_op_counts(out, "then_branch")["Gather"] == 1 and body_op_counts(out, "else_branch")["Gather"] == 1
    for feeds in _IF_FEEDS:
        assert_equivalent(model, out, feeds=feeds)
        np.testing.assert_array_equal(run_ort(out, feeds)[0], 4.0)


def test_a_body_reader_is_not_merged_with_the_outer_graphs():
    """The main graph's Gather of N and one per branch: each graph keeps its own (two in a branch merge)."""
    model = _if_model(outer_gather=True)
    out, n = apply(model, MergeEqualDims())
    assert n == 2 and op_counts(out)["Gather"] == 1 and body_op_counts(out, "then_branch")["Gather"] == 1
    for feeds in _IF_FEEDS:
        assert_equivalent(model, out, feeds=feeds)


def test_body_outputs_are_not_merged():
    model = _if_model(then_outputs=("ga", "gb"))
    out, n = apply(model, MergeEqualDims())
    assert n == 0 and body_op_counts(out, "then_branch")["Gather"] == 2


def test_gathers_of_one_symbol_merge_inside_a_loop_body():
    """v += N + N for three iterations, N read twice from the outer a and b inside the body."""
    branch = _dims_branch("body")
    body = helper.make_graph(
        list(branch.node) + [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
                             helper.make_node("Add", ["v_in", "body_y"], ["v_out"])],
        "body", [helper.make_tensor_value_info("iter", T.INT64, []),
                 helper.make_tensor_value_info("cond_in", T.BOOL, []), helper.make_tensor_value_info("v_in", F, [])],
        [helper.make_tensor_value_info("cond_out", T.BOOL, []), helper.make_tensor_value_info("v_out", F, [])],
        list(branch.initializer))
    model = make_model([helper.make_node("Loop", ["m", "", "v0"], ["v"], body=body)],
                       [("a", F, ["N", "S", 4]), ("b", F, ["S", "N"])], [("v", F, [])],
                       {"m": np.int64(3), "v0": np.float32(0)})
    out, n = apply(model, MergeEqualDims())
    assert n == 1 and body_op_counts(out, "body")["Gather"] == 1
    feeds = {"a": np.zeros((2, 3, 4), np.float32), "b": np.zeros((3, 2), np.float32)}
    assert_equivalent(model, out, feeds=feeds)
    np.testing.assert_array_equal(run_ort(out, feeds)[0], 12.0)
