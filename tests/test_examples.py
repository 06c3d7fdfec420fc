"""The runnable examples: each runs end to end, and its optimized model gives the torch model's outputs."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import numpy as np
import onnx
import pytest

from tests.helpers import op_counts, run_ort
from tests.zoo import needs_torch, zoo_inputs

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
BOTH = pytest.mark.parametrize("exporter", ["torchscript", pytest.param("dynamo", marks=pytest.mark.slow)])


def load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` as a module (examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_matches_torch(path: Path, model, feeds: dict[str, np.ndarray]) -> None:
    """The ONNX model at ``path`` gives ``model``'s first output (logits or last_hidden_state) on ``feeds``."""
    import torch

    with torch.no_grad():
        want = model(**{k: torch.from_numpy(v) for k, v in feeds.items()})[0].numpy()
    np.testing.assert_allclose(run_ort(onnx.load(path), feeds)[0], want, rtol=1e-4, atol=1e-5)


@needs_torch
@BOTH
def test_kimi_k2_example(tmp_path, capsys, exporter: str) -> None:
    import torch
    import transformers as tf

    example = load_example("kimi_k2_compile")
    status = example.main(["--out-dir", str(tmp_path), "--exporter", exporter])
    printed = capsys.readouterr().out
    assert "verification: passed" in printed
    config = example.kimi_k2_config()
    assert config.q_lora_rank and config.kv_lora_rank and config.n_shared_experts and config.first_k_dense_replace == 1
    torch.manual_seed(0)  # from_transformers' random weights
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    model.config._experts_implementation = "batched_mm"  # as exported; runs in eager torch here
    assert type(model.model.layers[1].mlp).__name__ == "DeepseekV3MoE"
    assert_matches_torch(tmp_path / "kimi_k2.onnx", model, zoo_inputs("deepseek_v3"))
    assert status == 0
    assert "ATC can parse every node" in printed and "dry run" in printed
    assert (tmp_path / "kimi_k2_npu.onnx").is_file()


@needs_torch
@BOTH
def test_bert_opset14_example(tmp_path, capsys, exporter: str) -> None:
    example = load_example("bert_opset14")
    assert example.main(["--out", str(tmp_path / "bert.onnx"), "--exporter", exporter]) == 0
    assert "5 LayerNormalization node(s)" in capsys.readouterr().out
    model = onnx.load(tmp_path / "bert.onnx")
    counts = op_counts(model)
    assert model.opset_import[0].version >= 17 and counts["LayerNormalization"] == 5 and "ReduceMean" not in counts
    assert_matches_torch(tmp_path / "bert.onnx", example.tiny_bert(), zoo_inputs("bert"))


@needs_torch
@BOTH
def test_library_usage_example(tmp_path, capsys, exporter: str) -> None:
    example = load_example("library_usage")
    assert example.main(["--out-dir", str(tmp_path), "--exporter", exporter]) == 0
    printed = capsys.readouterr().out
    assert "verification: passed" in printed and "in memory:" in printed
    assert_matches_torch(tmp_path / "gpt2.k3opt.onnx", example.tiny_gpt2(), zoo_inputs("gpt2"))
