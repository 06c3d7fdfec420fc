"""Constant nodes lifted into initializers before the import (modelio.lift_constant_nodes): exactly the ones
fold-constants' first step would lift and inference reads alike, only when fold-constants runs first, and
whole runs byte for byte what they were without it (report included, but for the time taken)."""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
from onnx import TensorProto as T, helper, numpy_helper

import k3opt
from k3opt import api, modelio
from k3opt.report import Report
from k3opt.graph import ir
from k3opt.pipeline.pass_base import Pass, register_pass, unregister_pass
from tests.helpers import make_model
from tests.zoo import zoo_model

F = T.FLOAT


def _const(name: str, out: str, value: np.ndarray, **fields) -> onnx.NodeProto:
    t = numpy_helper.from_array(value)
    for key, v in fields.items():
        setattr(t, key, v)
    return helper.make_node("Constant", [], [out], name=name, value=t)


def literal_model() -> onnx.ModelProto:
    """One Constant of each kind the lift takes or leaves, all read by Adds on the way to ``y``."""
    small = np.arange(4, dtype=np.float32)
    nodes = [
        _const("lifted", "c1", small),
        _const("", "c2", small + 1),  # unnamed: lifted, its empty name reserved (harmless)
        helper.make_node("Constant", [], ["c3"], name="ints", value_floats=[1.0, 2.0, 3.0, 4.0]),  # left to fold
        _const("big", "c4", np.ones((256,), np.float32)),  # 1 KB: inference would not read it as an initializer
        _const("located", "c5", small, data_location=T.DEFAULT),  # a data_location: left
        _const("unread", "c6", small),  # read by nothing: left
        _const("out", "c7", small),  # a graph output: left
        helper.make_node("Add", ["x", "c1"], ["a1"]), helper.make_node("Add", ["a1", "c2"], ["a2"]),
        helper.make_node("Add", ["a2", "c3"], ["a3"]), helper.make_node("Add", ["a3", "c4"], ["a4"]),
        helper.make_node("Add", ["a4", "c5"], ["y"]),
    ]
    return make_model(nodes, [("x", F, [4])], [("y", F, [4]), ("c7", F, [4])])


def named_like_a_fresh_name() -> onnx.ModelProto:
    """A folded graph output gets a Constant node named ``y_const``, fresh: a lifted node has that name."""
    nodes = [_const("y_const", "k", np.ones(4, np.float32)), _const("k2", "k2", np.ones(4, np.float32)),
             helper.make_node("Add", ["k", "k2"], ["y"]), helper.make_node("Relu", ["x"], ["z"])]
    return make_model(nodes, [("x", F, [4])], [("y", F, [4]), ("z", F, [4])])


def test_lifts_what_fold_constants_lifts_first_and_inference_reads_alike():
    model = literal_model()
    values = {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in model.graph.node
              if n.op_type == "Constant" and n.attribute[0].name == "value"}
    assert modelio.lift_constant_nodes(model) == ["lifted", ""]
    assert [i.name for i in model.graph.initializer] == ["c1", "c2"]
    for init in model.graph.initializer:
        np.testing.assert_array_equal(numpy_helper.to_array(init), values[init.name])
    assert [n.output[0] for n in model.graph.node if n.op_type == "Constant"] == ["c3", "c4", "c5", "c6", "c7"]
    onnx.checker.check_model(model)
    assert modelio.lift_constant_nodes(model) == []  # nothing left to lift


def _without_lifting(monkeypatch) -> None:
    monkeypatch.setattr(api.modelio, "lift_constant_nodes", lambda model: [])


def _run(model: onnx.ModelProto, **kwargs) -> tuple[bytes, dict]:
    report = Report()
    out = k3opt.optimize(model, report=report, **kwargs)
    summary = report.as_dict()
    summary.pop("timings", None)
    for p in summary["passes"]:
        p.pop("time_s")
    return out.SerializeToString(), summary


@pytest.mark.parametrize("source", ["literals", "fresh-name", ("llama", "torchscript"), ("bert", "torchscript"),
                                    ("deepseek_v3", "torchscript"), ("qwen2", "dynamo"), ("vit", "torchscript")])
@pytest.mark.parametrize("target", ["onnx", "cann"])
def test_a_run_is_the_same_with_and_without_lifting(monkeypatch, source, target):
    """The output bytes and the report (fold-constants' rewrites and starting node count included)."""
    model = {"literals": literal_model, "fresh-name": named_like_a_fresh_name}.get(source)
    model = model() if model is not None else onnx.load(str(zoo_model(*source)))
    given = model.SerializeToString()
    lifted = _run(model, target=target)
    assert model.SerializeToString() == given  # the caller's proto is never touched
    _without_lifting(monkeypatch)
    assert lifted == _run(model, target=target)


