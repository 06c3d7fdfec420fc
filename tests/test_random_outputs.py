"""Issue #26 item 8: random ops and Dropout.

- An output an unseeded random op (or a training-mode Dropout) feeds differs on every run: verification
  compares it by type and shape only, and refuses (exit 2, naming --no-verify) when no output is left to
  compare by value; before, it blamed whichever pass ran first (remove-identity).
- Seeded random ops are compared by value; none is folded or merged, and none is written at an opset
  whose random kernels onnxruntime lacks (random ops at 22) without saying so.
- Dropout's mask changes meaning at opsets 10 (float -> bool) and 12 (onnxruntime: all False -> all True):
  a model reading it keeps its opset.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import k3opt
from k3opt.pipeline.random_outputs import random_outputs
from k3opt.report import Report
from tests.helpers import op_counts, run_ort
from tests.test_bad_input import assert_one_line_error, invoke, snapshot
from tests.test_refusals import unchecked

F = TensorProto.FLOAT


def training_dropout(seed=None, identity=True, opset=17) -> onnx.ModelProto:
    """Identity -> Dropout(ratio 0.5, training_mode True): the graph the hostile campaign sent."""
    kw = {} if seed is None else {"seed": seed}
    nodes = ([helper.make_node("Identity", ["x"], ["i"])] if identity else []) + [
        helper.make_node("Dropout", ["i" if identity else "x", "r", "tm"], ["y"], **kw)]
    model = unchecked(nodes, [("x", F, [4, 8])], [("y", F, [4, 8])],
                      [numpy_helper.from_array(np.array(0.5, np.float32), "r"), numpy_helper.from_array(np.array(True), "tm")])
    model.opset_import[0].version = opset
    return model


def noise_and_sum(seed=None) -> onnx.ModelProto:
    """Two outputs: x + noise (random unless seeded) and x + 1 (deterministic), with Identity nodes to remove."""
    kw = {} if seed is None else {"seed": float(seed)}
    nodes = [helper.make_node("Identity", ["x"], ["i"]), helper.make_node("RandomNormalLike", ["i"], ["n"], **kw),
             helper.make_node("Add", ["i", "n"], ["noisy"]), helper.make_node("Add", ["i", "one"], ["plain"])]
    return unchecked(nodes, [("x", F, [4, 8])], [("noisy", F, [4, 8]), ("plain", F, [4, 8])],
                     [numpy_helper.from_array(np.array(1.0, np.float32), "one")])


def test_which_outputs_are_random():
    assert random_outputs(training_dropout()) == {"y": "Dropout 'y'"}
    assert random_outputs(training_dropout(seed=3)) == {}
    assert random_outputs(noise_and_sum()) == {"noisy": "RandomNormalLike 'n'"}
    inference = training_dropout()
    inference.graph.initializer[1].CopyFrom(numpy_helper.from_array(np.array(False), "tm"))
    assert random_outputs(inference) == {}
    no_ratio = training_dropout()
    no_ratio.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.array(0.0, np.float32), "r"))
    assert random_outputs(no_ratio) == {}


def test_an_unseeded_training_dropout_blames_no_pass(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    onnx.save(training_dropout(), "m.onnx")
    before = snapshot(tmp_path)
    code, out, err = invoke(["optimize", "m.onnx", "o.onnx"])
    assert_one_line_error(code, out, err, 2, "every output depends on the unseeded random node Dropout 'y'")
    assert "--no-verify" in err and "diverging" not in err
    assert snapshot(tmp_path) == before
    code, out, err = invoke(["optimize", "m.onnx", "o.onnx", "--no-verify", "-q"])
    assert code == 0, err
    written = onnx.load("o.onnx")
    assert op_counts(written) == {"Dropout": 1}  # a training Dropout is never removed


def test_random_outputs_are_compared_by_shape_the_others_by_value():
    report = Report()
    out = k3opt.optimize(noise_and_sum(), verify=True, report=report)
    assert "Identity" not in op_counts(out)
    entries = {o["name"]: o for o in report.verification["outputs"]}
    assert entries["noisy"]["detail"].startswith("values not compared: random (RandomNormalLike 'n')")
    assert entries["plain"]["passed"] and "detail" not in entries["plain"]
    assert any("'noisy'" in w and "type and shape only" in w for w in report.warnings)


def test_a_pass_breaking_a_random_output_is_still_caught(register):
    """Compared by shape: a pass that changes the random output's shape fails verification."""
    from k3opt.pipeline.pass_base import Pass

    class Widen(Pass):
        name = "test-widen-noise"

        def run(self, graph, ctx):
            """The noise drawn like a (2, 4, 8) tensor: 'noisy' broadcasts to (2, 4, 8)."""
            from k3opt.graph import ir

            noise = next(n for n in graph.nodes if n.op == "RandomNormalLike")
            if ir.is_const(noise.inputs[0]):
                return 0
            ir.set_input(noise, 0, ir.as_constant("wide", np.zeros((2, 4, 8), np.float32)))
            for t in graph.outputs:
                t.shape = None
            return 1

    register(Widen)
    with pytest.raises(k3opt.VerificationError, match="output 'noisy'"):
        k3opt.optimize(noise_and_sum(), passes=["test-widen-noise"], verify=True)


