"""k3opt.export.from_torch and the exporter wrapper: numerics against torch, external data, one-line failures."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from k3opt.errors import K3optError
from tests.helpers import op_counts, run_ort
from tests.zoo import HAVE_TORCH, needs_torch

pytestmark = needs_torch

if HAVE_TORCH:
    import torch

    from k3opt.export import ExportError, export_onnx, from_torch
    from k3opt.export import exporters

    class Block(torch.nn.Module):
        """Linear + bias, then LayerNorm over the last axis: the shapes the fusions look for."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.fc = torch.nn.Linear(16, 16)
            self.norm = torch.nn.LayerNorm(16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(torch.relu(self.fc(x)))

    class Histc(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.histc(x, bins=4)


AXES = {"x": {0: "batch"}}


def _export_block(path, exporter: str, **kw):
    return from_torch(Block().eval(), (torch.randn(2, 4, 16),), path, input_names=["x"], output_names=["y"],
                      dynamic_axes=AXES, exporter=exporter, **kw)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_from_torch_optimizes_and_matches_torch(tmp_path, exporter: str) -> None:
    report = _export_block(tmp_path / "m.onnx", exporter, verify=True)
    model = onnx.load(tmp_path / "m.onnx")
    assert report.verification["status"] == "passed" and report.after.opset >= 17
    assert report.input == f"Block ({exporter} exporter)" and report.output == str(tmp_path / "m.onnx")
    assert op_counts(model).get("LayerNormalization") == 1 and "ReduceMean" not in op_counts(model)
    x = np.random.default_rng(0).standard_normal((3, 4, 16)).astype(np.float32)  # batch 3: the axis is dynamic
    with torch.no_grad():
        want = Block().eval()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(run_ort(model, {"x": x})[0], want, rtol=1e-4, atol=1e-5)


def test_optimize_false_keeps_the_raw_export(tmp_path) -> None:
    report = _export_block(tmp_path / "raw.onnx", "torchscript", optimize=False)
    model = onnx.load(tmp_path / "raw.onnx")
    assert report.output == str(tmp_path / "raw.onnx") and report.files == [str(tmp_path / "raw.onnx")]
    assert model.opset_import[0].version == 14 and "ReduceMean" in op_counts(model)


def test_export_opset_and_output_opset_are_separate(tmp_path) -> None:
    report = _export_block(tmp_path / "m.onnx", "torchscript", opset=13, output_opset=18)
    assert (report.before.opset, report.after.opset) == (13, 18)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_large_models_get_external_data(tmp_path, monkeypatch, exporter: str) -> None:
    monkeypatch.setattr(exporters, "LARGE_BYTES", 0)  # every model counts as large
    report = _export_block(tmp_path / "m.onnx", exporter)
    assert str(tmp_path / "m.onnx.data") in report.files
    x = np.ones((1, 4, 16), np.float32)
    onnx.checker.check_model(str(tmp_path / "m.onnx"))
    with torch.no_grad():
        want = Block().eval()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(run_ort(onnx.load(tmp_path / "m.onnx"), {"x": x})[0], want, rtol=1e-4, atol=1e-5)


def test_torchscript_failure_names_exporter_and_op(tmp_path) -> None:
    with pytest.raises(ExportError, match=r"^the torchscript exporter \(opset 14\) failed on op aten::histc: ") as e:
        from_torch(Histc(), (torch.randn(8),), tmp_path / "h.onnx", input_names=["x"], output_names=["y"])
    assert "\n" not in str(e.value) and isinstance(e.value, K3optError)
    assert not (tmp_path / "h.onnx").exists()


def test_dynamo_failure_names_exporter_and_op(tmp_path) -> None:
    @torch.library.custom_op("k3opt_test::double", mutates_args=())
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    double.register_fake(lambda x: torch.empty_like(x))

    class Custom(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return double(x) + 1

    with pytest.raises(ExportError, match=r"^the dynamo exporter \(opset 18\) failed on op \S*k3opt_test\.double"):
        export_onnx(Custom(), (torch.randn(4),), tmp_path / "c.onnx", input_names=["x"], output_names=["y"],
                    exporter="dynamo")


def test_unknown_exporter_is_refused(tmp_path) -> None:
    with pytest.raises(K3optError, match="unknown exporter 'onnxscript'"):
        _export_block(tmp_path / "m.onnx", "onnxscript")


def test_missing_output_folder_is_refused_before_exporting(tmp_path) -> None:
    with pytest.raises(K3optError, match="does not exist"):
        _export_block(tmp_path / "nope" / "m.onnx", "torchscript")
