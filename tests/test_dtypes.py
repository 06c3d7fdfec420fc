"""k3opt.graph.dtypes: the one ONNX element type <-> numpy dtype mapping, over every element type."""
import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper

import k3opt
from k3opt.graph import dtypes
from k3opt.passes.fold._eval import run_model
from k3opt.pipeline.shapes import export_for_inference
from k3opt.report import Report

ELEM_TYPES = [v for v in T.DataType.values() if v != T.UNDEFINED]


@pytest.mark.parametrize("elem", ELEM_TYPES, ids=[T.DataType.Name(v) for v in ELEM_TYPES])
def test_every_element_type_round_trips_and_agrees_with_onnx(elem):
    dtype = dtypes.numpy_dtype(elem)
    assert isinstance(dtype, np.dtype)
    assert dtype == np.dtype(helper.tensor_dtype_to_np_dtype(elem))
    assert dtypes.onnx_type(dtype) == elem == helper.np_dtype_to_tensor_dtype(dtype)
    assert dtypes.onnx_type(dtype.type) == elem  # the scalar type, as ml_dtypes and numpy name it
    assert dtypes.onnx_type(elem) == elem and dtypes.onnx_type(np.int32(elem)) == elem  # an ONNX enum as gs keeps it


def test_float8e4m3fnuz_is_not_float8e4m3fn():
    """gs's ``dtype_to_onnx`` answers FLOAT8E4M3FN here; k3opt's mapping must not."""
    assert dtypes.onnx_type(np.dtype(ml_dtypes.float8_e4m3fnuz)) == T.FLOAT8E4M3FNUZ
    assert dtypes.numpy_dtype(T.FLOAT8E4M3FNUZ) == np.dtype(ml_dtypes.float8_e4m3fnuz)


@pytest.mark.parametrize("dtype", [None, T.UNDEFINED, 9999, "not a dtype", np.dtype([("a", np.int8)])])
def test_no_onnx_type_is_none(dtype):
    assert dtypes.onnx_type(dtype) is None


def test_undefined_has_no_numpy_dtype():
    with pytest.raises(KeyError):
        dtypes.numpy_dtype(T.UNDEFINED)


@pytest.mark.parametrize("elem,bits", [(T.FLOAT, 32), (T.BFLOAT16, 16), (T.FLOAT8E4M3FNUZ, 8), (T.BOOL, 8),
                                       (T.INT4, 4), (T.UINT4, 4), (T.FLOAT4E2M1, 4), (T.STRING, 0),
                                       (T.COMPLEX128, 128)])
def test_bits_per_element(elem, bits):
    assert dtypes.bits(elem) == bits


@pytest.mark.parametrize("src", [T.FLOAT, T.FLOAT16])
def test_a_cast_to_float8e4m3fnuz_keeps_its_type_through_optimize(src):
    """The shape refresh types the Cast's output with ml_dtypes' float8_e4m3fnuz; the export must write
    FLOAT8E4M3FNUZ back (it wrote FLOAT8E4M3FN, and onnxruntime refused the model)."""
    graph = helper.make_graph([helper.make_node("Cast", ["x"], ["y"], to=T.FLOAT8E4M3FNUZ)], "g",
                              [helper.make_tensor_value_info("x", src, [2, 3])],
                              [helper.make_tensor_value_info("y", T.FLOAT8E4M3FNUZ, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    out = k3opt.optimize(model, opset=19)
    assert out.graph.output[0].type.tensor_type.elem_type == T.FLOAT8E4M3FNUZ
    assert all(vi.type.tensor_type.elem_type == T.FLOAT8E4M3FNUZ for vi in out.graph.value_info if vi.name == "y")
    x = np.float32([[0.5, -1.25, 3], [100, -0.001, 7]]).astype(dtypes.numpy_dtype(src))
    got, want = run_model(out, {"x": x})[0], run_model(model, {"x": x})[0]  # onnxruntime, float8 read back exactly
    assert got.dtype == want.dtype == np.dtype(ml_dtypes.float8_e4m3fnuz)
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))


def test_float8e4m3fnuz_keeps_its_type_through_gs_own_export():
    """A model with a local function is exported by gs itself: its float8e4m3fnuz types are put right too."""
    twice = helper.make_function("local", "Twice", ["a"], ["b"], [helper.make_node("Add", ["a", "a"], ["b"])],
                                 [helper.make_opsetid("", 19)])
    graph = helper.make_graph([helper.make_node("Twice", ["x"], ["t"], domain="local"),
                               helper.make_node("Cast", ["t"], ["c"], to=T.FLOAT8E4M3FNUZ),
                               helper.make_node("Cast", ["c"], ["y"], to=T.FLOAT)], "g",
                              [helper.make_tensor_value_info("x", T.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", T.FLOAT, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19), helper.make_opsetid("local", 1)],
                              functions=[twice])
    model.ir_version = 9
    out = k3opt.optimize(model, opset=19)
    assert len(out.functions) == 1
    assert [vi.type.tensor_type.elem_type for vi in out.graph.value_info if vi.name == "c"] == [T.FLOAT8E4M3FNUZ]
    x = np.float32([[0.5, -1.25, 3], [100, -0.001, 7]])
    assert np.array_equal(run_model(out, {"x": x})[0], run_model(model, {"x": x})[0])


def test_a_float8e4m3fnuz_graph_input_keeps_its_type_in_the_shape_refresh():
    """The refresh after folding exports the graph for onnx's inference: its inputs and outputs are typed
    by k3opt's mapping (gs's typed this input FLOAT8E4M3FN, inference then refused the graph and every pass
    needing shapes was declined)."""
    nodes = [helper.make_node("Cast", ["x"], ["xf"], to=T.FLOAT), helper.make_node("Identity", ["x"], ["x2"]),
             helper.make_node("Constant", [], ["one"], value=helper.make_tensor("v", T.FLOAT, [1], [1.0])),
             helper.make_node("Add", ["xf", "one"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT8E4M3FNUZ, [2])],
                              [helper.make_tensor_value_info("y", T.FLOAT, [2]),
                               helper.make_tensor_value_info("x2", T.FLOAT8E4M3FNUZ, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    report = Report()
    out = k3opt.optimize(model, opset=19, report=report)
    assert not [n for n in report.notes if "shape inference failed" in n]
    assert [vi.type.tensor_type.elem_type for vi in out.graph.input] == [T.FLOAT8E4M3FNUZ]
    light = onnx.load_from_string(export_for_inference(k3opt.modelio.import_graph(model)).data)
    assert [vi.type.tensor_type.elem_type for vi in [*light.graph.input, *light.graph.output]] == \
        [T.FLOAT8E4M3FNUZ, T.FLOAT, T.FLOAT8E4M3FNUZ]
    ort.InferenceSession(  # it takes no float8 array as a feed: the output's types are checked by loading it
        out.SerializeToString(), providers=["CPUExecutionProvider"])
