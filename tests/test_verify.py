"""Verification: inputs, comparison, skipping what onnxruntime cannot run, bisecting to the bad pass."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import k3opt
from k3opt.pipeline import verify
from k3opt.errors import InputError, UsageError, VerificationError
from k3opt.graph.ir import as_constant, replace_uses
from k3opt.pipeline.pass_base import Pass
from k3opt.report import Report
from tests.conftest import DropOneIdentity, ReluToSigmoid
from tests.helpers import make_model


def embedding_model() -> onnx.ModelProto:
    """ids -> Cast -> Gather(emb[50, 4]) * mask -> y; plus a float input."""
    emb = np.random.default_rng(0).standard_normal((50, 4)).astype(np.float32)
    nodes = [helper.make_node("Cast", ["ids"], ["ids64"], to=TensorProto.INT64),
             helper.make_node("Gather", ["emb", "ids64"], ["e"]),
             helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["m", "ax"], ["m3"]),
             helper.make_node("Mul", ["e", "m3"], ["em"]),
             helper.make_node("Add", ["em", "x"], ["y"])]
    return make_model(nodes, [("ids", TensorProto.INT32, ["b", "s"]), ("attention_mask", TensorProto.INT64, ["b", "s"]),
                              ("x", TensorProto.FLOAT, ["b", "s", 4])],
                      [("y", TensorProto.FLOAT, ["b", "s", 4])], {"emb": emb, "ax": np.array([-1], dtype=np.int64)})


def relu_chain() -> onnx.ModelProto:
    nodes = [helper.make_node("Identity", ["x"], ["a"]), helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("Identity", ["b"], ["y"])]
    return make_model(nodes, [("x", TensorProto.FLOAT, [3, 4])], [("y", TensorProto.FLOAT, [3, 4])])


def test_feeds_are_seeded_and_range_aware():
    model = embedding_model()
    feeds = verify.make_feeds(model, symbolic_dim=64)
    assert feeds["ids"].dtype == np.int32 and feeds["ids"].max() < 50 and feeds["ids"].max() > 8
    assert np.all(feeds["attention_mask"] == 1)
    assert feeds["x"].shape == (64, 64, 4) and feeds["x"].dtype == np.float32
    again = verify.make_feeds(model, symbolic_dim=64)
    assert all(np.array_equal(feeds[k], again[k]) for k in feeds)


def test_user_input_data(tmp_path):
    model = embedding_model()
    ids = np.array([[1, 2, 3]], dtype=np.int64)
    np.savez(tmp_path / "in.npz", ids=ids)
    feeds = verify.make_feeds(model, input_data=tmp_path / "in.npz")
    assert feeds["ids"].dtype == np.int32 and feeds["ids"].tolist() == [[1, 2, 3]]
    np.savez(tmp_path / "bad.npz", nope=ids)
    with pytest.raises(UsageError, match="nope"):
        verify.make_feeds(model, input_data=tmp_path / "bad.npz")
    (tmp_path / "junk.npz").write_bytes(b"junk")
    with pytest.raises(InputError, match="cannot read input data"):
        verify.make_feeds(model, input_data=tmp_path / "junk.npz")


def test_compare_tolerances_and_edge_cases():
    a = np.array([1.0, 2.0, np.nan], dtype=np.float32)
    ok = verify.compare([a], [a + 1e-6], ["y"])
    assert ok["status"] == "passed" and ok["outputs"][0]["max_abs"] < 2e-6
    bad = verify.compare([a], [a + 1e-2], ["y"])
    assert bad["status"] == "failed" and bad["outputs"][0]["max_rel"] == pytest.approx(1e-2, rel=1e-3)
    assert verify.compare([a], [a + 1e-2], ["y"], rtol=0.1)["status"] == "passed"
    half = np.ones(3, dtype=np.float16)
    assert verify.compare([half], [half * np.float16(1.004)], ["h"])["status"] == "passed"  # fp16 defaults
    assert verify.compare([a], [a[:2]], ["y"])["status"] == "failed"  # shape
    assert verify.compare([np.array([1, 2])], [np.array([1, 3])], ["i"])["status"] == "failed"  # ints exact
    assert verify.compare([a], [np.array([1.0, 2.0, 0.0], np.float32)], ["y"])["status"] == "failed"  # NaN lost


def test_first_diverging_step_binary_search():
    calls = []

    def diverges(k):
        calls.append(k)
        return k >= 7

    assert verify.first_diverging_step([1, 3, 5, 7, 9, 11], diverges) == 7
    assert len(calls) <= 3
    assert verify.first_diverging_step([], diverges) is None


def test_wrong_rewrite_is_caught_and_bisected_to_its_pass(register, tmp_path):
    register(DropOneIdentity)
    register(ReluToSigmoid)
    onnx.save(relu_chain(), tmp_path / "m.onnx")
    report = Report()
    with pytest.raises(VerificationError, match="first diverging pass: test-relu-to-sigmoid"):
        k3opt.optimize_file(tmp_path / "m.onnx", tmp_path / "o.onnx", passes=["test-drop-one-identity",
                            "test-relu-to-sigmoid"], verify=True, report=report)
    assert not (tmp_path / "o.onnx").exists()
    assert report.verification["status"] == "failed"
    assert report.verification["first_diverging_pass"] == "test-relu-to-sigmoid"
    # a loose enough tolerance accepts it
    k3opt.optimize(relu_chain(), passes=["test-relu-to-sigmoid"], verify=True, atol=1.0)


def scaled_by_batch() -> onnx.ModelProto:
    """y = x * batch, the batch read off Shape(x) (x: [batch, 4])."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "zero"], ["b"], axis=0),
             helper.make_node("Cast", ["b"], ["bf"], to=TensorProto.FLOAT), helper.make_node("Mul", ["x", "bf"], ["y"])]
    return make_model(nodes, [("x", TensorProto.FLOAT, ["batch", 4])], [("y", TensorProto.FLOAT, ["batch", 4])],
                      {"zero": np.array(0, np.int64)})


