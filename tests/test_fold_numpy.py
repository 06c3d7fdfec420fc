"""fold-constants' numpy kernels (``k3opt.passes.fold._numpy``) give onnxruntime's values bit for bit, or decline.

Every case runs the node both ways: when the kernel answers, onnxruntime
must give the same dtype, shape and bytes; when it declines, the node goes
to onnxruntime as before. Cases the kernels exist for (shape arithmetic)
must be answered, so the speed-up itself is tested too.
"""
from __future__ import annotations

import itertools
from typing import Optional

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto as T, helper, numpy_helper

from k3opt.passes.fold import _eval as fold_eval
from k3opt.passes.fold._eval import EvalError, run_model
from k3opt.passes.fold._numpy import numpy_values


def _model(op: str, inputs: list[np.ndarray], opset: int, **attrs) -> onnx.ModelProto:
    names = [f"i{k}" for k in range(len(inputs))]
    node = helper.make_node(op, names, ["y"], **attrs)
    g = helper.make_graph([node], "g", [], [helper.make_value_info("y", onnx.TypeProto())],
                          [numpy_helper.from_array(v, n) for n, v in zip(names, inputs)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _both(op: str, inputs: list[np.ndarray], opset: int = 17, **attrs) -> tuple[Optional[np.ndarray], object]:
    """(the kernel's answer or None, onnxruntime's answer or the exception it raised)."""
    model = _model(op, inputs, opset, **attrs)
    graph = gs.import_onnx(model)
    fast = numpy_values(graph, graph.nodes, {}).get("y")
    try:
        slow = run_model(model)[0]
    except Exception as exc:  # noqa: BLE001 -- refusals are compared too
        slow = exc
    return fast, slow


def _check(op: str, inputs: list[np.ndarray], opset: int = 17, must: bool = False, **attrs) -> Optional[np.ndarray]:
    fast, slow = _both(op, inputs, opset, **attrs)
    if must:
        assert fast is not None, f"{op} declined {[(i.dtype, i.shape) for i in inputs]}"
    if fast is not None:
        assert not isinstance(slow, Exception), f"numpy computed what onnxruntime refuses: {slow}"
        slow = np.asarray(slow)
        assert (fast.dtype, fast.shape) == (slow.dtype, slow.shape)
        assert fast.tobytes() == slow.tobytes(), (fast, slow)
    return fast


INTS = [np.array(v) for v in ([7, -7, 6, -6, 0, 1, -1, 12345], [[3], [-4]], 5, -3)]
FLOATS = [np.array(v) for v in ([1.5, -2.25, 0.1, 3e38, -0.0, 1e-40, np.inf], [[0.3], [-7.0]], 2.5)]


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.float32, np.float64])
def test_arithmetic_matches_onnxruntime(op, dtype):
    ints = np.dtype(dtype).kind == "i"
    numpy_op = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide}[op]
    for a, b in itertools.product(INTS if ints else FLOATS, repeat=2):
        a, b = a.astype(dtype), b.astype(dtype)
        if ints and op == "Div" and (b == 0).any():
            continue
        with np.errstate(all="ignore"):
            nan = not ints and np.isnan(numpy_op(a, b)).any()  # inf - inf, 0 * inf: declined
        assert (_check(op, [a, b], must=not nan) is None) == nan


def test_integer_division_truncates_toward_zero():
    got = _check("Div", [np.array([7, -7, 7, -7, 6], np.int64), np.array([2, 2, -2, -2, -3], np.int64)], must=True)
    assert got.tolist() == [3, -3, -3, 3, -2]


@pytest.mark.parametrize("a, b", [
    (np.array([1, 2], np.int64), np.array([0, 1], np.int64)),  # division by zero
    (np.array([2**40], np.int64), np.array([2**40], np.int64)),  # could overflow
    (np.array([2**31], np.int64), np.array([1], np.int64)),
    (np.array([1], np.int8), np.array([2], np.int8)),  # int8/int16: onnxruntime's
    (np.array([300], np.int32), np.array([2**15], np.int32)),
    (np.array([0.0], np.float32), np.array([0.0], np.float32)),  # NaN result
    (np.array([1], np.uint8), np.array([2], np.uint8)),  # unsigned: onnxruntime's
    (np.array([1.0], np.float16), np.array([2.0], np.float16)),  # float16: onnxruntime's
    (np.array([1], np.int64), np.array([2], np.int32)),  # mixed types: invalid
    (np.zeros((2, 3), np.float32), np.zeros((4,), np.float32)),  # no broadcast
])
def test_arithmetic_declines_when_not_sure(a, b):
    fast, _ = _both("Div", [a, b])
    assert fast is None


