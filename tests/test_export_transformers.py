"""k3opt.export.from_transformers: configs, checkpoint folders, tasks; numerics checked against the torch model."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from k3opt.errors import InputError, UsageError
from tests.helpers import run_ort
from tests.zoo import HAVE_TORCH, needs_torch, zoo_config, zoo_inputs

pytestmark = needs_torch

if HAVE_TORCH:
    import torch
    import transformers as tf

    from k3opt.export import from_transformers, infer_task
    from k3opt.export.task_module import TaskModule


def _torch_out(model, names: tuple[str, ...], outputs: tuple[str, ...], feeds: dict) -> list[np.ndarray]:
    with torch.no_grad():
        out = TaskModule(model.eval(), names, outputs)(*(torch.from_numpy(feeds[n]) for n in names))
    return [t.numpy() for t in (out if isinstance(out, tuple) else (out,))]


def _check(path, model, name: str) -> None:
    """The ONNX at ``path`` gives the torch model's outputs (padded batch of 2, and batch 3 x seq 5)."""
    onnx_model = onnx.load(path)
    inputs = tuple(i.name for i in onnx_model.graph.input)
    outputs = tuple(o.name for o in onnx_model.graph.output)
    for feeds in (zoo_inputs(name), zoo_inputs(name, batch=3, seq=5, seed=1)):
        for got, want in zip(run_ort(onnx_model, feeds), _torch_out(model, inputs, outputs, feeds)):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


FAMILIES = [("llama", "text-generation", ("input_ids", "attention_mask"), ("logits",)),
            ("bert", "feature-extraction", ("input_ids", "attention_mask"), ("last_hidden_state", "pooler_output")),
            ("vit", "image-feature-extraction", ("pixel_values",), ("last_hidden_state", "pooler_output"))]