class BatchIsTwo(Pass):
    """Test pass: a WRONG rewrite exact at one batch size: the batch read off ``Shape(x)`` becomes the constant 2,
    the size verification gives a free symbol first (as a Reshape target made constant from the size it saw)."""

    name = "test-batch-is-two"
    description = "test: wrong at every batch but 2"
    default = False

    def run(self, graph, ctx) -> int:
        gathers = [n for n in graph.nodes if n.op == "Gather" and n.outputs[0].outputs]
        for node in gathers:
            replace_uses(graph, node.outputs[0], as_constant(ctx.fresh_name("two"), np.array(2, np.int64)))
        return len(gathers)


def test_a_rewrite_exact_at_one_batch_size_only_is_caught_at_the_second(register):
    """Verification runs the symbolic dims at a second size: a rewrite equal at batch 2 and wrong at 3 fails
    there, and is bisected to its pass with the second size's inputs."""
    register(BatchIsTwo)
    report = Report()
    with pytest.raises(VerificationError, match=r"at batch=3, though equal at batch=2 .*first diverging pass: "
                                                r"test-batch-is-two"):
        k3opt.optimize(scaled_by_batch(), passes=["test-batch-is-two"], verify=True, report=report)
    v = report.verification
    assert v["status"] == "failed" and v["sizes"] == {"batch": 3} and v["equal_at"] == {"batch": 2}
    assert v["first_diverging_pass"] == "test-batch-is-two"
    # at the one batch the user fixes, the rewrite is exact: no other size to try, and nothing claims one
    pinned = Report()
    k3opt.optimize(scaled_by_batch(), passes=["test-batch-is-two"], verify=True, input_shapes={"x": [2, 4]},
                   report=pinned)
    assert pinned.verification["status"] == "passed" and "second_sizes" not in pinned.verification
    assert not any("second size" in n or "one size" in n for n in pinned.notes)


def test_an_exact_model_is_verified_at_two_sizes():
    report = Report()
    k3opt.optimize(scaled_by_batch(), verify=True, report=report)
    v = report.verification
    assert v["status"] == "passed" and v["sizes"] == {"batch": 2} and v["second_sizes"] == {"batch": 3}
    assert "verified again at a second size: batch=3" in report.notes


