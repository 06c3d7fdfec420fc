"""The target-cann invariants on every test export, the NPU flash attentions per layer (prefill and decode), and
the pre-flight check / stand-in ATC on a real one. Every lowered model is verified by the pipeline itself: the
reference NPU ops in onnx's reference evaluator against onnxruntime's outputs of the export."""
from __future__ import annotations

import onnx
import pytest

import k3opt
from k3opt.cann_bridge import AtcOptions, check_model, compile_model, invariant_violations
from k3opt.report import Report
from tests.fake_atc import recorded_argv, write_fake_atc
from tests.helpers import op_counts
from tests.moe_models import moe_decode_inputs, moe_decode_model
from tests.zoo import (EXPORTERS, NAMES, family, zoo_config, zoo_decode_inputs, zoo_decode_model,
                       zoo_decode_params, zoo_inputs, zoo_model)

#: RMSNorms per decoder layer (input and post-attention; MLA adds the q_a and kv_a norms), plus the final norm.
_RMS_PER_LAYER = {"llama": 2, "qwen2": 2, "deepseek_v3": 4}


def expected_npu_rmsnorms(name: str) -> int:
    """RMSNorms in the model whose eps is the plugin's 1e-6 (read from the transformers config)."""
    if name not in _RMS_PER_LAYER:
        return 0
    config = zoo_config(name)
    if config.rms_norm_eps != 1e-6:
        return 0
    return _RMS_PER_LAYER[name] * config.num_hidden_layers + 1


def _cases():
    fast = {("llama", "torchscript")}
    return [pytest.param(n, e, marks=[pytest.mark.slow] if (n, e) not in fast else [])
            for n in NAMES for e in EXPORTERS]


def flash_attentions(model: onnx.ModelProto) -> int:
    """NPU flash-attention nodes, in either form (default domain at opset 16, or npu::1)."""
    return sum(n.op_type in ("NPUPromptFlashAttention", "NPUIncreFlashAttention") for n in model.graph.node)


def lowered(path, feeds=None, **options):
    """``--target cann`` with verification (onnxruntime, then the reference evaluator on the lowered model)."""
    report = Report()
    out = k3opt.optimize(str(path), target="cann", verify=True, report=report, input_data=feeds, **options)
    assert report.verification["status"] == "passed"
    assert report.lowering_verification["status"] == "passed", report.lowering_verification
    assert invariant_violations(out) == []
    assert [str(f) for f in check_model(out) if f.kind != "dynamic"] == []  # every node has an ATC parser
    return out, report


@pytest.mark.parametrize("name, exporter", _cases())
def test_cann_target_invariants_on_exports(name, exporter):
    out, report = lowered(zoo_model(name, exporter))
    assert [(o.domain or "", o.version) for o in out.opset_import] in ([("", 17)], [("", 16)], [("", 17), ("npu", 1)])
    assert op_counts(out).get("NPURmsNorm", 0) == expected_npu_rmsnorms(name), report.lowering


def _flash_cases():
    """sdpa (default) and eager attention; dynamo and eager ones marked slow."""
    families = ("bert", "gpt2", "llama", "qwen2", "vit")
    return [pytest.param(n, e, id=f"{n}-{e}", marks=[pytest.mark.slow] if e == "dynamo" or n != family(n) else [])
            for n in families + tuple(f"{f}_eager" for f in families) for e in EXPORTERS]


@pytest.mark.parametrize("name, exporter", _flash_cases())
def test_one_prompt_flash_attention_per_layer_in_prefill(name, exporter):
    """Eager exports fill the mask with the dtype's lowest (a fully masked row is the mean of v): exact too.

    Every export lowers with its dynamic batch/sequence dims: dynamo BERT and ViT's residual stream's batch and
    sequence, lost by inference at the embeddings' broadcasts (``min(S, 512)`` position rows, an expanded class
    token), are traced once and written for the lowering (input_dims); eager ViT's second layer reads the first's
    probs @ v, whose heads are that MatMul's batch dims, traced too."""
    feeds = zoo_inputs(name)
    out, report = lowered(zoo_model(name, exporter), feeds)
    layers = zoo_config(name).num_hidden_layers
    assert flash_attentions(out) == layers, report.lowering
    assert "Softmax" not in op_counts(out)
    layer_norm = "LayerNormalization" in op_counts(out)
    assert [(o.domain or "", o.version) for o in out.opset_import] == ([("", 17), ("npu", 1)] if layer_norm
                                                                      else [("", 16)])


def _mla_cases():
    return [pytest.param(step, e, id=f"{step}-{e}", marks=[pytest.mark.slow] if e == "dynamo" else [])
            for step in ("prefill", "decode") for e in EXPORTERS]


@pytest.mark.parametrize("step, exporter", _mla_cases())
def test_deepseek_mla_is_one_prompt_flash_attention_per_layer(step, exporter):
    """MLA's q/k dim 12 and v dim 8: v zero-padded to 12, the output sliced back (lower-attention-npu's doc).
    The decode step caches MLA's compressed latents (its keys are expanded from them), and is labelled so."""
    if step == "prefill":
        path, feeds = zoo_model("deepseek_v3", exporter), zoo_inputs("deepseek_v3")
    else:
        path, feeds = moe_decode_model("deepseek_v3", exporter), moe_decode_inputs("deepseek_v3")
    out, report = lowered(path, feeds)
    assert flash_attentions(out) == zoo_config("deepseek_v3").num_hidden_layers, report.lowering
    assert "Softmax" not in op_counts(out)
    label = "decode step" if step == "decode" else "prefill"
    lines = [line for line in report.lowering if "-> NPUPromptFlashAttention" in line]
    assert len(lines) == 2 and all(f"({label}, 4/4 heads" in line and "MLA: q/k dim 12, v dim 8 padded" in line
                                   for line in lines), lines


@pytest.mark.parametrize("name, exporter", zoo_decode_params())
def test_one_flash_attention_per_layer_in_decode(name, exporter):
    """One token after a left-padded cache of 6: MHA (GPT-2) and GQA (Llama, Qwen2) caches are PromptFlashAttention
    with one query row (IncreFlashAttention's plugin fixes the cache at one head)."""
    out, report = lowered(zoo_decode_model(name, exporter), zoo_decode_inputs(name))
    assert flash_attentions(out) == zoo_config(name).num_hidden_layers, report.lowering
    assert all("decode step" in line for line in report.lowering if "-> NPUPromptFlashAttention" in line)


def test_llama_export_compiles_with_the_stand_in(tmp_path, monkeypatch):
    atc = write_fake_atc(tmp_path / "bin")
    src = zoo_model("llama", "torchscript")
    opts = AtcOptions(soc_version="Ascend910B3", input_shapes=("input_ids:1,8", "attention_mask:1,8"))
    res = compile_model(str(src), tmp_path / "out" / "llama", opts, atc=str(atc))
    assert res.om_path.is_file()
    assert check_model(onnx.load(str(res.onnx_path), load_external_data=False)) == []
    assert "--input_shape=input_ids:1,8;attention_mask:1,8" in recorded_argv(atc)[-1]
    assert res.report.lowering[0].startswith(f"NPURmsNorm: {expected_npu_rmsnorms('llama')} of")

