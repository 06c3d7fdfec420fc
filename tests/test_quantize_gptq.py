"""k3opt quantize --calibration-data: GPTQ beats round-to-nearest on the layer outputs, on inputs it did not
see too; the output stays standard DequantizeLinear + MatMul; --target cann still lowers it; bad files are
refused in one line with nothing written."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from k3opt.cli import main
from k3opt.errors import InputError, UsageError
from k3opt.quantize import calibrate, gptq, quantize_file, rtn
from tests.test_quantize import _mlp, _ops, _run
from tests.zoo import needs_torch, zoo_inputs, zoo_model

RNG = np.random.default_rng(3)


def _activations(rows: int, k: int, mix: np.ndarray) -> np.ndarray:
    """Correlated inputs with channels of very different energy, as a transformer's hidden states are."""
    return (RNG.standard_normal((rows, k)) @ mix).astype(np.float32)


@pytest.mark.parametrize("bits,group,symmetric", [(4, 32, False), (4, 128, False), (4, 64, True), (8, 0, False)])
def test_gptq_layer_output_error_below_rtn_on_unseen_inputs(bits, group, symmetric):
    k, n = 256, 96
    mix = RNG.standard_normal((k, k)) * np.exp(RNG.standard_normal(k))[None, :]
    x, held = _activations(2048, k, mix), _activations(1024, k, mix)
    w = RNG.standard_normal((k, n)).astype(np.float32) / np.sqrt(k)
    scheme = rtn.Scheme(bits, group, symmetric, clip=True)
    hessian = x.astype(np.float64).T @ x / len(x)
    out: dict[str, np.ndarray] = {}
    q = gptq.quantize(lambda a, b: w[a:b], k, n, scheme, lambda a, b, v: out.__setitem__("q", v), hessian)
    mine, plain = q.output_errors
    assert mine < 0.95 * plain
    blocks: list[np.ndarray] = []
    p = rtn.quantize(lambda a, b: w[a:b], k, n, scheme, lambda a, b, v: blocks.append(v))
    back_gptq = rtn.dequantize(out["q"], q.scale, q.zero_point, group)
    back_rtn = rtn.dequantize(np.concatenate(blocks), p.scale, p.zero_point, group)
    assert q.scale.shape == p.scale.shape and (q.zero_point is None) == symmetric
    assert out["q"].min() >= scheme.qmin and out["q"].max() <= scheme.qmax
    unseen = np.linalg.norm(held @ (back_gptq - w)), np.linalg.norm(held @ (back_rtn - w))
    assert unseen[0] < unseen[1]
    assert mine == pytest.approx(gptq.output_error(w, back_gptq - w, hessian))


def test_unused_channels_keep_their_weights():
    """A channel no calibration sample uses (a zero row and column of H) is rounded, not zeroed."""
    k, n = 64, 8
    x = RNG.standard_normal((256, k)).astype(np.float32)
    x[:, 5] = 0
    w = RNG.standard_normal((k, n)).astype(np.float32)
    out: dict[str, np.ndarray] = {}
    q = gptq.quantize(lambda a, b: w[a:b], k, n, rtn.Scheme(4, 32), lambda a, b, v: out.__setitem__("q", v),
                      x.astype(np.float64).T @ x)
    back = rtn.dequantize(out["q"], q.scale, q.zero_point, 32)
    assert np.isfinite(back).all() and np.abs(back[5]).max() > 0
    assert np.all(np.abs(back[5] - w[5]) <= 0.5 * q.scale[0] * (1 + 1e-5))  # rounded to nearest, not zeroed


def _calibration(vocab: int = 50, samples: int = 400) -> dict[str, np.ndarray]:
    return {"ids": RNG.integers(0, vocab, samples).astype(np.int64)}


@pytest.mark.parametrize("weights,group", [("int4", 32), ("int8", None)])
def test_calibrated_model_is_standard_qdq_and_closer_to_float(tmp_path, weights, group):
    src = _mlp(tmp_path / "m.onnx")
    plain = quantize_file(src, tmp_path / "rtn.onnx", weights=weights, group_size=group)
    report = quantize_file(src, tmp_path / "gptq.onnx", weights=weights, group_size=group,
                           calibration=_calibration())
    assert set(report.calibrated) == {"W1", "W2"} == set(report.layers)
    assert all(np.isfinite(v).all() for v in report.calibrated.values())
    assert any(line.startswith("GPTQ: layer-output error") for line in report.lines())
    assert _ops(tmp_path / "gptq.onnx") == _ops(tmp_path / "rtn.onnx")  # DequantizeLinear -> MatMul, as RTN
    ids = np.arange(50, dtype=np.int64)  # every token, most of them in other proportions than calibrated
    ref = _run(src, ids)
    err = {name: np.linalg.norm(_run(tmp_path / f"{name}.onnx", ids) - ref) for name in ("rtn", "gptq")}
    assert err["gptq"] < err["rtn"]
    assert report.accuracy["logits"]["rel"] <= plain.accuracy["logits"]["rel"]


