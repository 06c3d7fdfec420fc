"""--target cann for weight-only quantized models: NPUWeightQuantBatchMatmulV2, its numpy reference, and refusals."""
from __future__ import annotations

import collections
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import k3opt
from k3opt.errors import UsageError
from k3opt.quantize import quantize_file
from k3opt.targets.cann.atc_ops import ATC_PARSERS
from k3opt.targets.cann.npu_contract import pack_int4_words, unpack_int4_words
from k3opt.targets.cann.reference import ReferenceError, evaluator
from tests.test_quantize import _mlp
from tests.zoo import needs_torch, zoo_model

RNG = np.random.default_rng(1)


def _wqbmm_model(weight: np.ndarray, scale: np.ndarray, offset, group: int, m: int = 3) -> onnx.ModelProto:
    k = weight.shape[0]
    inits = [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(scale, "s")]
    ins = ["x", "w", "s"]
    if offset is not None:
        inits.append(numpy_helper.from_array(offset, "o"))
        ins.append("o")
    node = helper.make_node("NPUWeightQuantBatchMatmulV2", ins, ["y"], antiquant_group_size=group)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [m, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_int4_words_roundtrip():
    values = RNG.integers(-8, 8, (4, 16)).astype(np.int8)
    words = pack_int4_words(values)
    assert words.dtype == np.int32 and words.shape == (4, 2)
    np.testing.assert_array_equal(unpack_int4_words(words), values)
    # the layout: value j in bits 4j..4j+3
    assert (int(pack_int4_words(np.array([[1, 0, 0, 0, 0, 0, 0, 0]], np.int8))[0, 0]),
            int(pack_int4_words(np.array([[0, 1, 0, 0, 0, 0, 0, 0]], np.int8))[0, 0])) == (1, 16)


@pytest.mark.parametrize("bits,group", [(8, 0), (4, 32), (4, 0), (8, 64)])
def test_reference_op_is_the_documented_formula(bits, group):
    k, n = 128, 16
    q = RNG.integers(-8 if bits == 4 else -128, 8 if bits == 4 else 128, (k, n)).astype(np.int8)
    rows = -(-k // group) if group else 1
    scale = (RNG.random((rows, n)) * 0.1 + 0.01).astype(np.float16)
    offset = RNG.integers(-3, 3, (rows, n)).astype(np.float16)
    if not group:
        scale, offset = scale[0], offset[0]
    weight = pack_int4_words(q) if bits == 4 else q
    x = RNG.standard_normal((3, k)).astype(np.float16)
    got = evaluator(_wqbmm_model(weight, scale, offset, group)).run(None, {"x": x})[0]
    s = np.repeat(scale.astype(np.float32), group, axis=0) if group else scale.astype(np.float32)
    o = np.repeat(offset.astype(np.float32), group, axis=0) if group else offset.astype(np.float32)
    want = x.astype(np.float32) @ ((q.astype(np.float32) + o) * s)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("group,scale_rows,why", [(48, 3, "multiple of 32"), (128, 1, "multiple of 32 in"),
                                                  (32, 3, "ceil")])
def test_reference_op_refuses_outside_the_contract(group, scale_rows, why):
    k, n = 128, 8
    model = _wqbmm_model(np.zeros((k, n), np.int8), np.ones((scale_rows, n), np.float16), None, group)
    with pytest.raises(ReferenceError, match=why):
        evaluator(model).run(None, {"x": np.zeros((2, k), np.float16)})


def test_atc_registers_the_plugin_at_11_to_19():
    assert list(ATC_PARSERS["NPUWeightQuantBatchMatmulV2"]) == list(range(11, 20))


def _ops(path: Path) -> collections.Counter:
    return collections.Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)


@pytest.mark.parametrize("weights,group", [("int8", None), ("int4", 32), ("int4", 64)])
def test_quantize_target_cann_lowers_every_quantized_matmul(tmp_path, weights, group):
    src = _mlp(tmp_path / "m.onnx")
    report = quantize_file(src, tmp_path / "c.onnx", weights=weights, group_size=group, target="cann")
    ops = _ops(tmp_path / "c.onnx")
    assert ops["NPUWeightQuantBatchMatmulV2"] == 2 and ops["DequantizeLinear"] == 0
    assert any("2 of 2" in line for line in report.notes)
    model = onnx.load(str(tmp_path / "c.onnx"))
    assert [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [17]
    for node in model.graph.node:
        if node.op_type == "NPUWeightQuantBatchMatmulV2":
            inits = {t.name: t for t in model.graph.initializer}
            w = inits[node.input[1]]
            assert w.data_type == (TensorProto.INT32 if weights == "int4" else TensorProto.INT8)
            assert inits[node.input[2]].data_type == TensorProto.FLOAT16
            assert len(node.input) == 4  # asymmetric: antiquant_offset = -zero_point


def test_optimize_target_cann_lowers_an_int8_qdq_model_and_verifies_at_fp16(tmp_path):
    src = _mlp(tmp_path / "m.onnx")
    quantize_file(src, tmp_path / "q.onnx", weights="int8", measure=False)
    report = k3opt.optimize_file(tmp_path / "q.onnx", tmp_path / "c.onnx", target="cann", verify=True)
    assert _ops(tmp_path / "c.onnx")["NPUWeightQuantBatchMatmulV2"] == 2
    assert report.lowering_verification["status"] == "passed"
    assert report.lowering_verification["rtol"] == 1e-2


def test_optimize_target_cann_refuses_an_int4_qdq_model_in_one_line(tmp_path):
    src = _mlp(tmp_path / "m.onnx")
    quantize_file(src, tmp_path / "q.onnx", weights="int4", group_size=32, measure=False)
    run = subprocess.run([sys.executable, "-m", "k3opt", "optimize", str(tmp_path / "q.onnx"),
                          str(tmp_path / "c.onnx"), "--target", "cann"], capture_output=True, text=True)
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1
    assert "no form below opset 21" in run.stderr and "k3opt quantize --target cann" in run.stderr
    assert not (tmp_path / "c.onnx").exists()


def test_quantize_target_cann_refuses_a_broken_kernel_constraint(tmp_path):
    src = _mlp(tmp_path / "m.onnx", vocab=50)
    bad = _mlp(tmp_path / "b.onnx", n=132)  # n = 132: int4 is packed eight to an int32 along n
    with pytest.raises(UsageError, match="packed 8 to an int32"):
        quantize_file(bad, tmp_path / "c.onnx", weights="int4", group_size=32, target="cann")
    with pytest.raises(UsageError, match="Gather"):
        quantize_file(src, tmp_path / "c.onnx", weights="int8", embedding=True, target="cann")
    assert not (tmp_path / "c.onnx").exists()


@needs_torch
@pytest.mark.parametrize("name,exporter", [("llama", "torchscript"), pytest.param("llama", "dynamo", marks=pytest.mark.slow),
                                           pytest.param("qwen2", "torchscript", marks=pytest.mark.slow),
                                           ("qwen2", "dynamo")])
def test_zoo_one_npu_op_per_quantized_matmul(tmp_path, name, exporter):
    report = quantize_file(zoo_model(name, exporter), tmp_path / "c.onnx", weights="int4", group_size=32,
                           target="cann", tokens=0)
    ops = _ops(tmp_path / "c.onnx")
    assert ops["NPUWeightQuantBatchMatmulV2"] == len(report.layers) == 14 and ops["DequantizeLinear"] == 0
    assert any("verified" in line and "passed" in line for line in report.notes)


def test_check_reports_that_atc_takes_no_dequantize_linear(tmp_path):
    src = _mlp(tmp_path / "m.onnx")
    quantize_file(src, tmp_path / "q.onnx", weights="int8", measure=False)
    run = subprocess.run([sys.executable, "-m", "k3opt", "check", str(tmp_path / "q.onnx")], capture_output=True,
                         text=True)
    assert run.returncode != 0
    assert "DequantizeLinear x2" in run.stdout + run.stderr and "AMCT" in run.stdout + run.stderr


@pytest.mark.parametrize("attrs,scale_shape,opset", [({"axis": 1}, (16,), 17), ({"axis": 0}, (64,), 17), ({}, (), 17),
                                                     ({"axis": 0, "block_size": 32}, (2, 16), 21)])
def test_reference_dequantize_linear_matches_onnxruntime_at_every_opset(attrs, scale_shape, opset):
    import onnxruntime as ort

    q = RNG.integers(-8, 8, (64, 16)).astype(np.int8)
    s = (RNG.random(scale_shape) + 0.1).astype(np.float32)
    z = RNG.integers(-3, 3, scale_shape).astype(np.int8)
    graph = helper.make_graph([helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], **attrs)], "g", [],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(q, "q"), numpy_helper.from_array(np.asarray(s), "s"),
                               numpy_helper.from_array(np.asarray(z), "z")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {})[0]
    np.testing.assert_array_equal(evaluator(model).run(None, {})[0], want)


