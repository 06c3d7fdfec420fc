"""Never an output worse than the input: an opset conversion that would change what an op computes (onnx's
converter has no exact adapter, e.g. Scan 8 -> 9) keeps the model's opset, with a note, or (asked for an
opset) stops with one line naming the op. The written model loads and runs in onnxruntime."""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import k3opt
from k3opt.modelio import opset as opsets
from tests.test_bad_input import assert_one_line_error, invoke, snapshot


def scan8_sum() -> onnx.ModelProto:
    """onnx's conformance case test_scan_sum: an opset-8 Scan (batch axis first) summing x over its sequence."""
    def vi(name: str, shape: list[int]) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)

    body = helper.make_graph([helper.make_node("Add", ["sum_in", "next"], ["sum_out"]),
                              helper.make_node("Identity", ["sum_out"], ["scan_out"])], "scan_body",
                             [vi("sum_in", [2]), vi("next", [2])], [vi("sum_out", [2]), vi("scan_out", [2])])
    scan = helper.make_node("Scan", ["", "initial", "x"], ["y", "z"], body=body, num_scan_inputs=1)
    graph = helper.make_graph([scan], "test_scan_sum", [vi("initial", [1, 2]), vi("x", [1, 3, 2])],
                              [vi("y", [1, 2]), vi("z", [1, 3, 2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 8)])


SCAN_FEEDS = {"initial": np.array([[0, 0]], np.float32), "x": np.arange(1, 7, dtype=np.float32).reshape(1, 3, 2)}
SCAN_WANT = [np.array([[9, 12]], np.float32), np.array([[[1, 2], [4, 6], [9, 12]]], np.float32)]


def scan8_in_an_if() -> onnx.ModelProto:
    """The opset-8 Scan of test_scan_sum inside the then-branch of an If."""
    scan = scan8_sum()
    vi = {v.name: v for v in list(scan.graph.input) + list(scan.graph.output)}
    then = helper.make_graph(list(scan.graph.node), "then", [], [vi["y"]])
    other = helper.make_graph([helper.make_node("Identity", ["initial"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, [1, 2])])
    graph = helper.make_graph([helper.make_node("If", ["c"], ["out"], then_branch=then, else_branch=other)], "g",
                              [vi["initial"], vi["x"], helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 8)])


def ort_outputs(path_or_model, feeds: dict) -> list:
    data = path_or_model.SerializeToString() if isinstance(path_or_model, onnx.ModelProto) else str(path_or_model)
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)


def test_scan8_keeps_its_opset_and_the_written_model_runs(tmp_path):
    onnx.save(scan8_sum(), tmp_path / "scan.onnx")
    code, out, err = invoke(["optimize", str(tmp_path / "scan.onnx"), "-o", str(tmp_path / "o.onnx"), "--no-verify"])
    assert code == 0, err
    assert "opset kept at 8" in out and "op Scan has no exact conversion" in out
    assert opsets.model_opset(onnx.load(tmp_path / "o.onnx")) == 8
    for got, want in zip(ort_outputs(tmp_path / "o.onnx", SCAN_FEEDS), SCAN_WANT):  # it loads, and runs right
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("args", [["--opset", "17"], ["--target", "cann"]])
def test_scan8_asked_for_opset_17_is_one_line_naming_the_op(tmp_path, args):
    onnx.save(scan8_sum(), tmp_path / "scan.onnx")
    before = snapshot(tmp_path)
    code, out, err = invoke(["optimize", str(tmp_path / "scan.onnx"), "-q", *args])
    assert_one_line_error(code, out, err, 2, "cannot convert opset 8 to 17: op Scan has no exact conversion")
    assert snapshot(tmp_path) == before


def test_scan8_in_a_subgraph_keeps_the_opset_too():
    model = scan8_in_an_if()
    out, notes = opsets.convert(model)
    assert out is model and opsets.model_opset(out) == 8 and "op Scan" in notes[0]
    optimized = k3opt.optimize(model)
    feeds = {**SCAN_FEEDS, "c": np.array(True)}
    np.testing.assert_allclose(ort_outputs(optimized, feeds)[0], ort_outputs(model, feeds)[0])


def test_a_converter_that_changes_the_graphs_inputs_is_caught_without_the_list(monkeypatch):
    """The safety net under INEXACT_ADAPTERS: a converted graph whose inputs or outputs changed type, rank or
    a fixed dim was not converted exactly, whatever op did it."""
    monkeypatch.setattr(opsets, "INEXACT_ADAPTERS", {})
    model = scan8_sum()
    out, notes = opsets.convert(model)
    assert out is model
    assert "onnx's version converter changed 'initial' from FLOAT[1, 2] to FLOAT[2] (ops: Scan)" in notes[0]
    with pytest.raises(k3opt.K3optError, match="cannot convert opset 8 to 17"):
        opsets.convert(model, 17)


def test_other_conversions_still_happen():
    relu = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                                               [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                                               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])]),
                             opset_imports=[helper.make_opsetid("", 8)])
    out, notes = opsets.convert(relu)
    assert opsets.model_opset(out) == 17 and notes == ["opset converted from 8 to 17"]


@pytest.mark.slow
def test_every_conformance_case_below_17_keeps_its_outputs_at_the_default_opset():
    """The conformance cases (a), but at k3opt's default opset: those below 17 are raised to 17 (or kept)."""
    from tests import test_conformance as tc

    results = {}
    for case in tc.cases():
        if (tc._opset(case.model) or 17) < 17:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(tc, "_optimize", lambda model, passes=None: k3opt.optimize(model, passes=passes))
                results[case.name] = tc.check_optimize(case)
    failures = {k: v for k, v in results.items() if v.startswith("FAIL")}
    assert not failures, failures
    assert results["test_scan_sum"] == "same"
    assert sum(v == "same" for v in results.values()) > 400
