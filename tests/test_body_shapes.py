"""Shapes inside If/Loop bodies: inference's body value_info reaches the body tensors, so passes that need
shapes (fuse-layernorm, fold-constants' shape folding) work in bodies too."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import k3opt
from k3opt.pipeline import shapes
from k3opt.modelio import import_graph
from tests.helpers import assert_equivalent, make_model

F = TensorProto.FLOAT


def layer_norm_branch(name: str) -> onnx.GraphProto:
    """A decomposed LayerNorm of the outer ``x`` over its last axis, then Relu."""
    p = name + "_"
    nodes = [helper.make_node("ReduceMean", ["x"], [p + "mean"], axes=[-1]),
             helper.make_node("Sub", ["x", p + "mean"], [p + "d"]),
             helper.make_node("Pow", [p + "d", p + "two"], [p + "sq"]),
             helper.make_node("ReduceMean", [p + "sq"], [p + "var"], axes=[-1]),
             helper.make_node("Add", [p + "var", p + "eps"], [p + "ve"]),
             helper.make_node("Sqrt", [p + "ve"], [p + "std"]),
             helper.make_node("Div", [p + "d", p + "std"], [p + "n"]),
             helper.make_node("Mul", [p + "n", p + "g"], [p + "s"]),
             helper.make_node("Add", [p + "s", p + "b"], [p + "o"]),
             helper.make_node("Relu", [p + "o"], [p + "out"])]
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.array(2.0, np.float32), p + "two"),
             numpy_helper.from_array(np.array(1e-5, np.float32), p + "eps"),
             numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), p + "g"),
             numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), p + "b")]
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(p + "out", F, None)], inits)


def if_model() -> onnx.ModelProto:
    nodes = [helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
             helper.make_node("Greater", ["total", "zero"], ["c"]),
             helper.make_node("If", ["c"], ["y"], then_branch=layer_norm_branch("then"),
                              else_branch=layer_norm_branch("else"))]
    return make_model(nodes, [("x", F, ["B", 4, 8])], [("y", F, ["B", 4, 8])], {"zero": np.array(0.0, np.float32)})


def test_body_tensors_get_inferred_shapes():
    model = if_model()
    graph = import_graph(model)
    assert shapes.ShapeRefresher().seed(graph, model)
    body = graph.nodes[-1].attrs["then_branch"]
    mean = next(n for n in body.nodes if n.op == "ReduceMean").outputs[0]
    assert mean.shape == ["B", 4, 1] and mean.dtype == np.float32
    refreshed = import_graph(model)
    assert shapes.ShapeRefresher()(refreshed)
    assert next(n for n in refreshed.nodes[-1].attrs["else_branch"].nodes if n.op == "Relu").outputs[0].shape == ["B", 4, 8]


def test_layernorm_fuses_in_both_branches():
    model = if_model()
    out = k3opt.optimize(model)
    for branch in ("then_branch", "else_branch"):
        body = next(a.g for a in out.graph.node[-1].attribute if a.name == branch)
        assert [n.op_type for n in body.node] == ["LayerNormalization", "Relu"]
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 4, 8)).astype(np.float32)}
    assert_equivalent(model, out, feeds=feeds)
    assert_equivalent(model, out, feeds={"x": -np.abs(feeds["x"])})


def test_loop_body_shapes():
    body_nodes = [helper.make_node("Add", ["acc_in", "x"], ["acc_out"]),
                  helper.make_node("Identity", ["cond_in"], ["cond_out"])]
    body = helper.make_graph(body_nodes, "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                                                  helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                                                  helper.make_tensor_value_info("acc_in", F, ["B", 3])],
                             [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
                              helper.make_tensor_value_info("acc_out", F, None)])
    nodes = [helper.make_node("Loop", ["n", "t", "x"], ["y"], body=body)]
    model = make_model(nodes, [("x", F, ["B", 3]), ("n", TensorProto.INT64, []), ("t", TensorProto.BOOL, [])],
                       [("y", F, ["B", 3])])
    graph = import_graph(model)
    assert shapes.ShapeRefresher().seed(graph, model)
    add = graph.nodes[0].attrs["body"].nodes[0].outputs[0]
    assert add.dtype == np.float32 and add.shape is not None and len(add.shape) == 2


def test_sibling_matmuls_merge_in_a_body():
    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), n) for n in ("wq", "wk", "wv")]
    # three siblings: a merged pair would save no node, so merge-sibling-matmuls leaves pairs alone
    branch = helper.make_graph([helper.make_node("MatMul", ["x", "wq"], ["q"]), helper.make_node("MatMul", ["x", "wk"], ["k"]),
                                helper.make_node("MatMul", ["x", "wv"], ["v"]), helper.make_node("Add", ["q", "k"], ["qk"]),
                                helper.make_node("Add", ["qk", "v"], ["s"])], "then", [],
                               [helper.make_tensor_value_info("s", F, None)], inits)
    other = helper.make_graph([helper.make_node("ReduceSum", ["x", "ax"], ["r"], keepdims=1)], "else", [],
                              [helper.make_tensor_value_info("r", F, None)],
                              [numpy_helper.from_array(np.array([2], np.int64), "ax")])
    nodes = [helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
             helper.make_node("Greater", ["total", "zero"], ["c"]),
             helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=other)]
    model = make_model(nodes, [("x", F, ["B", 4, 8])], [("y", F, ["B", 4, "n"])], {"zero": np.array(0.0, np.float32)})
    out = k3opt.optimize(model)
    body = next(a.g for a in out.graph.node[-1].attribute if a.name == "then_branch")
    assert sorted(n.op_type for n in body.node) == ["Add", "Add", "MatMul", "Split"]
    feeds = {"x": np.abs(rng.standard_normal((2, 4, 8)).astype(np.float32))}
    assert_equivalent(model, out, feeds=feeds)