def test_a_model_that_runs_at_one_size_only_is_verified_there_with_a_note():
    """The original runs only when the batch is 2 (Reshape to a constant [2, 4]): the second size is searched
    and not found; the first verification stands, and a note says the model was verified at one size."""
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("Relu", ["r"], ["y"])]
    model = make_model(nodes, [("x", TensorProto.FLOAT, ["batch", 4])], [("y", TensorProto.FLOAT, [2, 4])],
                       {"shape": np.array([2, 4], np.int64)})
    report = Report()
    k3opt.optimize(model, verify=True, report=report)
    assert report.verification["status"] == "passed" and report.verification["sizes"] == {"batch": 2}
    assert any(n.startswith("verified at one size only: onnxruntime ran the original at none of the") for n in
               report.notes)


def test_model_onnxruntime_cannot_run_is_skipped_with_a_warning():
    nodes = [helper.make_node("Identity", ["x"], ["a"]), helper.make_node("Foo", ["a"], ["y"], domain="acme")]
    model = make_model(nodes, [("x", TensorProto.FLOAT, [2])], [("y", TensorProto.FLOAT, [2])],
                       extra_opsets=[("acme", 1)])
    report = Report()
    k3opt.optimize(model, verify=True, report=report)
    assert report.verification["status"] == "skipped"
    assert "acme" in report.verification["reason"] or "Foo" in report.verification["reason"]
    assert report.warnings and report.warnings[0].startswith("verification skipped")


def test_model_too_big_for_memory_is_skipped(monkeypatch):
    monkeypatch.setattr(verify, "available_memory", lambda: 10)
    report = Report()
    k3opt.optimize(relu_chain(), verify=True, report=report)
    assert report.verification["status"] == "skipped" and "memory" in report.verification["reason"]


def test_optimized_model_that_does_not_run_fails(register):
    class Breaks(DropOneIdentity):
        name = "test-breaks"

        def run(self, graph, ctx):
            for node in graph.nodes:
                if node.op == "Relu" and not node.attrs:
                    node.attrs["bogus"] = 1
                    return 1
            return 0

    register(Breaks)
    with pytest.raises(VerificationError, match="cannot run the optimized model.*first diverging pass: test-breaks"):
        k3opt.optimize(relu_chain(), passes=["test-breaks"], verify=True)


def test_report_lists_each_output_when_there_are_several():
    a = np.ones(3, np.float32)
    report = Report(verification=verify.compare([a, a], [a, a * 2], ["a", "b"]))
    table = report.table()
    assert "verification: failed (2 outputs" in table
    # b: |2 - 1| = 1 against 1e-5 + 1e-4 * 1 allowed
    assert "  a: worst 0 of tolerance, max abs err 0\n" in table
    assert table.rstrip().endswith("b: worst 9.1e+03 of tolerance, max abs err 1  FAILED")


def test_tolerance_fraction_is_the_figure_the_decision_is_made_on():
    expected = np.array([0.0, 1e-30, 100.0], np.float32)
    near = expected + np.array([5e-6, 5e-6, 5e-3], np.float32)  # each half (or less) of its allowance
    result = verify.compare([expected], [near], ["y"], rtol=1e-4, atol=1e-5)
    out = result["outputs"][0]
    assert result["status"] == "passed" and out["tol_fraction"] == pytest.approx(0.5, rel=1e-2)
    assert out["max_rel"] > 1e20  # the old figure divides by ~0: kept in the JSON, never shown
    line = verify.summary_line(result)
    assert line.startswith("passed (1 output; worst 0.5 of tolerance, max abs err 0.005;") and "rel" not in line
    far = verify.compare([expected], [expected + np.float32(2e-5)], ["y"], rtol=1e-4, atol=1e-5)
    assert far["status"] == "failed" and far["outputs"][0]["tol_fraction"] == pytest.approx(2, rel=1e-2)
    assert verify.failure_detail(far).startswith("output 'y': worst 2 of tolerance")


def test_tolerance_fraction_with_zero_allowance_is_infinite_not_nan():
    a = np.zeros(2, np.float32)
    assert verify.compare([a], [a], ["y"], rtol=0, atol=0)["outputs"][0]["tol_fraction"] == 0
    bad = verify.compare([a], [a + 1], ["y"], rtol=0, atol=0)["outputs"][0]
    assert bad["tol_fraction"] == float("inf") and not bad["passed"]
