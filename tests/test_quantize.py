"""k3opt quantize: the RTN core, the DequantizeLinear rewrite, the options, bad input, and the pipeline keeping
quantized weights quantized."""
from __future__ import annotations

import collections
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import k3opt
from k3opt.errors import InputError, UsageError
from k3opt.quantize import quantize_file, rtn, scheme_for
from tests.zoo import needs_torch, zoo_model

RNG = np.random.default_rng(0)


def _quant(w: np.ndarray, scheme: rtn.Scheme) -> tuple[rtn.Quantized, np.ndarray]:
    blocks = {}
    q = rtn.quantize(lambda a, b: w[a:b], *w.shape, scheme, lambda a, b, v: blocks.__setitem__(a, v))
    values = np.concatenate([blocks[a] for a in sorted(blocks)])
    return q, values


@pytest.mark.parametrize("bits,group,symmetric", [(4, 32, False), (4, 128, True), (8, 0, False), (8, 0, True),
                                                  (8, 64, False)])
def test_rtn_reconstructs_within_half_a_step(bits, group, symmetric):
    w = RNG.standard_normal((256, 48)).astype(np.float32)
    scheme = rtn.Scheme(bits, group, symmetric, clip=False)
    q, values = _quant(w, scheme)
    assert values.min() >= scheme.qmin and values.max() <= scheme.qmax
    back = rtn.dequantize(values, q.scale, q.zero_point, group)
    step = np.repeat(q.scale, group, axis=0) if group else q.scale
    assert np.all(np.abs(back - w) <= step / 2 + 1e-6)  # no clipping: every weight within half a step
    assert q.rel_error == pytest.approx(np.linalg.norm(back - w) / np.linalg.norm(w), rel=1e-4)


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 0)])
def test_clip_search_never_worse_than_plain_rtn(bits, group):
    w = RNG.standard_t(3, (256, 64)).astype(np.float32)  # heavy tails: clipping pays
    plain, _ = _quant(w, rtn.Scheme(bits, group, clip=False))
    searched, _ = _quant(w, rtn.Scheme(bits, group, clip=True))
    assert searched.rel_error <= plain.rel_error
    if bits == 4:  # 15 steps: a clipped outlier buys the rest of the group resolution
        assert searched.rel_error < plain.rel_error


def test_streamed_blocks_equal_one_block(monkeypatch):
    w = RNG.standard_normal((512, 40)).astype(np.float32)
    for scheme in (rtn.Scheme(4, 32), rtn.Scheme(8, 0)):
        whole, v1 = _quant(w, scheme)
        monkeypatch.setattr(rtn, "BLOCK_ELEMENTS", 64 * 40)
        assert len(list(rtn.row_blocks(512, 40, scheme.group))) > 1
        parts, v2 = _quant(w, scheme)
        monkeypatch.undo()
        np.testing.assert_array_equal(v1, v2)
        np.testing.assert_array_equal(whole.scale, parts.scale)


def test_int4_packing_roundtrip_and_onnx_order():
    values = RNG.integers(-8, 8, 37).astype(np.int8)
    packed = rtn.pack_int4(values)
    np.testing.assert_array_equal(rtn.unpack_int4(packed, 37), values)
    t = helper.make_tensor("t", TensorProto.INT4, [37], values.tolist())  # onnx's own packing
    assert numpy_helper.to_array(t).astype(np.int8).tolist() == values.tolist()
    t2 = TensorProto(name="t", data_type=TensorProto.INT4, dims=[37], raw_data=packed)
    assert numpy_helper.to_array(t2).astype(np.int8).tolist() == values.tolist()


# ----------------------------------------------------------------------------- models


