"""The test model zoo: every (model, exporter) pair exports, runs in onnxruntime and matches torch."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import pytest

from tests.helpers import op_counts, run_ort
from tests.zoo import (max_rel_err, needs_torch, torch_outputs, zoo_inputs, zoo_model, zoo_params,
                       zoo_torch_model)

pytestmark = needs_torch

@pytest.mark.parametrize("name,exporter", zoo_params())
def test_export_matches_torch(name: str, exporter: str) -> None:
    model = onnx.load(zoo_model(name, exporter))
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    assert opset == {"torchscript": 14, "dynamo": 18}[exporter]
    other_shape = zoo_inputs(name, batch=3, seq=5, seed=1)  # the axes are dynamic
    for feeds in (zoo_inputs(name), other_shape):
        assert max_rel_err(run_ort(model, feeds), torch_outputs(name, feeds)) < 1e-5


def test_padding_mask_is_part_of_the_traced_graph() -> None:
    """The trace must not have skipped the mask: changing it changes the outputs."""
    model = onnx.load(zoo_model("bert", "torchscript"))
    feeds = zoo_inputs("bert")
    padded = run_ort(model, feeds)[0]
    feeds["attention_mask"][:] = 1
    assert not np.allclose(run_ort(model, feeds)[0][1], padded[1])


def test_torchscript_layernorm_is_decomposed() -> None:
    counts = op_counts(onnx.load(zoo_model("bert", "torchscript")))
    assert "LayerNormalization" not in counts and counts.get("ReduceMean", 0) >= 2 * 5


def test_architectures_are_the_ones_named() -> None:
    llama = zoo_torch_model("llama").model.config
    assert llama.num_key_value_heads < llama.num_attention_heads
    assert zoo_torch_model("qwen2").model.model.layers[0].self_attn.q_proj.bias is not None
    ds = zoo_torch_model("deepseek_v3").model
    assert ds.config.q_lora_rank and ds.config.kv_lora_rank
    kinds = [type(layer.mlp).__name__ for layer in ds.model.layers]
    assert kinds == ["DeepseekV3MLP", "DeepseekV3MoE"]
    assert ds.model.layers[1].mlp.shared_experts is not None


def test_cache_is_reused(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("K3OPT_ZOO_CACHE", str(tmp_path))
    first = zoo_model("vit", "torchscript")
    assert first.parent == tmp_path
    stamp = first.stat().st_mtime_ns
    assert zoo_model("vit", "torchscript") == first and first.stat().st_mtime_ns == stamp
    assert not [p for p in tmp_path.iterdir() if p.suffix not in (".onnx", ".lock")]


def test_unknown_name_is_refused() -> None:
    with pytest.raises(KeyError, match="no zoo model"):
        zoo_model("gpt5")


@pytest.mark.slow
def test_parallel_workers_export_once(tmp_path) -> None:
    """Two processes asking for the same model at once (pytest-xdist workers) get one export, whole."""
    code = "from tests.zoo import zoo_model; print(zoo_model('vit'), zoo_model('vit').stat().st_mtime_ns)"
    env = {**os.environ, "K3OPT_ZOO_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = {p.communicate()[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs) and len(outs) == 1  # same file, written once
    assert len(list(tmp_path.glob("*.onnx"))) == 1