def test_a_dequantize_linear_outside_the_contract_is_kept_with_its_reason_and_verified(tmp_path):
    """Per-row (axis 0) scales are not the kernel's per-channel (axis 1) ones: kept, and the lowered model (which
    still holds it, at opset 17) verifies under the reference evaluator."""
    k, n = 64, 32
    rng = np.random.default_rng(5)  # weights of unit-scale outputs: fp16's tolerance is relative
    q = rng.integers(-127, 128, (k, n)).astype(np.int8)
    nodes = [helper.make_node("DequantizeLinear", ["q", "s0"], ["w0"], axis=0),
             helper.make_node("MatMul", ["x", "w0"], ["h"], name="rows"),
             helper.make_node("DequantizeLinear", ["q2", "s1"], ["w1"], axis=1),
             helper.make_node("MatMul", ["h", "w1"], ["y"], name="cols")]
    unit = 1 / (73 * np.sqrt(k))  # int8 values have a std of ~73
    inits = [numpy_helper.from_array(q, "q"), numpy_helper.from_array(np.full(k, unit, np.float32), "s0"),
             numpy_helper.from_array(rng.integers(-127, 128, (n, n)).astype(np.int8), "q2"),
             numpy_helper.from_array(np.full(n, 1 / (73 * np.sqrt(n)), np.float32), "s1")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", n])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "q.onnx"))
    report = k3opt.optimize_file(tmp_path / "q.onnx", tmp_path / "c.onnx", target="cann", verify=True)
    assert any("'rows' kept with its DequantizeLinear: per-axis scales over axis 0" in line for line in report.lowering)
    assert any("1 of 2" in line for line in report.lowering)
    assert report.lowering_verification["status"] == "passed", report.lowering_verification
    ops = _ops(tmp_path / "c.onnx")
    assert ops["DequantizeLinear"] == 1 and ops["NPUWeightQuantBatchMatmulV2"] == 1


def test_a_model_that_quantizes_its_activations_keeps_every_matmul_with_the_reason(tmp_path):
    """W8A8 QDQ (onnxruntime's quantize_static form): activations through QuantizeLinear/DequantizeLinear around
    each MatMul. The weight-only kernel's float16 activations would move values across the next QuantizeLinear's
    rounding (a whole quantization step): every MatMul is kept, and the model verifies."""
    k, n, rows = 128, 64, 16
    rng = np.random.default_rng(7)
    nodes = [helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "sw"], ["w"], axis=1),
             helper.make_node("MatMul", ["xd", "w"], ["h"], name="proj"),
             helper.make_node("QuantizeLinear", ["h", "sh", "zh"], ["hq"]),
             helper.make_node("DequantizeLinear", ["hq", "sh", "zh"], ["y"])]
    inits = [numpy_helper.from_array(np.float32(4 / 127), "sx"), numpy_helper.from_array(np.int8(0), "zx"),
             numpy_helper.from_array(rng.integers(-127, 128, (k, n)).astype(np.int8), "wq"),
             numpy_helper.from_array(np.full(n, 1 / (73 * np.sqrt(k)), np.float32), "sw"),
             numpy_helper.from_array(np.float32(2e-3), "sh"), numpy_helper.from_array(np.int8(0), "zh")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, n])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "q.onnx"))
    feeds = {"x": rng.standard_normal((rows, k)).astype(np.float32)}
    report = k3opt.optimize_file(tmp_path / "q.onnx", tmp_path / "c.onnx", target="cann", verify=True,
                                 input_data=feeds)
    assert report.lowering_verification["status"] == "passed", report.lowering_verification
    assert any("'proj' kept with its DequantizeLinear: the model quantizes its activations too "
               "(QuantizeLinear of 'x')" in line for line in report.lowering), report.lowering
    assert "NPUWeightQuantBatchMatmulV2" not in _ops(tmp_path / "c.onnx")
