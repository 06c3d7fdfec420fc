"""remove-noop-ops: a Reshape whose target is read from shapes is a no-op when each element is the input's own dim."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T, helper

import k3opt
from k3opt.passes.cleanup.remove_noop_ops import RemoveNoopOps
from tests.helpers import assert_equivalent, assert_optimizes_within, make_model, op_counts, run_ort
from tests.test_cleanup_ops import apply
from tests.zoo import needs_torch, zoo_inputs, zoo_model

F = T.FLOAT


def _reshape_from_shapes(picks: list, z_dim: str = "S") -> onnx.ModelProto:
    """Reshape(x[N, 4, S, 8], Concat(pieces)): a piece is ("x", i) or ("z", 0) for a dim, or a literal int."""
    nodes = [helper.make_node("Shape", ["x"], ["sx"]), helper.make_node("Shape", ["z"], ["sz"])]
    inits: dict = {"ax": np.int64([0])}
    pieces = []
    for k, p in enumerate(picks):
        if isinstance(p, int):
            inits[f"c{k}"] = np.int64([p])
            pieces.append(f"c{k}")
            continue
        src, i = p
        inits[f"i{k}"] = np.int64(i)
        nodes += [helper.make_node("Gather", [f"s{src}", f"i{k}"], [f"g{k}"], axis=0),
                  helper.make_node("Unsqueeze", [f"g{k}", "ax"], [f"u{k}"])]
        pieces.append(f"u{k}")
    nodes += [helper.make_node("Concat", pieces, ["target"], axis=0),
              helper.make_node("Reshape", ["x", "target"], ["r"]),
              helper.make_node("Add", ["r", "z"], ["y"])]
    return make_model(nodes, [("x", F, ["N", 4, "S", 8]), ("z", F, [z_dim, 1])], [("y", F, ["N", 4, "S", 8])],
                      inits, opset=14)


def _feeds(n: int, s: int) -> dict:
    return {"x": np.random.rand(n, 4, s, 8).astype(np.float32), "z": np.random.rand(s, 1).astype(np.float32)}


@pytest.mark.parametrize("picks", [
    [("x", 0), -1, ("x", 2), 8], [("x", 0), 4, ("z", 0), 8], [0, -1, ("x", 2), 8],
], ids=["own-dims", "same-symbol-elsewhere", "zero-copies"])
def test_reshape_to_own_symbolic_shape_goes(picks):
    model = _reshape_from_shapes(picks)
    out, _ = apply(model, RemoveNoopOps())
    assert "Reshape" not in op_counts(out)
    for n, s in ((2, 3), (1, 5)):
        assert_equivalent(model, out, feeds=_feeds(n, s))


@pytest.mark.parametrize("picks,z_dim", [
    ([("x", 0), 4, ("z", 0), 8], "M"), ([("x", 2), -1, ("x", 0), 8], "S"), ([("x", 0), -1, -1, 8], "S"),
], ids=["other-symbol", "dims-swapped", "two-minus-ones"])
def test_reshape_refused_when_an_element_is_not_the_own_dim(picks, z_dim):
    model = _reshape_from_shapes(picks, z_dim)
    out, _ = apply(model, RemoveNoopOps())
    assert op_counts(out)["Reshape"] == 1


@needs_torch
def test_gpt2_torchscript_attention_reshapes_go():
    """GPT-2's TorchScript Reshape(x, [dim0(x), dim1(x), ...]) no-ops go: 238 -> 231 nodes (onnxslim: 241)."""
    assert_optimizes_within(zoo_model("gpt2", "torchscript"), zoo_inputs("gpt2"), max_nodes=231)


def _undo_model(inner: onnx.NodeProto, target_from_shape: bool, x_shape: list, target: list | None = None) -> onnx.ModelProto:
    """y = Neg(Reshape(inner(x), Shape(x) or ``target``))."""
    nodes = [inner]
    inits: dict = {"ax": np.int64([1]), "ax0": np.int64([0])}
    if target_from_shape:
        nodes.append(helper.make_node("Shape", ["x"], ["t"]))
    else:
        inits["t"] = np.int64(target)
    nodes += [helper.make_node("Reshape", ["m", "t"], ["r"]), helper.make_node("Neg", ["r"], ["y"])]
    out_shape = x_shape if target is None else [None] * len(target)
    return make_model(nodes, [("x", F, x_shape)], [("y", F, out_shape)], inits, opset=14)


