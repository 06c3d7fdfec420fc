"""fold-constants' numpy shortcut for data-moving nodes (``fold_numpy.numpy_values``) returns onnxruntime's exact values.

Identity and Unsqueeze of known numeric arrays (test_fold_numpy.py covers the other kernels) are computed in numpy rather
than in the onnxruntime session (its cost is per node); every case here is
evaluated both ways and must agree in dtype, shape and bytes, and whatever
onnxruntime refuses must still be refused.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto as T, helper, numpy_helper

from k3opt.passes.fold import _eval as fold_eval
from k3opt.passes.fold._eval import EvalError, run_ort
from k3opt.passes.fold._numpy import numpy_values


def _graph(nodes: list, inits: dict[str, np.ndarray], opset: int) -> gs.Graph:
    g = helper.make_graph(nodes, "g", [], [helper.make_value_info(nodes[-1].output[0], onnx.TypeProto())],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return gs.import_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]))


def _both(graph: gs.Graph, monkeypatch) -> tuple[dict, dict]:
    """run_ort's answer with the shortcut, and with onnxruntime alone."""
    outs = [t.name for n in graph.nodes for t in n.outputs]
    fast = run_ort(graph, graph.nodes, outs, {})
    with monkeypatch.context() as m:
        m.setattr(fold_eval, "numpy_values", lambda *a: {})
        slow = run_ort(graph, graph.nodes, outs, {})
    return fast, slow


def _assert_same(fast: dict, slow: dict) -> None:
    assert list(fast) == list(slow)
    for k in fast:
        a, b = np.asarray(fast[k]), np.asarray(slow[k])
        assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes()), k


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8, np.float16, np.float32, np.float64, np.bool_])
@pytest.mark.parametrize("axes", [[0], [-1], [0, 2], [-1, 0], [3, -4]])
@pytest.mark.parametrize("opset", [11, 13, 21])
def test_unsqueeze_and_identity_match_onnxruntime(dtype, axes, opset, monkeypatch):
    x = (np.arange(6) % 3).astype(dtype).reshape(2, 3)
    if opset < 13:
        unsq = helper.make_node("Unsqueeze", ["xi"], ["u"], axes=axes)
        inits = {"x": x}
    else:
        unsq = helper.make_node("Unsqueeze", ["xi", "axes"], ["u"])
        inits = {"x": x, "axes": np.array(axes, np.int64)}
    graph = _graph([helper.make_node("Identity", ["x"], ["xi"]), unsq], inits, opset)
    assert set(numpy_values(graph, graph.nodes, {})) == {"xi", "u"}
    _assert_same(*_both(graph, monkeypatch))


def test_scalar_and_computed_inputs(monkeypatch):
    """A scalar unsqueezes to [1]; an Unsqueeze of a value onnxruntime computes is left to it."""
    nodes = [
        helper.make_node("Unsqueeze", ["s", "a0"], ["s1"]),
        helper.make_node("Max", ["s1", "s1"], ["d"]),
        helper.make_node("Unsqueeze", ["d", "a0"], ["d1"]),
        helper.make_node("Unsqueeze", ["s1", "a0"], ["s2"]),
        helper.make_node("Concat", ["d1", "s2"], ["c"], axis=1),
    ]
    graph = _graph(nodes, {"s": np.array(4, np.int64), "a0": np.array([0], np.int64)}, 17)
    assert set(numpy_values(graph, graph.nodes, {})) == {"s1", "s2"}
    _assert_same(*_both(graph, monkeypatch))


@pytest.mark.parametrize("axes", [[0, 0], [3], [-4], [0, -3]], ids=["repeated", "too-big", "too-small", "same-axis"])
def test_bad_axes_still_fail(axes, monkeypatch):
    graph = _graph([helper.make_node("Unsqueeze", ["x", "axes"], ["u"])],
                   {"x": np.zeros((2,), np.float32), "axes": np.array(axes, np.int64)}, 17)
    assert numpy_values(graph, graph.nodes, {}) == {}
    with pytest.raises(EvalError):
        run_ort(graph, graph.nodes, ["u"], {})


@pytest.mark.parametrize("value", [
    np.array(["a", "bc"], dtype=object),
    np.array([1.5, 2], dtype=ml_dtypes.bfloat16),
    np.array([1, 2], dtype=np.int64).astype(">i8"),
], ids=["strings", "bfloat16", "big-endian"])
def test_odd_dtypes_are_left_to_onnxruntime(value, monkeypatch):
    graph = _graph([helper.make_node("Identity", ["x"], ["y"])], {"x": np.zeros(2, np.float32)}, 17)
    graph.nodes[0].inputs[0].values = value  # a constant holding an array of that dtype
    assert numpy_values(graph, graph.nodes, {}) == {}


def test_wrong_axes_form_for_the_opset_is_left_to_onnxruntime():
    """Opset 13 takes axes as an input: an ``axes`` attribute there is onnxruntime's to judge."""
    node = helper.make_node("Unsqueeze", ["x"], ["u"], axes=[0])
    graph = _graph([node], {"x": np.zeros((2,), np.float32)}, 13)
    assert numpy_values(graph, graph.nodes, {}) == {}


def test_movers_after_the_session(monkeypatch):
    """An Unsqueeze/Identity of what the session computes, read by no other node, is computed after it in numpy;
    one with bad axes goes back to onnxruntime, which refuses it as before."""
    nodes = [
        helper.make_node("Max", ["s", "s"], ["d"]),
        helper.make_node("Unsqueeze", ["d", "a0"], ["d1"]),
        helper.make_node("Identity", ["d"], ["di"]),
    ]
    inits = {"s": np.array([3, 4], np.int64), "a0": np.array([-1], np.int64)}
    graph = _graph(nodes, inits, 17)
    sessions = []
    real = fold_eval.sub_model
    monkeypatch.setattr(fold_eval, "sub_model", lambda g, ns, *a: sessions.append([n.op for n in ns]) or real(g, ns, *a))
    fast = run_ort(graph, graph.nodes, ["d1", "di"], {})
    assert sessions == [["Max"]]
    assert fast["d1"].tolist() == [[3], [4]] and fast["di"].tolist() == [3, 4]
    _assert_same(fast, {k: v for k, v in _both(graph, monkeypatch)[1].items() if k in fast})
    bad = _graph(nodes[:2], {**inits, "a0": np.array([0, 0], np.int64)}, 17)
    with pytest.raises(EvalError):
        run_ort(bad, bad.nodes, ["d1"], {})


def test_mover_read_inside_a_body_stays_in_the_session(monkeypatch):
    """A value an If branch reads from the outer scope must exist in the session that runs the If."""
    then = helper.make_graph([helper.make_node("Identity", ["u"], ["t_out"])], "then", [],
                             [helper.make_tensor_value_info("t_out", T.INT64, None)])
    other = helper.make_graph([helper.make_node("Identity", ["d"], ["e_out"])], "else", [],
                              [helper.make_tensor_value_info("e_out", T.INT64, None)])
    nodes = [
        helper.make_node("Max", ["s", "s"], ["d"]),
        helper.make_node("Unsqueeze", ["d", "a0"], ["u"]),
        helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other),
    ]
    inits = {"s": np.array(3, np.int64), "a0": np.array([0], np.int64), "c": np.array(True)}
    graph = _graph(nodes, inits, 17)
    fast, slow = _both(graph, monkeypatch)
    _assert_same(fast, slow)
    assert fast["y"].tolist() == [3]