def _mlp(path: Path, *, k: int = 128, n: int = 128, vocab: int = 50, opset: int = 17, external: bool = False) -> Path:
    """ids -> Gather(E) -> MatMul(W1) -> Relu -> Gemm(W2, transB, bias) -> MatMul(W3 = lm_head) -> logits."""
    e = RNG.standard_normal((vocab, k)).astype(np.float32)
    w1 = RNG.standard_normal((k, n)).astype(np.float32) / np.sqrt(k)
    w2 = RNG.standard_normal((k, n)).astype(np.float32) / np.sqrt(n)  # (n_out=k, k_in=n) read transposed
    b2 = RNG.standard_normal(k).astype(np.float32)
    w3 = RNG.standard_normal((k, vocab)).astype(np.float32) / np.sqrt(k)
    nodes = [helper.make_node("Gather", ["E", "ids"], ["h0"]),
             helper.make_node("Reshape", ["h0", "shape"], ["h"]),
             helper.make_node("MatMul", ["h", "W1"], ["a"]), helper.make_node("Relu", ["a"], ["r"]),
             helper.make_node("Gemm", ["r", "W2", "B2"], ["g"], transB=1),
             helper.make_node("MatMul", ["g", "W3"], ["logits"])]
    inits = [numpy_helper.from_array(x.astype(np.float32) if x.dtype.kind == "f" else x, name) for x, name in ((e, "E"), (w1, "W1"), (w2, "W2"), (b2, "B2"),
                                                               (w3, "W3"), (np.array([-1, k]), "shape"))]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["s"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["s", vocab])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    if external:
        onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data")
    else:
        onnx.save(model, str(path))
    return path


def _run(path: Path, ids: np.ndarray, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL) -> np.ndarray:
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, {"ids": ids})[0]


def _ops(path: Path) -> collections.Counter:
    return collections.Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)


@pytest.mark.parametrize("weights,group", [("int4", 32), ("int4", 128), ("int8", None)])
def test_quantized_model_runs_close_and_keeps_lm_head(tmp_path, weights, group):
    src = _mlp(tmp_path / "m.onnx")
    report = quantize_file(src, tmp_path / "q.onnx", weights=weights, group_size=group)
    ids = np.arange(10, dtype=np.int64)
    ref, got = _run(src, ids), _run(tmp_path / "q.onnx", ids)
    assert np.abs(got - ref).max() < (0.3 if weights == "int4" else 0.03) * np.abs(ref).max()
    assert set(report.layers) == {"W1", "W2"}
    assert "lm_head" in report.kept["W3"] and "embedding" in report.kept["E"]
    ops = _ops(tmp_path / "q.onnx")
    assert ops["DequantizeLinear"] == 2 and ops["Gemm"] == 0 and ops["MatMul"] == 3
    model = onnx.load(str(tmp_path / "q.onnx"))
    dq = {n.input[0]: n for n in model.graph.node if n.op_type == "DequantizeLinear"}
    inits = {t.name: t for t in model.graph.initializer}
    for node in dq.values():
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert inits[node.input[0]].data_type == (TensorProto.INT4 if weights == "int4" else TensorProto.INT8)
        if group:
            assert attrs == {"axis": 0, "block_size": group}
            assert list(inits[node.input[1]].dims) == [inits[node.input[0]].dims[0] // group,
                                                        inits[node.input[0]].dims[1]]
        else:
            assert attrs == {"axis": 1}
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    assert opset == (21 if weights == "int4" else 17)
    assert report.accuracy["logits"]["rel"] < 0.2
    assert "tokens" in report.accuracy


def test_lm_head_and_embedding_on_request(tmp_path):
    src = _mlp(tmp_path / "m.onnx")
    report = quantize_file(src, tmp_path / "q.onnx", weights="int8", lm_head=True, embedding=True)
    assert set(report.layers) == {"E", "W1", "W2", "W3"} and not report.kept
    ids = np.arange(10, dtype=np.int64)
    assert np.abs(_run(tmp_path / "q.onnx", ids) - _run(src, ids)).max() < 0.05 * np.abs(_run(src, ids)).max()
    report = quantize_file(src, tmp_path / "q4.onnx", weights="int4", group_size=32, embedding=True,
                           overwrite=True)
    assert "E" in report.layers
    np.testing.assert_allclose(_run(tmp_path / "q4.onnx", ids), _run(src, ids), atol=0.3 * np.abs(_run(src, ids)).max())