SOURCES = {
    np.bool_: [True, False],
    np.int8: [-128, 127, 0, -3],
    np.int32: [-(2**31), 2**31 - 1, 2**24 + 1, -5, 0, 300],
    np.int64: [-(2**63), 2**63 - 1, 2**53 + 1, 2**24, -5, 0, 255, 256],
    np.uint8: [0, 255, 7],
    np.uint64: [0, 2**64 - 1, 2**53, 9],
    np.float16: [0.5, -2.5, 65504, -0.0, 1.0],
    np.float32: [0.5, -2.5, 127.9, -128.0, 255.5, 3e38, -0.0, 1e-45, 2**31, np.inf],
    np.float64: [0.5, -2.5, 1e300, 1e-320, 2.0**63, -(2.0**63), 4e9, 3.4028234663852886e38],
}
TARGETS = [T.BOOL, T.INT8, T.INT32, T.INT64, T.UINT8, T.UINT64, T.FLOAT, T.DOUBLE]


@pytest.mark.parametrize("source", list(SOURCES), ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("to", TARGETS, ids=lambda t: T.DataType.Name(t))
def test_cast_matches_onnxruntime(source, to):
    """Each value alone (a value out of range declines the whole tensor) and all together."""
    values = SOURCES[source]
    for v in [[x] for x in values] + [values]:
        _check("Cast", [np.array(v, dtype=source)], to=to)


@pytest.mark.parametrize("x, to", [
    (np.array([3, -2, 0], np.int64), T.INT32),
    (np.array([3, -2, 0], np.int64), T.FLOAT),
    (np.array([1.75, -2.5], np.float32), T.INT64),
    (np.array([1.75, -2.5], np.float64), T.FLOAT),
    (np.array([True, False]), T.INT64),
    (np.array(7, np.int32), T.INT64),
])
def test_cast_of_ordinary_values_is_computed(x, to):
    _check("Cast", [x], to=to, must=True)


@pytest.mark.parametrize("x, to", [
    (np.array([np.nan], np.float32), T.INT32),
    (np.array([np.nan], np.float32), T.BOOL),
    (np.array([300], np.int64), T.UINT8),
    (np.array([2**24 + 1], np.int64), T.FLOAT),
    (np.array([1e39], np.float64), T.FLOAT),
    (np.array([1.0], np.float32), T.FLOAT16),
    (np.array([1.0], np.float32), T.STRING),
])
def test_cast_declines_inexact_values_and_odd_targets(x, to):
    fast, _ = _both("Cast", [x], to=to)
    assert fast is None


@pytest.mark.parametrize("value", [None, np.array([1.5], np.float32), np.array([-3], np.int64),
                                   np.array([True]), np.array([2.0], np.float16)])
@pytest.mark.parametrize("shape", [[2, 3], [0], [], [4]])
def test_constant_of_shape_matches_onnxruntime(value, shape):
    attrs = {} if value is None else {"value": numpy_helper.from_array(value)}
    _check("ConstantOfShape", [np.array(shape, np.int64)], must=True, **attrs)


def test_constant_of_shape_declines_negative_dims():
    fast, slow = _both("ConstantOfShape", [np.array([2, -1], np.int64)])
    assert fast is None


@pytest.mark.parametrize("shape, allowzero", [
    ([-1], 0), ([3, -1], 0), ([0, -1], 0), ([2, 0, 3], 0), ([6], 0), ([2, 3, 1, 1], 0), ([1, 6], 1),
])
def test_reshape_matches_onnxruntime(shape, allowzero):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    if 0 in shape and len(shape) > 2:
        x = np.zeros((2, 0, 3), np.int64)
    _check("Reshape", [x, np.array(shape, np.int64)], 14, must=True, allowzero=allowzero)


@pytest.mark.parametrize("shape, allowzero", [([4, -1], 0), ([-1, -1], 0), ([0, 6], 1), ([0, -1], 1), ([7], 0),
                                              ([-2, 3], 0)])
def test_reshape_refusals_stay_refusals(shape, allowzero):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    fast, slow = _both("Reshape", [x, np.array(shape, np.int64)], 14, allowzero=allowzero)
    assert fast is None


@pytest.mark.parametrize("opset, axes", [(11, [0]), (11, None), (13, [-1]), (13, None), (13, [0, 2])])
def test_squeeze_matches_onnxruntime(opset, axes):
    x = np.arange(3, dtype=np.int64).reshape(1, 3, 1)
    if opset < 13:
        fast = _check("Squeeze", [x], opset, must=True, **({} if axes is None else {"axes": axes}))
    else:
        inputs = [x] if axes is None else [x, np.array(axes, np.int64)]
        fast = _check("Squeeze", inputs, opset, must=True)
    assert fast.ndim < 3


def test_squeeze_with_empty_axes_is_left_to_onnxruntime():
    """Given but empty axes (an empty input, or an empty attribute before opset 13): the runtime's to read."""
    x = np.zeros((1, 3, 1), np.float32)
    fast, _ = _both("Squeeze", [x, np.zeros((0,), np.int64)], 13)
    assert fast is None
    graph = gs.import_onnx(_model("Squeeze", [x], 11, axes=[0]))
    graph.nodes[0].attrs["axes"] = []
    assert numpy_values(graph, graph.nodes, {}) == {}


def test_squeeze_of_a_dim_above_one_is_refused():
    fast, slow = _both("Squeeze", [np.zeros((2, 1), np.float32), np.array([0], np.int64)])
    assert fast is None and isinstance(slow, Exception)


@pytest.mark.parametrize("perm", [None, [1, 0, 2], [2, 0, 1]])
def test_transpose_matches_onnxruntime(perm):
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    _check("Transpose", [x], must=True, **({} if perm is None else {"perm": perm}))


def test_transpose_with_a_bad_perm_is_refused():
    fast, slow = _both("Transpose", [np.zeros((2, 3), np.float32)], perm=[0, 0])
    assert fast is None and isinstance(slow, Exception)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat_matches_onnxruntime(axis):
    a, b = np.arange(6, dtype=np.int64).reshape(2, 3), np.arange(6, 12, dtype=np.int64).reshape(2, 3)
    _check("Concat", [a, b], must=True, axis=axis)


@pytest.mark.parametrize("inputs", [
    [np.zeros((2, 3), np.int64), np.zeros((3, 3), np.int64)],
    [np.zeros((2,), np.int64), np.zeros((2,), np.int32)],
    [np.zeros((), np.int64), np.zeros((), np.int64)],
])
def test_concat_refusals_stay_refusals(inputs):
    fast, slow = _both("Concat", inputs, axis=1 if inputs[0].ndim == 2 else 0)
    assert fast is None


def test_shape_arithmetic_folds_without_a_session(monkeypatch):
    """TorchScript's head-size arithmetic (the 64-layer Llama's ~770 such nodes) never reaches onnxruntime."""
    def no_session(data):
        raise AssertionError("an onnxruntime session was built")

    monkeypatch.setattr(fold_eval, "_session", no_session)
    nodes = [
        helper.make_node("Div", ["hidden", "heads"], ["head"]),
        helper.make_node("Mul", ["head", "two"], ["h2"]),
        helper.make_node("Cast", ["h2"], ["h2i"], to=T.INT64),
        helper.make_node("Unsqueeze", ["h2i", "zero"], ["h2v"]),
        helper.make_node("ConstantOfShape", ["h2v"], ["ones"], value=numpy_helper.from_array(np.ones(1, np.int64))),
        helper.make_node("Mul", ["ones", "neg"], ["negs"]),
    ]
    inits = {"hidden": np.array(64, np.int64), "heads": np.array(4, np.int64), "two": np.array(2, np.int64),
             "zero": np.array([0], np.int64), "neg": np.array(-1, np.int64)}
    g = helper.make_graph(nodes, "g", [], [helper.make_value_info("negs", onnx.TypeProto())],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    graph = gs.import_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    values = fold_eval.run_ort(graph, graph.nodes, ["negs"], {})
    assert values["negs"].tolist() == [-1] * 32


def test_a_declined_node_still_reaches_onnxruntime(monkeypatch):
    """An integer division by zero is onnxruntime's to evaluate (or refuse), as before the kernels."""
    built = []
    real = fold_eval._session
    monkeypatch.setattr(fold_eval, "_session", lambda data: built.append(1) or real(data))
    g = gs.import_onnx(_model("Div", [np.array([1], np.int64), np.array([0], np.int64)], 17))
    try:
        fold_eval.run_ort(g, g.nodes, ["y"], {})
    except EvalError:
        pass  # onnxruntime may refuse it: the node is then left unfolded
    assert built


def test_float_errors_are_silent_for_every_node(recwarn):
    """Overflow and division by zero warn nowhere, in any node of a run (one error state covers them all)."""
    g = helper.make_graph(
        [helper.make_node("Div", ["a", "z"], ["d"]), helper.make_node("Mul", ["d", "a"], ["y"])], "g", [],
        [helper.make_tensor_value_info("y", T.FLOAT, [2])],
        [numpy_helper.from_array(np.float32([3e38, -1.0]), "a"), numpy_helper.from_array(np.float32([0.0, 0.0]), "z")])
    graph = gs.import_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    with np.errstate(all="raise"):  # the caller's state is not what the kernels run under
        out = numpy_values(graph, graph.nodes, {})
        assert np.geterr()["divide"] == "raise"
    assert out["y"].tolist() == [np.inf, np.inf] and not [w for w in recwarn if "overflow" in str(w.message)]