def test_calibrated_target_cann_still_lowers(tmp_path):
    src = _mlp(tmp_path / "m.onnx")
    report = quantize_file(src, tmp_path / "c.onnx", weights="int4", group_size=32, target="cann",
                           calibration=_calibration())
    ops = _ops(tmp_path / "c.onnx")
    assert ops["NPUWeightQuantBatchMatmulV2"] == 2 and ops["DequantizeLinear"] == 0
    assert set(report.calibrated) == {"W1", "W2"}


def test_passes_cut_at_the_budget(tmp_path, monkeypatch):
    """Hessians beyond the budget go in later passes, in graph order; each site is calibrated once."""
    from k3opt.quantize.select import select

    model = onnx.load(str(_mlp(tmp_path / "m.onnx")))
    sites = select(model).sites
    monkeypatch.setattr(calibrate, "BUDGET", 8 * 128 * 128)  # one 128-wide Hessian per pass
    parts = calibrate.passes(model, list(reversed(sites)))
    assert [[s.name for s in p] for p in parts] == [["W1"], ["W2"]]
    report = quantize_file(tmp_path / "m.onnx", tmp_path / "q.onnx", weights="int4", group_size=32,
                           calibration=_calibration())  # the second pass runs the model with W1 quantized
    assert set(report.calibrated) == {"W1", "W2"} and report.accuracy["logits"]["rel"] < 0.2


@pytest.mark.parametrize("arrays,error,text", [
    ({"ids": np.zeros((4,), np.int64), "mask": np.zeros(4)}, UsageError, "mask are not graph inputs"),
    ({}, UsageError, "no array for the graph input(s) ids"),
    ({"ids": np.zeros((2, 3), np.int64)}, UsageError, "rank 1"),
    ({"ids": np.array(["a", "b"])}, UsageError, "cannot be the input's type"),
    ({"ids": np.full(8, 10**6, np.int64)}, UsageError, "does not run on the calibration data"),
])
def test_bad_calibration_refused_with_nothing_written(tmp_path, arrays, error, text):
    src = _mlp(tmp_path / "m.onnx")
    with pytest.raises(error, match=None) as caught:
        quantize_file(src, tmp_path / "q.onnx", calibration=arrays)
    assert text in str(caught.value) and "\n" not in str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


@pytest.mark.parametrize("content,text", [(b"not a zip", "cannot read a .npz"), (None, "cannot read a .npz")])
def test_cli_bad_calibration_file_is_one_line(tmp_path, content, text):
    src = _mlp(tmp_path / "m.onnx")
    bad = tmp_path / "cal.npz"
    if content is not None:
        bad.write_bytes(content)
    result = CliRunner().invoke(main, ["quantize", str(src), str(tmp_path / "q.onnx"), "--calibration-data", str(bad)])
    assert result.exit_code == 2, result.output
    assert text in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "q.onnx").exists()


def test_cli_calibration_file(tmp_path):
    src = _mlp(tmp_path / "m.onnx")
    np.savez(tmp_path / "cal.npz", **_calibration())
    result = CliRunner().invoke(main, ["quantize", str(src), str(tmp_path / "q.onnx"), "--calibration-data",
                                       str(tmp_path / "cal.npz"), "--no-measure"])
    assert result.exit_code == 0, result.output
    assert "GPTQ: layer-output error on the calibration data" in result.output
    assert _ops(tmp_path / "q.onnx")["DequantizeLinear"] == 2


def test_missing_file_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="cannot read"):
        calibrate.load(tmp_path / "none.npz", None)


@needs_torch
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_zoo_llama_calibrated_every_projection(tmp_path, exporter):
    """Both exporters' Llama (the dynamo one reads nn.Linear weights through a Transpose): every projection
    gets GPTQ from the model's own inputs, and the logits are no further from float than RTN's."""
    src = zoo_model("llama", exporter)
    inputs = zoo_inputs("llama", batch=64, seed=1)  # 512 tokens: 8 per input channel of the widest (64)
    names = {i.name for i in onnx.load(str(src), load_external_data=False).graph.input}
    calibration = {k: v for k, v in inputs.items() if k in names}
    few = quantize_file(src, tmp_path / "few.onnx", weights="int4", group_size=32, tokens=0, measure=False,
                        calibration={k: v[:4] for k, v in calibration.items()})
    assert any(n.startswith("few calibration tokens for GPTQ: 32 rows") for n in few.notes)
    plain = quantize_file(src, tmp_path / "rtn.onnx", weights="int4", group_size=32, tokens=0)
    report = quantize_file(src, tmp_path / "q.onnx", weights="int4", group_size=32, tokens=0,
                           calibration=calibration)
    assert len(report.calibrated) == 14 == len(report.layers)
    assert _ops(tmp_path / "q.onnx")["DequantizeLinear"] == 14
    assert report.accuracy["logits"]["rel"] < plain.accuracy["logits"]["rel"]
    assert not any(n.startswith("few calibration") for n in report.notes)