def test_seeded_random_ops_are_compared_by_value():
    report = Report()
    k3opt.optimize(noise_and_sum(seed=7), verify=True, report=report)
    assert all("detail" not in o for o in report.verification["outputs"])
    k3opt.optimize(training_dropout(seed=7), verify=True)


def test_random_ops_at_an_opset_onnxruntime_lacks_are_not_written_unverified(tmp_path, monkeypatch):
    """RandomNormalLike-22 has no onnxruntime kernel: --opset 22 of a model it runs at 17 writes nothing."""
    monkeypatch.chdir(tmp_path)
    onnx.save(noise_and_sum(seed=7), "m.onnx")
    before = snapshot(tmp_path)
    code, out, err = invoke(["optimize", "m.onnx", "o.onnx", "--opset", "22"])
    assert_one_line_error(code, out, err, 2, "onnxruntime runs the input but not the optimized model at opset 22")
    assert "RandomNormalLike" in err and "--no-verify" in err
    assert snapshot(tmp_path) == before
    out = k3opt.optimize(noise_and_sum(seed=7), verify=True)  # the default opset (17) keeps them runnable
    assert out.opset_import[0].version == 17 and op_counts(out)["RandomNormalLike"] == 1


def dropout_with_mask(opset: int, mask_type: int = TensorProto.BOOL) -> onnx.ModelProto:
    nodes = [helper.make_node("Dropout", ["x"], ["d", "mask"]), helper.make_node("Identity", ["d"], ["y"])]
    model = unchecked(nodes, [("x", F, [2, 3])], [("y", F, [2, 3]), ("mask", mask_type, [2, 3])])
    model.opset_import[0].version = opset
    return model


@pytest.mark.parametrize("opset, mask_type", [(7, TensorProto.FLOAT), (10, TensorProto.BOOL), (11, TensorProto.BOOL)])
def test_a_dropout_mask_that_is_read_keeps_the_opset(opset, mask_type):
    model = dropout_with_mask(opset, mask_type)
    report = Report()
    for verify in (True, False):
        out = k3opt.optimize(model, verify=verify, report=report)
        assert out.opset_import[0].version == opset
        feeds = {"x": np.ones((2, 3), np.float32)}
        for a, b in zip(run_ort(model, feeds), run_ort(out, feeds)):
            assert a.dtype == b.dtype and np.array_equal(a, b)
    assert any("Dropout has no exact conversion" in n for n in report.notes)
    with pytest.raises(k3opt.UsageError, match="op Dropout has no exact conversion"):
        k3opt.optimize(model, opset=17)


def test_an_unread_dropout_mask_does_not_block_the_conversion():
    nodes = [helper.make_node("Dropout", ["x"], ["d", "mask"]), helper.make_node("Neg", ["d"], ["y"])]
    model = unchecked(nodes, [("x", F, [2, 3])], [("y", F, [2, 3])])
    model.opset_import[0].version = 10
    out = k3opt.optimize(model, verify=True)
    assert out.opset_import[0].version == 17 and op_counts(out) == {"Neg": 1}