@pytest.mark.parametrize("inner", [
    helper.make_node("Unsqueeze", ["x", "ax"], ["m"]),
    helper.make_node("Flatten", ["x"], ["m"], axis=1),
    helper.make_node("Squeeze", ["x", "ax0"], ["m"]),
], ids=["unsqueeze", "flatten", "squeeze"])
def test_reshape_back_to_the_regrouped_input_goes(inner):
    """Squeeze: the dynamo exporter's Reshape(Squeeze(Shape(x)[i:i+1]), [1])."""
    squeeze = inner.op_type == "Squeeze"
    model = _undo_model(inner, False, [1], [1]) if squeeze else _undo_model(inner, True, ["N", 4])
    out, _ = apply(model, RemoveNoopOps())
    assert "Reshape" not in op_counts(out)
    x = np.random.rand(*([1] if squeeze else [3, 4])).astype(np.float32)
    assert_equivalent(model, out, feeds={"x": x})


@pytest.mark.parametrize("inner,target", [
    (helper.make_node("Reshape", ["x", "mid"], ["m"]), [2, 6]),
    (helper.make_node("Transpose", ["x"], ["m"], perm=[1, 0]), [6, 2]),
], ids=["different-shape", "transpose-is-not-a-regrouping"])
def test_reshape_of_regrouped_input_refused(inner, target):
    nodes = [inner, helper.make_node("Reshape", ["m", "t"], ["r"]), helper.make_node("Neg", ["r"], ["y"])]
    model = make_model(nodes, [("x", F, [6, 2])], [("y", F, target)],
                       {"mid": np.int64([3, 4]), "t": np.int64(target)}, opset=14)
    out, _ = apply(model, RemoveNoopOps())
    assert op_counts(out).get("Reshape", 0) >= 1
    assert_equivalent(model, out)


@needs_torch
@pytest.mark.slow
def test_llama_dynamo_squeezed_dims_reshape_back():
    """The Llama dynamo export's Reshape(Squeeze(Shape(x)[i:i+1]), [1]) go: 187 -> 185 nodes (onnxscript: 187)."""
    model = onnx.load(zoo_model("llama", "dynamo"))
    out = k3opt.optimize(model)
    assert len(out.graph.node) <= 185
    feeds = zoo_inputs("llama")
    for a, b in zip(run_ort(model, feeds), run_ort(out, feeds)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)


def test_reshape_to_another_rank_is_refused_without_tracing_its_target(monkeypatch):
    """A Reshape whose output rank is not its input's is no no-op: decided before tracing the target."""
    from k3opt.graph.symbolic.dims import Dims

    def no_trace(*args, **kwargs):
        raise AssertionError("target traced")

    model = _reshape_from_shapes([("x", 0), -1])
    monkeypatch.setattr(Dims, "elements", no_trace)
    model.graph.output[0].type.tensor_type.shape.ClearField("dim")  # Add(r[N, -1], z) is not [N, 4, S, 8]
    model.graph.output[0].type.tensor_type.shape.dim.add()
    model.graph.output[0].type.tensor_type.shape.dim.add()
    out, n = apply(model, RemoveNoopOps())
    assert n == 0 and op_counts(out)["Reshape"] == 1


@needs_torch
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_rank_check_decides_every_reshape_as_tracing_does(name):
    """The output-rank check first, and declared symbols left untraced, decide each Reshape of a real export
    as tracing its target alone does."""
    import onnx_graphsurgeon as gs

    from k3opt.passes.cleanup.remove_noop_ops import _same_reshape
    from k3opt.pipeline.analyses import DimAnalysis

    graph = gs.import_onnx(onnx.shape_inference.infer_shapes(onnx.load(zoo_model(name, "torchscript"))))
    reshapes = [n for n in graph.nodes if n.op == "Reshape"]
    assert any(len(n.outputs[0].shape) != len(n.inputs[0].shape) for n in reshapes)
    for node in reshapes:
        fast = _same_reshape(DimAnalysis(graph), node)  # as the pass runs: declared symbols are not traced
        out, node.outputs[0].shape = node.outputs[0].shape, None  # unknown: decided by tracing alone
        full = DimAnalysis(graph)
        full.declared = frozenset()  # every symbol traced
        assert _same_reshape(full, node) is fast
        node.outputs[0].shape = out
