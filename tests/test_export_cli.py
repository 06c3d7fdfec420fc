"""``k3opt export``: checkpoint folder or config JSON in, optimized ONNX out; works (and explains) without torch."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from k3opt.cli import main
from k3opt.export.exporters import INSTALL_HINT
from tests.helpers import op_counts, run_ort
from tests.zoo import needs_torch, zoo_config, zoo_inputs

NO_TORCH = "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"


@needs_torch
def test_export_config_json(tmp_path) -> None:
    zoo_config("bert").to_json_file(tmp_path / "bert.json")
    result = CliRunner().invoke(main, ["export", str(tmp_path / "bert.json"), "--report", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    out = tmp_path / "bert.k3opt.onnx"
    model = onnx.load(out)
    assert model.opset_import[0].version == 17 and op_counts(model)["LayerNormalization"] == 5
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["verification"]["status"] == "passed" and report["output"] == str(out)


def count_fsyncs(monkeypatch) -> list[int]:
    """Count os.fsync calls for the rest of the test (k3opt.modelio syncs only with --fsync)."""
    calls: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
    return calls


@needs_torch
def test_export_checkpoint_folder_with_options(tmp_path, monkeypatch) -> None:
    import torch
    import transformers as tf

    torch.manual_seed(7)
    model = tf.AutoModelForCausalLM.from_config(zoo_config("llama")).eval()
    model.save_pretrained(tmp_path / "ckpt")
    args = ["export", str(tmp_path / "ckpt"), "--exporter", "torchscript", "--export-opset", "15", "--opset", "18",
            "--skip", "merge-sibling-matmuls", "-q", "--fsync"]
    fsyncs = count_fsyncs(monkeypatch)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0 and result.output == "", result.output
    assert len(fsyncs) == 2  # the model's temporary file, then its folder
    onnx_model = onnx.load(tmp_path / "ckpt" / "model.k3opt.onnx")
    assert onnx_model.opset_import[0].version == 18
    feeds = zoo_inputs("llama")
    with torch.no_grad():
        want = model(**{k: torch.from_numpy(v) for k, v in feeds.items()}).logits.numpy()
    np.testing.assert_allclose(run_ort(onnx_model, feeds)[0], want, rtol=1e-4, atol=1e-5)


@needs_torch
def test_export_with_kv_cache(tmp_path) -> None:
    zoo_config("llama").to_json_file(tmp_path / "llama.json")
    result = CliRunner().invoke(main, ["export", str(tmp_path / "llama.json"), "--use-cache", "-q"])
    assert result.exit_code == 0, result.output
    model = onnx.load(tmp_path / "llama.k3opt.onnx")
    assert [i.name for i in model.graph.input][2:4] == ["past_key_values.0.key", "past_key_values.0.value"]
    assert [o.name for o in model.graph.output][-1] == "present.1.value"


@needs_torch
def test_export_no_optimize_and_bad_task(tmp_path, monkeypatch) -> None:
    zoo_config("vit").to_json_file(tmp_path / "vit.json")
    runner = CliRunner()
    args = ["export", str(tmp_path / "vit.json"), "--no-optimize", "-o", str(tmp_path / "v.onnx"), "--fsync"]
    fsyncs = count_fsyncs(monkeypatch)
    result = runner.invoke(main, args)
    assert result.exit_code == 0 and "wrote" in result.output
    assert len(fsyncs) == 2
    assert onnx.load(tmp_path / "v.onnx").opset_import[0].version == 14
    result = runner.invoke(main, ["export", str(tmp_path / "vit.json"), "--task", "translate"])
    assert result.exit_code == 2 and "Invalid value for '--task'" in result.output


def test_export_without_torch_says_how_to_install(tmp_path) -> None:
    (tmp_path / "c.json").write_text("{}")
    code = NO_TORCH + (
        "import importlib.util as u; real = u.find_spec\n"
        "u.find_spec = lambda n, *a: None if n in ('torch', 'transformers') else real(n, *a)\n"
        f"from k3opt.cli import main; main(['export', {str(tmp_path / 'c.json')!r}])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"k3opt: error: {INSTALL_HINT}"


@pytest.mark.parametrize("missing", ["torch", "transformers"])
def test_k3opt_works_without_torch(missing: str) -> None:
    """torch is optional: k3opt, its CLI and k3opt.export import without it; the export entry points explain."""
    code = f"import sys; sys.modules[{missing!r}] = None\n" + (
        "import k3opt, k3opt.cli, k3opt.export\n"
        "try:\n    k3opt.export.from_transformers('x.json', 'y.onnx')\n"
        "except k3opt.K3optError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "pip install 'k3opt[export]'" in out


def test_zoo_skips_without_torch(monkeypatch) -> None:
    from tests import zoo

    monkeypatch.setattr(zoo, "HAVE_TORCH", False)
    with pytest.raises(pytest.skip.Exception, match="pip install 'k3opt\\[export\\]'"):
        zoo.zoo_model("bert")
