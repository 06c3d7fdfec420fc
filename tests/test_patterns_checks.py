"""Check helpers (k3opt.patterns.checks) on every way an exporter writes reduce axes and vector operands."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from k3opt.patterns import checks

F = TP.FLOAT


def _reduce_node(op="ReduceMean", opset=17, axes=None, as_input=False, x_shape=(2, 3, 4), const_axes=True, **attrs):
    inputs, inits, graph_inputs = ["x"], {}, [("x", F, list(x_shape) if x_shape else None)]
    if axes is not None and as_input:
        inputs.append("axes")
        if const_axes:
            inits["axes"] = np.array(axes, np.int64)
        else:
            graph_inputs.append(("axes", TP.INT64, [len(axes)]))
    elif axes is not None:
        attrs["axes"] = axes
    return gs.import_onnx(_model(op, inputs, attrs, graph_inputs, inits, opset)).nodes[0]


def _model(op, inputs, attrs, graph_inputs, inits, opset):
    """One reduce node; built without the checker, which rejects unknown output shapes we do not need."""
    graph = helper.make_graph([helper.make_node(op, inputs, ["y"], **attrs)], "t",
                              [helper.make_tensor_value_info(n, t, s) for n, t, s in graph_inputs],
                              [helper.make_tensor_value_info("y", F, None)],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("axes,as_input,opset", [
    ([-1], False, 17), ([2], False, 17), ([-1], True, 18), ([2], True, 18),
])
def test_last_axis_attribute_or_input_negative_or_positive(axes, as_input, opset):
    node = _reduce_node(axes=axes, as_input=as_input, opset=opset)
    assert checks.reduce_axes(node) == tuple(axes)
    assert checks.reduces_trailing_axes(node)


def test_reduce_sum_axes_input_opset13():
    assert checks.reduces_trailing_axes(_reduce_node("ReduceSum", opset=13, axes=[-1], as_input=True))


@pytest.mark.parametrize("axes,count,expected", [
    ([1], 1, False), ([0, 1, 2], 1, False), ([-2, -1], 2, True), ([2, 1], 2, True), ([-1, 1], 2, True),
    ([-1, -1], 2, False), ([5], 1, False),
])
def test_wrong_or_multiple_axes(axes, count, expected):
    assert checks.reduces_trailing_axes(_reduce_node(axes=axes), count) is expected


def test_unknown_rank_only_negative_axes_prove_trailing():
    assert checks.reduces_trailing_axes(_reduce_node(axes=[-1], x_shape=None))
    assert not checks.reduces_trailing_axes(_reduce_node(axes=[2], x_shape=None))


def test_non_constant_axes_input_is_unknown():
    node = _reduce_node(axes=[-1], as_input=True, opset=18, const_axes=False)
    assert checks.reduce_axes(node) is None and not checks.reduces_trailing_axes(node)


def test_absent_axes_reduce_all_or_nothing():
    node = _reduce_node(opset=18)
    assert checks.reduce_axes(node) == checks.ALL
    assert not checks.reduces_trailing_axes(node) and checks.reduces_trailing_axes(_reduce_node(opset=18, x_shape=(4,)))
    noop = _reduce_node(opset=18, noop_with_empty_axes=1)
    assert checks.reduce_axes(noop) == () and not checks.reduces_trailing_axes(noop)


def _t(name, shape, value=None):
    return gs.Constant(name, np.ones(shape, np.float32)) if value else gs.Variable(name, np.float32, shape)


@pytest.mark.parametrize("shape,ok", [((4,), True), ((1, 4), True), ((1, 1, 4), True), ((1, 1, 1, 4), False),
                                      ((3,), False), ((2, 4), False), ((), False)])
def test_vector_over_last_axis(shape, ok):
    x = _t("x", ("b", 5, 4))
    assert checks.vector_over_last_axis(_t("g", shape, value=True), x) is ok


def test_vector_over_unknown_last_dim_refused():
    assert not checks.vector_over_last_axis(_t("g", (4,), True), _t("x", ("b", "h")))


@pytest.mark.parametrize("shape,ok", [((4,), True), ((5, 1), True), ((1, 5, 4), True), ((2, 1, 1, 4), False),
                                      ((6, 4), False)])
def test_broadcasts_into(shape, ok):
    assert checks.broadcasts_into(_t("b", shape, True), _t("x", ("b", 5, 4))) is ok


def test_constant_helpers():
    c = gs.Constant("c", np.array([2.5], np.float32))
    assert checks.const_scalar(c) == 2.5 and checks.const_value(_t("v", (2,))) is None
    assert checks.is_float(c) and checks.last_dim(c) == 1 and checks.static_shape(_t("v", ("n",))) is None
    v = _t("v", (2,))
    gs.Node("Relu", inputs=[v], outputs=[_t("r", (2,))])
    assert checks.single_consumer(v) and not checks.single_consumer(c)
    gs.Node("Neg", inputs=[v], outputs=[_t("n", (2,))])
    assert not checks.single_consumer(v) and not checks.is_float(gs.Variable("i", np.int64))


@pytest.mark.parametrize("dtype,ok", [(TP.BFLOAT16, True), (TP.FLOAT8E4M3FN, True), (np.float16, True),
                                      (TP.INT4, False), (np.bool_, False), (None, False)])
def test_is_float_on_types_numpy_lacks(dtype, ok):
    """gs gives bfloat16/float8/int4 dtypes as ONNX enums: a check asking is_float must not raise on them."""
    assert checks.is_float(gs.Variable("v", dtype, (2,))) is ok