def test_onnxruntime_fuses_the_output_into_matmulnbits_at_extended(tmp_path):
    """docs/quantize.md: ORT_ENABLE_EXTENDED (and the default ORT_ENABLE_ALL) turn DequantizeLinear + MatMul into
    onnxruntime's MatMulNBits; ORT_ENABLE_BASIC does not."""
    src = _mlp(tmp_path / "m.onnx")
    quantize_file(src, tmp_path / "q.onnx", weights="int4", group_size=32, measure=False)
    for level, fused in ((ort.GraphOptimizationLevel.ORT_ENABLE_BASIC, False),
                         (ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED, True)):
        so = ort.SessionOptions()
        so.graph_optimization_level = level
        so.optimized_model_filepath = str(tmp_path / f"ort{int(fused)}.onnx")
        ort.InferenceSession(str(tmp_path / "q.onnx"), so, providers=["CPUExecutionProvider"])
        assert (_ops(tmp_path / f"ort{int(fused)}.onnx")["MatMulNBits"] >= 1) is fused


def test_external_data_model_streams_and_stays_external(tmp_path):
    src = _mlp(tmp_path / "m.onnx", external=True)
    quantize_file(src, tmp_path / "q.onnx", weights="int4", group_size=64)
    assert (tmp_path / "q.onnx.data").exists()
    ids = np.arange(5, dtype=np.int64)
    assert np.isfinite(_run(tmp_path / "q.onnx", ids)).all()


def test_optimize_keeps_weights_quantized_and_size_does_not_grow(tmp_path):
    src = _mlp(tmp_path / "m.onnx")
    quantize_file(src, tmp_path / "q.onnx", weights="int4", group_size=32, measure=False)
    k3opt.optimize_file(tmp_path / "q.onnx", tmp_path / "o.onnx", verify=True)
    assert _ops(tmp_path / "o.onnx")["DequantizeLinear"] == 2
    def weight_bytes(path: Path) -> int:
        return sum(len(t.raw_data) for t in onnx.load(str(path)).graph.initializer)

    assert weight_bytes(tmp_path / "o.onnx") <= weight_bytes(tmp_path / "q.onnx")
    assert (tmp_path / "o.onnx").stat().st_size <= 1.01 * (tmp_path / "q.onnx").stat().st_size  # metadata only


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs,error,text", [
    (dict(weights="int4", group_size=48), UsageError, "power of two"),
    (dict(weights="int4", group_size=256), UsageError, "does not divide the input dim"),
    (dict(weights="int4", opset=17), UsageError, "opset 21"),
    (dict(weights="int4", group_size=16, target="cann"), UsageError, "multiples of 32"),
    (dict(weights="int2"), UsageError, "int4 or int8"),
])
def test_bad_options_refused_with_nothing_written(tmp_path, kwargs, error, text):
    src = _mlp(tmp_path / "m.onnx")
    with pytest.raises(error, match=text):
        quantize_file(src, tmp_path / "q.onnx", **kwargs)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_no_constant_weight_refused(tmp_path):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 32]),
                                           helper.make_tensor_value_info("w", TensorProto.FLOAT, [32, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "m.onnx"))
    with pytest.raises(InputError, match="nothing to quantize"):
        quantize_file(tmp_path / "m.onnx", tmp_path / "q.onnx")
    assert not (tmp_path / "q.onnx").exists()


def test_cli_one_line_error_and_success(tmp_path):
    src = _mlp(tmp_path / "m.onnx")
    cmd = [sys.executable, "-m", "k3opt", "quantize", str(src), str(tmp_path / "q.onnx")]
    bad = subprocess.run(cmd + ["--group-size", "256"], capture_output=True, text=True)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "does not divide" in bad.stderr
    ok = subprocess.run(cmd + ["--weights", "int8", "--report", str(tmp_path / "r.json")], capture_output=True,
                        text=True)
    assert ok.returncode == 0, ok.stderr
    assert "worst relative weight error" in ok.stdout and "logits error" in ok.stdout
    assert (tmp_path / "r.json").exists()


def test_scheme_defaults():
    assert scheme_for("int4", None, False) == rtn.Scheme(4, 128, False)
    assert scheme_for("int8", None, True) == rtn.Scheme(8, 0, True)


