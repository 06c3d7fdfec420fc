"""Graphs onnxruntime runs but onnx's checker rejects are repaired in memory (with a note), and a fault
k3opt cannot repair is blamed on the input (exit 2), never on the output."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import TensorProto as T, helper as h, numpy_helper as nh

from k3opt import api, modelio
from k3opt.errors import InputError
from k3opt.cli import main


def _run(model: onnx.ModelProto, feeds: dict) -> list:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def contrib_layernorm(opset: int = 16, dtype: int = T.FLOAT, axis: int = -1, outputs: int = 1) -> onnx.ModelProto:
    x = h.make_tensor_value_info("x", dtype, [2, 4, 8])
    outs = [h.make_tensor_value_info("y", dtype, [2, 4, 8])]
    outs += [h.make_tensor_value_info(n, T.FLOAT, None) for n in ("mean", "inv")[: outputs - 1]]
    np_type = onnx.helper.tensor_dtype_to_np_dtype(dtype)
    g = nh.from_array(np.random.default_rng(0).random(8).astype(np_type), "g")
    b = nh.from_array(np.random.default_rng(1).random(8).astype(np_type), "b")
    n = h.make_node("LayerNormalization", ["x", "g", "b"], [o.name for o in outs], axis=axis, epsilon=1e-5)
    return h.make_model(h.make_graph([n], "ln", [x], outs, [g, b]), opset_imports=[h.make_opsetid("", opset)],
                        ir_version=7)


def untyped_value_info() -> onnx.ModelProto:
    x = h.make_tensor_value_info("x", T.FLOAT, [2, 4])
    y = h.make_tensor_value_info("y", T.FLOAT, [2, 4])
    g = h.make_graph([h.make_node("Relu", ["x"], ["t"]), h.make_node("Neg", ["t"], ["y"])], "g", [x], [y])
    vi = onnx.ValueInfoProto()
    vi.name = "t"
    g.value_info.append(vi)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 13)], ir_version=7)


def ir3_initializers() -> onnx.ModelProto:
    x = h.make_tensor_value_info("x", T.FLOAT, [2, 4])
    y = h.make_tensor_value_info("y", T.FLOAT, [2, 4])
    w = nh.from_array(np.arange(8, dtype=np.float32).reshape(2, 4), "w")
    g = h.make_graph([h.make_node("Add", ["x", "w"], ["y"])], "g", [x], [y], [w])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 8)], ir_version=3)


def sibling_names() -> onnx.ModelProto:
    c = h.make_tensor_value_info("c", T.BOOL, [])
    x = h.make_tensor_value_info("x", T.FLOAT, [2])
    y = h.make_tensor_value_info("y", T.FLOAT, [2])

    def branch(op: str) -> onnx.GraphProto:
        o = h.make_tensor_value_info("o", T.FLOAT, [2])
        return h.make_graph([h.make_node(op, ["x"], ["t"]), h.make_node("Neg", ["t"], ["o"])], op, [], [o])

    n = h.make_node("If", ["c"], ["y"], then_branch=branch("Relu"), else_branch=branch("Abs"))
    return h.make_model(h.make_graph([n], "g", [c, x], [y]), opset_imports=[h.make_opsetid("", 13)], ir_version=7)


def _checked(model: onnx.ModelProto) -> None:
    onnx.checker.check_model(model, full_check=True)


@pytest.mark.parametrize("opset,out_opset", [(16, None), (11, None), (16, 16), (12, 12)])
@pytest.mark.parametrize("dtype", [T.FLOAT, T.FLOAT16])
def test_contrib_layernorm_becomes_standard_and_equal(opset, out_opset, dtype):
    model = contrib_layernorm(opset, dtype)
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(model)
    report = api.Report()
    out = api.optimize(model, opset=out_opset, verify=True, report=report)
    _checked(out)
    np_type = onnx.helper.tensor_dtype_to_np_dtype(dtype)
    feeds = {"x": np.random.default_rng(2).standard_normal((2, 4, 8)).astype(np_type)}
    tol = 1e-5 if dtype == T.FLOAT else 2e-3
    np.testing.assert_allclose(_run(out, feeds)[0].astype(np.float32), _run(model, feeds)[0].astype(np.float32),
                               rtol=tol, atol=tol)
    assert any("LayerNormalization" in n and "repaired" in n for n in report.notes)
    if out_opset is None and dtype == T.FLOAT:  # raised to 17: folded back into the standard op
        assert [n.op_type for n in out.graph.node] == ["LayerNormalization"]


def test_contrib_layernorm_all_outputs_and_positive_axis():
    model = contrib_layernorm(16, T.FLOAT, axis=2, outputs=3)
    out = api.optimize(model, opset=16)
    _checked(out)
    feeds = {"x": np.random.default_rng(3).standard_normal((2, 4, 8)).astype(np.float32)}
    for got, want in zip(_run(out, feeds), _run(model, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_contrib_layernorm_of_unknown_rank_is_refused_with_a_reason():
    model = contrib_layernorm(16, T.FLOAT, axis=1)
    model.graph.input[0].type.tensor_type.ClearField("shape")
    with pytest.raises(InputError, match="unknown rank"):
        api.optimize(model)


@pytest.mark.parametrize("build,note", [(untyped_value_info, "value_info"), (ir3_initializers, "IR version"),
                                        (sibling_names, "renamed")])
def test_repaired_and_noted(build, note):
    model = build()
    report = api.Report()
    out = api.optimize(model, verify=True, report=report)
    _checked(out)
    assert report.verification["status"] == "passed"
    assert any(note in n and "repaired" in n for n in report.notes), report.notes


def test_sibling_names_unique_after_repair():
    model = sibling_names()
    assert modelio.repair(model)
    then, other = (a.g for a in model.graph.node[0].attribute)
    assert not {o for n in then.node for o in n.output} & {o for n in other.node for o in n.output}
    assert other.output[0].name == other.node[-1].output[0]


def test_valid_model_untouched():
    model = ir3_initializers()
    model.ir_version = 7
    before = model.SerializeToString()
    assert modelio.repair(model) == []
    assert model.SerializeToString() == before


def simplified_layernorm(opset: int = 17, dtype: int = T.FLOAT, outputs: int = 1) -> onnx.ModelProto:
    np_type = onnx.helper.tensor_dtype_to_np_dtype(dtype)
    x = h.make_tensor_value_info("x", dtype, [2, 4, 8])
    outs = [h.make_tensor_value_info("y", dtype, [2, 4, 8])]
    outs += [h.make_tensor_value_info("inv", T.FLOAT, None)] if outputs > 1 else []
    g = nh.from_array((1 + np.random.default_rng(0).random(8)).astype(np_type), "g")
    n = h.make_node("SimplifiedLayerNormalization", ["x", "g"], [o.name for o in outs], axis=-1, epsilon=1e-5)
    return h.make_model(h.make_graph([n], "ln", [x], outs, [g]), opset_imports=[h.make_opsetid("", opset)],
                        ir_version=8)


@pytest.mark.parametrize("opset", [13, 17, 18])
@pytest.mark.parametrize("dtype,outputs", [(T.FLOAT, 1), (T.FLOAT, 2), (T.FLOAT16, 1)])
def test_simplified_layernorm_becomes_standard_and_equal(opset, dtype, outputs):
    model = simplified_layernorm(opset, dtype, outputs)
    report = api.Report()
    out = api.optimize(model, opset=opset, report=report)
    _checked(out)
    feeds = {"x": np.random.default_rng(2).standard_normal((2, 4, 8)).astype(onnx.helper.tensor_dtype_to_np_dtype(dtype))}
    tol = 1e-5 if dtype == T.FLOAT else 2e-3
    for got, want in zip(_run(out, feeds), _run(model, feeds)):
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=tol, atol=tol)
    assert any("SimplifiedLayerNormalization" in n and "repaired" in n for n in report.notes)


def test_unrepairable_input_is_blamed_not_the_output(tmp_path, monkeypatch):
    """An op onnxruntime registers in the default domain and onnx does not, were it not repaired: exit 2, the
    input named (the repair is switched off to stand for a fault k3opt cannot repair)."""
    import importlib

    monkeypatch.setattr(importlib.import_module("k3opt.modelio.repair"), "_CONTRIB_NORMS", {})
    model = simplified_layernorm()
    src = tmp_path / "m.onnx"
    onnx.save(model, src)
    result = CliRunner().invoke(main, ["optimize", str(src), "-o", str(tmp_path / "o.onnx")])
    assert result.exit_code == 2, result.output
    assert "the input fails onnx's checker" in result.output and "optimized" not in result.output
    assert not (tmp_path / "o.onnx").exists()
