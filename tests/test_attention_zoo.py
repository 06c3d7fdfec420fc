"""fuse-attention on the zoo's real exports: every family, both exporters, sdpa and eager attention, and
the decode steps with the KV cache; at ``--opset 23`` one Attention per layer, no Softmax left, the
optimize call's own verification passes and the original's outputs are reproduced in onnxruntime,
also on left-padded inputs whose causal rows are fully masked."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

import k3opt
from k3opt.report import Report
from tests.helpers import op_counts, run_ort
from tests.zoo import (family, max_rel_err, needs_torch, zoo_attention_params, zoo_config, zoo_decode_inputs,
                       zoo_decode_model, zoo_decode_params, zoo_inputs, zoo_model)


def layers(name: str) -> int:
    config = zoo_config(family(name))
    return getattr(config, "num_hidden_layers", None) or config.n_layer


def fused_per_layer(path, name: str, feeds) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """(original, optimized at opset 23): the optimize call verified on ``feeds``, one Attention per layer,
    no Softmax left, the graph outputs kept."""
    report = Report()
    out = k3opt.optimize(str(path), opset=23, verify=True, input_data=feeds, report=report)
    assert report.verification["status"] == "passed", report.verification
    assert not [n for n in report.notes if "attention(s)" in n], report.notes
    counts = op_counts(out)
    assert counts.get("Attention") == layers(name) and "Softmax" not in counts
    original = onnx.load(str(path))
    assert [o.name for o in out.graph.output] == [o.name for o in original.graph.output]
    return original, out


def left_padded(feeds: dict) -> dict:
    """Row 1 padded at the start: its first query rows see no key under a causal mask."""
    feeds = {k: v.copy() for k, v in feeds.items()}
    if "attention_mask" in feeds:
        feeds["attention_mask"][:] = 1
        feeds["attention_mask"][1, :3] = 0
    return feeds


def assert_same_outputs(original, out, feeds) -> None:
    want, got = run_ort(original, feeds), run_ort(out, feeds)
    assert all(np.isnan(w).any() == np.isnan(g).any() for w, g in zip(want, got))
    assert max_rel_err(got, want) < 1e-4


@needs_torch
@pytest.mark.parametrize("name, exporter", zoo_attention_params())
def test_one_attention_per_layer(name, exporter):
    feeds = zoo_inputs(name)
    original, out = fused_per_layer(zoo_model(name, exporter), name, feeds)
    assert_same_outputs(original, out, feeds)
    assert_same_outputs(original, out, left_padded(feeds))


@needs_torch
@pytest.mark.parametrize("name, exporter", zoo_decode_params())
def test_decode_step_with_the_kv_cache(name, exporter):
    """One new token after a cache of 6, and 3 new after 4; the cache is the op's past_key/past_value and its
    present outputs are the graph's present outputs (names kept)."""
    original, out = fused_per_layer(zoo_decode_model(name, exporter), name, zoo_decode_inputs(name))
    presents = [o.name for o in out.graph.output if o.name.startswith("present")]
    attentions = [n for n in out.graph.node if n.op_type == "Attention"]
    assert [o for n in attentions for o in n.output[1:]] == presents
    assert all(n.input[4].startswith("past") and n.input[5].startswith("past") for n in attentions)
    for past, new in ((6, 1), (4, 3), (1, 1)):
        assert_same_outputs(original, out, zoo_decode_inputs(name, past=past, new=new))


@needs_torch
def test_below_opset_23_the_attentions_are_counted():
    report = Report()
    out = k3opt.optimize(str(zoo_model("llama")), report=report)
    assert "Attention" not in op_counts(out)
    assert [n for n in report.notes if "attention(s)" in n] == ["2 attention(s) found, left decomposed: opset < 23"]


@needs_torch
@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "llama_eager"])
def test_causal_lm_without_a_mask_becomes_is_causal(name, tmp_path):
    """Exported with input_ids only (static shapes, dynamo): the causal mask folds to a constant triangle
    (repeated over the batch) and GQA's repeat is flattened into the batched transpose; both are fused."""
    import torch

    from tests.zoo import zoo_torch_model

    class Ids(torch.nn.Module):
        def __init__(self, hf):
            super().__init__()
            self.hf = hf

        def forward(self, ids):
            return self.hf(input_ids=ids).logits

    path = tmp_path / "model.onnx"
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.onnx.export(Ids(zoo_torch_model(name).model).eval(), (ids,), str(path), input_names=["input_ids"],
                      dynamo=True, optimize=False, opset_version=18)
    onnx.save(onnx.load(str(path)), str(path))  # weights inline (the exporter writes them aside)
    feeds = {"input_ids": ids.numpy()}
    original, out = fused_per_layer(path, name, feeds)
    causal = [a for n in out.graph.node if n.op_type == "Attention" for a in n.attribute if a.name == "is_causal"]
    assert [a.i for a in causal] == [1] * layers(name)
    assert_same_outputs(original, out, feeds)