def test_lifted_node_names_stay_taken():
    """A fresh name never takes a lifted Constant node's name: without the lift, the node was still in
    the graph when the run gathered its names (the fresh-name model above shows it on a whole run)."""
    scope = ir.NameScope(gs.Graph())
    scope.reserve(["lifted"])
    assert scope.fresh("lifted") == "lifted_1" and scope.fresh("other") == "other"


class Spy(Pass):
    """Records whether the run lifted Constant nodes before it (it sees them as nodes or not)."""

    name = "test-constant-spy"
    order = 50  # before fold-constants
    seen: list = []

    def run(self, graph, ctx) -> int:
        Spy.seen.append(sum(n.op == "Constant" for n in graph.nodes))
        return 0


def test_no_lifting_unless_fold_constants_runs_first(monkeypatch):
    calls = []
    original = modelio.lift_constant_nodes
    monkeypatch.setattr(api.modelio, "lift_constant_nodes", lambda model: calls.append(1) or original(model))
    model = literal_model()
    k3opt.optimize(model)
    assert calls == [1]
    out = k3opt.optimize(model, skip=["fold-constants"])  # the user keeps their Constant nodes
    assert calls == [1] and "c2" in [n.output[0] for n in out.graph.node if n.op_type == "Constant"]
    register_pass(Spy)
    try:
        Spy.seen.clear()
        k3opt.optimize(model)  # a pass before fold-constants sees the model's Constant nodes as they are
        assert calls == [1] and Spy.seen[0] == 7
    finally:
        unregister_pass(Spy.name)


def test_no_lifting_in_a_model_with_bodies(monkeypatch):
    """A body may read an outer Constant's output: loading's "no body" is what lets the lift look at the
    main graph's readers only."""
    calls = []
    monkeypatch.setattr(api.modelio, "lift_constant_nodes", lambda model: calls.append(1) or [])
    branch = helper.make_graph([helper.make_node("Add", ["x", "c"], ["b"])], "then", [],
                               [helper.make_tensor_value_info("b", F, [4])])
    nodes = [_const("k", "c", np.ones(4, np.float32)),
             helper.make_node("Constant", [], ["cond"], value=numpy_helper.from_array(np.array(True))),
             helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch)]
    k3opt.optimize(make_model(nodes, [("x", F, [4])], [("y", F, [4])]))
    assert calls == []


def test_a_file_with_external_data_is_the_same_with_and_without_lifting(tmp_path, monkeypatch):
    """External weights (an initializer, and a Constant node's value: never lifted) are found by the import
    after the lift reorders the node field; the written files are those of a run without the lift."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 256)).astype(np.float32)  # 4 KB
    nodes = [_const("big", "cb", rng.standard_normal((4, 256)).astype(np.float32)),
             _const("s1", "c1", np.ones((4, 1), np.float32)), _const("s2", "c2", np.full((4, 1), 2, np.float32)),
             helper.make_node("Add", ["x", "c1"], ["a"]), helper.make_node("Mul", ["a", "c2"], ["m"]),
             helper.make_node("Add", ["m", "cb"], ["b"]), helper.make_node("Add", ["b", "w"], ["y"])]
    src = tmp_path / "model.onnx"
    onnx.save(make_model(nodes, [("x", F, [4, 256])], [("y", F, [4, 256])], {"w": w}), str(src),
              save_as_external_data=True, all_tensors_to_one_file=True, location="model.bin", size_threshold=1024,
              convert_attribute=True)
    stored = onnx.load(str(src), load_external_data=False).graph
    tensors = [*stored.initializer, *[n.attribute[0].t for n in stored.node if n.op_type == "Constant"]]
    assert [t.data_location == T.EXTERNAL for t in tensors] == [True, True, False, False]
    written = []
    for name in ("lifted", "plain"):
        out = tmp_path / name / "out.onnx"
        out.parent.mkdir()
        k3opt.optimize_file(src, out, external_data=True)
        written.append(sorted((p.name, p.read_bytes()) for p in out.parent.iterdir()))
        _without_lifting(monkeypatch)
    assert written[0] == written[1]
    x = rng.standard_normal((4, 256)).astype(np.float32)
    got = ort.InferenceSession(str(tmp_path / "lifted" / "out.onnx")).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, (x + 1) * 2 + numpy_helper.to_array(nodes[0].attribute[0].t) + w, rtol=1e-6)