@needs_torch
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_zoo_llama_every_projection_quantized(tmp_path, exporter):
    src = zoo_model("llama", exporter)
    report = quantize_file(src, tmp_path / "q.onnx", weights="int4", group_size=32)
    assert len(report.layers) == 14  # 2 layers x (q, k, v, o, gate, up, down)
    assert report.accuracy["tokens"]["count"] == 16 and report.accuracy["tokens"]["agreement"] >= 0.5
    assert _ops(tmp_path / "q.onnx")["DequantizeLinear"] == 14
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(tmp_path / "ort.onnx")
    ort.InferenceSession(str(tmp_path / "q.onnx"), so, providers=["CPUExecutionProvider"])
    assert _ops(tmp_path / "ort.onnx")["MatMulNBits"] == 14  # every projection on onnxruntime's n-bit kernel


def _onnxruntime_quantized(tmp_path: Path, form: str) -> Path:
    """The MLP quantized by onnxruntime's own tools: ``static`` W8A8 QDQ per channel (activations too), ``nbits``
    its MatMulNBitsQuantizer in QDQ form (int4 blocks of 32, opset 21)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    src, out = _mlp(tmp_path / "m.onnx"), tmp_path / f"{form}.onnx"
    if form == "static":
        class Reader(CalibrationDataReader):
            def __init__(self) -> None:
                self.feeds = iter([{"ids": np.arange(i, i + 6, dtype=np.int64)} for i in range(4)])

            def get_next(self):
                return next(self.feeds, None)

        quantize_static(str(src), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                        weight_type=QuantType.QInt8, activation_type=QuantType.QInt8)
    else:
        config = DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True, quant_format=QuantFormat.QDQ)
        quantizer = MatMulNBitsQuantizer(onnx.load(str(src)), algo_config=config)
        quantizer.process()
        quantizer.model.save_model_to_file(str(out))
    return out


@pytest.mark.parametrize("form", ["static", "nbits"])
@pytest.mark.parametrize("options", [{}, {"opset": 23}, {"target": "cann"}], ids=["default", "opset23", "cann"])
def test_a_model_quantized_elsewhere_stays_quantized(tmp_path, form, options):
    """Any model that arrives quantized (here by onnxruntime's tools) keeps every QuantizeLinear/DequantizeLinear
    through k3opt optimize, verified, and its weights do not grow; an int4 (opset-21) model for the cann target
    (opset 17) is refused in one line."""
    src = _onnxruntime_quantized(tmp_path, form)
    out = tmp_path / "o.onnx"
    feeds = {"ids": np.arange(6, dtype=np.int64)}
    if form == "nbits" and options.get("target") == "cann":
        with pytest.raises(UsageError, match="no form below opset 21"):
            k3opt.optimize_file(src, out, verify=True, input_data=feeds, **options)
        assert not out.exists()
        return
    report = k3opt.optimize_file(src, out, verify=True, input_data=feeds, **options)
    assert report.verification["status"] == "passed"
    before, after = _ops(src), _ops(out)
    assert after["DequantizeLinear"] == before["DequantizeLinear"] > 0
    assert after["QuantizeLinear"] == before["QuantizeLinear"]
    assert "NPUWeightQuantBatchMatmulV2" not in after  # W8A8 (static) is not weight-only; see test_cann_weight_quant

    def weight_bytes(path: Path) -> int:
        return sum(len(t.raw_data) or t.ByteSize() for t in onnx.load(str(path)).graph.initializer)

    assert weight_bytes(out) <= weight_bytes(src)


@pytest.mark.parametrize("args,text", [
    (["--group-size", "256"], "does not divide the input dim"),
    (["--opset", "17"], "opset 21"),
    (["--group-size", "16", "--target", "cann"], "multiples of 32"),
    (["--no-constant-weight"], "nothing to quantize"),
])
def test_cli_bad_input_is_one_line_and_writes_nothing(tmp_path, args, text):
    """Issue #31's bad input on the command line: exit 2, one line on stderr, no output file."""
    from click.testing import CliRunner

    from k3opt.cli import main

    src = _mlp(tmp_path / "m.onnx")
    if args == ["--no-constant-weight"]:  # every MatMul's weight a graph input
        model = onnx.load(str(src))
        for name in ("W1", "W2", "W3"):
            init = next(t for t in model.graph.initializer if t.name == name)
            model.graph.initializer.remove(init)
            model.graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, list(init.dims)))
        onnx.save(model, str(src))
        args = []
    result = CliRunner().invoke(main, ["quantize", str(src), str(tmp_path / "q.onnx"), *args])
    assert result.exit_code == 2, result.output
    assert text in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