@pytest.mark.parametrize("exporter", ["torchscript", pytest.param("dynamo", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name,task,inputs,outputs", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_from_config_round_trip(tmp_path, name, task, inputs, outputs, exporter) -> None:
    config = zoo_config(name)
    report = from_transformers(config, tmp_path / "m.onnx", exporter=exporter, verify=True)
    model = onnx.load(tmp_path / "m.onnx")
    assert tuple(i.name for i in model.graph.input) == inputs and tuple(o.name for o in model.graph.output) == outputs
    assert report.verification["status"] == "passed"
    torch.manual_seed(0)  # from_transformers builds random weights with seed 0
    _check(tmp_path / "m.onnx", getattr(tf, {"text-generation": "AutoModelForCausalLM"}.get(task, "AutoModel"))
           .from_config(config), name)


def test_checkpoint_folder_uses_its_weights(tmp_path) -> None:
    torch.manual_seed(123)
    model = tf.AutoModelForCausalLM.from_config(zoo_config("qwen2"))
    model.save_pretrained(tmp_path / "ckpt")
    from_transformers(tmp_path / "ckpt", tmp_path / "m.onnx")
    _check(tmp_path / "m.onnx", model, "qwen2")


def test_config_json_file(tmp_path) -> None:
    zoo_config("gpt2").to_json_file(tmp_path / "gpt2.json")
    from_transformers(tmp_path / "gpt2.json", tmp_path / "m.onnx", optimize=False)
    torch.manual_seed(0)
    _check(tmp_path / "m.onnx", tf.AutoModelForCausalLM.from_config(zoo_config("gpt2")), "gpt2")


def test_moe_model_exports_with_input_independent_routing(tmp_path) -> None:
    """DeepSeek-V3 with the default (grouped_mm) experts: switched to batched_mm for the export, then restored."""
    config = zoo_config("deepseek_v3")
    config._experts_implementation = None
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).train()
    assert model.config._experts_implementation == "grouped_mm"  # transformers' default
    from_transformers(model, tmp_path / "m.onnx")
    assert model.training and model.config._experts_implementation == "grouped_mm"
    model.config._experts_implementation = "batched_mm"  # the same maths, runnable in eager torch here
    _check(tmp_path / "m.onnx", model, "deepseek_v3")


@pytest.mark.parametrize("name,exporter", [("llama", "torchscript"), ("deepseek_v3", "torchscript"),
                                           pytest.param("qwen2", "dynamo", marks=pytest.mark.slow)])
def test_kv_cache_round_trip(tmp_path, name: str, exporter: str) -> None:
    """use_cache=True: one decoding step, past in and present out, equal to torch at other batch/past/new sizes."""
    from tests.zoo import zoo_torch_model
    from k3opt.export.task_module import CachedCausalLM, prefix_cache

    model = zoo_torch_model(name).model
    report = from_transformers(model, tmp_path / "m.onnx", use_cache=True, exporter=exporter, verify=True)
    assert report.verification["status"] == "passed"  # on the example inputs (random ones break total = past + new)
    onnx_model = onnx.load(tmp_path / "m.onnx")
    names = [i.name for i in onnx_model.graph.input]
    layers = model.config.num_hidden_layers
    assert names[:3] == ["input_ids", "attention_mask", "past_key_values.0.key"] and len(names) == 2 + 2 * layers
    assert [o.name for o in onnx_model.graph.output][:2] == ["logits", "present.0.key"]
    batch, past_len, new = 3, 5, 2
    past = prefix_cache(model, torch.randint(0, 100, (batch, past_len)))
    ids = torch.randint(0, 100, (batch, new))
    mask = torch.ones(batch, past_len + new, dtype=torch.int64)
    mask[0, -1] = 0
    with torch.no_grad():
        want = CachedCausalLM(model)(ids, mask, tuple(p.clone() for p in past))
    got = run_ort(onnx_model, dict(zip(names, (t.numpy() for t in (ids, mask, *past)))))
    assert len(got) == 1 + 2 * layers
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-4, atol=1e-5)


def test_model_settings_are_restored(tmp_path) -> None:
    config = zoo_config("llama")
    config.use_cache = True
    model = tf.AutoModelForCausalLM.from_config(config).train()
    from_transformers(model, tmp_path / "m.onnx", optimize=False)
    assert model.training and model.config.use_cache is True


@pytest.mark.parametrize("name,task", [("bert", "feature-extraction"), ("gpt2", "text-generation"),
                                       ("llama", "text-generation"), ("deepseek_v3", "text-generation"),
                                       ("vit", "image-feature-extraction")])
def test_task_from_config(name: str, task: str) -> None:
    assert infer_task(zoo_config(name)) == task


def test_task_from_architecture_and_class() -> None:
    config = zoo_config("bert")
    config.architectures = ["BertForMaskedLM"]
    assert infer_task(config) == "fill-mask"
    assert infer_task(tf.BertForSequenceClassification(zoo_config("bert"))) == "text-classification"
    assert infer_task(tf.ViTForImageClassification(zoo_config("vit"))) == "image-classification"


def test_classification_head(tmp_path) -> None:
    model = tf.BertForSequenceClassification(zoo_config("bert"))
    from_transformers(model, tmp_path / "m.onnx")
    assert [o.name for o in onnx.load(tmp_path / "m.onnx").graph.output] == ["logits"]
    _check(tmp_path / "m.onnx", model, "bert")


def test_refusals(tmp_path) -> None:
    with pytest.raises(UsageError, match="unknown task 'translate'"):
        from_transformers(zoo_config("bert"), tmp_path / "m.onnx", task="translate")
    with pytest.raises(UsageError, match="KV cache: task text-generation, not feature-extraction"):
        from_transformers(zoo_config("bert"), tmp_path / "m.onnx", use_cache=True)
    (tmp_path / "bad.json").write_text(json.dumps({"hidden_size": 4}))
    with pytest.raises(InputError, match="needs a 'model_type'"):
        from_transformers(tmp_path / "bad.json", tmp_path / "m.onnx")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no config.json"):
        from_transformers(tmp_path / "empty", tmp_path / "m.onnx")
    with pytest.raises(InputError, match="cannot export a int"):
        from_transformers(3, tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()
