"""castlike-to-cast: CastLike to a known type becomes Cast, and a constant operand then folds."""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto as T, helper

import k3opt
from k3opt.pipeline.pass_base import PassContext
from k3opt.passes.cleanup.castlike_to_cast import CastLikeToCast
from k3opt.passes.fold.fold_constants import FoldConstants
from tests.helpers import assert_equivalent, make_model, op_counts, run_ort
from tests.test_cleanup_ops import apply
from tests.zoo import needs_torch, zoo_inputs, zoo_model

F = T.FLOAT


@pytest.mark.parametrize("like_type", [T.FLOAT16, T.DOUBLE, T.INT32], ids=["f16", "f64", "i32"])
def test_castlike_of_input_becomes_cast(like_type):
    nodes = [helper.make_node("CastLike", ["x", "like"], ["c"]), helper.make_node("Cast", ["c"], ["y"], to=T.DOUBLE)]
    model = make_model(nodes, [("x", F, ["N", 3]), ("like", like_type, [2])], [("y", T.DOUBLE, ["N", 3])], opset=17)
    out, n = apply(model, CastLikeToCast())
    assert n == 1 and "CastLike" not in op_counts(out)
    cast = next(node for node in out.graph.node if node.output[0] == "c")
    assert list(cast.input) == ["x"] and cast.attribute[0].i == like_type
    onnx.checker.check_model(out)
    assert_equivalent(model, out, feeds={"x": np.float32([[1.5, -2.25, 1e5]] * 2), "like": np.zeros(2, onnx.helper.tensor_dtype_to_np_dtype(like_type))})


def test_castlike_of_constant_folds():
    """The dynamo RMSNorm's CastLike(1.0, hidden): after the rewrite the constant folds."""
    nodes = [helper.make_node("CastLike", ["one", "x"], ["c"]), helper.make_node("Div", ["c", "x"], ["y"])]
    model = make_model(nodes, [("x", T.FLOAT16, ["N"])], [("y", T.FLOAT16, ["N"])], {"one": np.float32(1.0)}, opset=17)
    out, _ = apply(model, CastLikeToCast(), FoldConstants())
    assert op_counts(out) == {"Div": 1}
    assert_equivalent(model, out, feeds={"x": np.float16([1, 2, 4])})


def test_refused_when_like_type_unknown():
    graph = gs.Graph(opset=17)
    x = gs.Variable("x", dtype=np.float32, shape=[2])
    like = gs.Variable("like")  # no type
    out = gs.Variable("y")
    graph.nodes.append(gs.Node("CastLike", inputs=[x, like], outputs=[out]))
    graph.inputs, graph.outputs = [x], [out]
    assert CastLikeToCast().run(graph, PassContext(opset=17)) == 0
    assert graph.nodes[0].op == "CastLike"


@needs_torch
@pytest.mark.slow
def test_llama_dynamo_castlikes_fold():
    """Every CastLike of the Llama dynamo export goes: 191 -> 187 nodes (onnxscript: 187)."""
    model = onnx.load(zoo_model("llama", "dynamo"))
    out = k3opt.optimize(model)
    assert "CastLike" not in op_counts(out) and len(out.graph.node) <= 187
    feeds = zoo_inputs("llama")
    for a, b in zip(run_ort(model, feeds), run_ort(out, feeds)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
