"""fuse-attention and the CANN lowering on transformer families the zoo does not export (tests/family_models.py).

For each family and exporter: ``--opset 23`` and ``--target cann`` keep the export's outputs (the optimize
call's own verification, then onnxruntime on the padded inputs and on left-padded ones whose first causal rows
see no key), and the attentions fused or declined are the ones :data:`EXPECT` records, with the reason. What is
safe to fuse is decided on hand-made graphs at the end: a sliding-window band is not causal, logit
softcapping (``tanh(s / c) * c``) is not a scale, unscaled attention (T5) has scale 1.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import helper

import k3opt
from k3opt.report import Report
from tests.family_models import family_inputs, family_model, family_torch_model
from tests.helpers import op_counts
from tests.test_attention import S, Attn, assert_declined, assert_fused
from tests.test_cann_attention import lower
from tests.test_attention_zoo import assert_same_outputs, left_padded
from tests.test_cann_zoo import flash_attentions, lowered
from tests.zoo import needs_torch


@dataclasses.dataclass(frozen=True)
class Expect:
    """What k3opt does with a family's attentions: ``fused`` Attention-23 nodes and ``lowered`` NPU flash
    attentions; the others are left decomposed with a note containing ``why`` (opset 23) and ``npu_why``
    (cann), or, where both are empty, not recognised as attention at all. ``rotary``: RotaryEmbedding-23
    nodes at opset 23 (fuse-rotary: q and k of each layer, partial rotary included)."""

    attentions: int
    fused: int
    lowered: int
    why: str = ""
    npu_why: str = ""
    rotary: int = 0


SOFTCAP = "the scores are not a MatMul(q, k^T)"
BIAS = "the mask is of unknown form"
HEADS = "heads is not static"
GQA = "GQA: q's head count is not provably the repeated k's"
#: Refusals for want of static dims: with the inputs' static shapes (what ``k3opt compile`` gives) all lower.
SHAPES_ONLY = (HEADS, GQA)
EXPECT = {
    # the band of the sliding window is a mask like any other: passed as attn_mask, never is_causal
    "mistral_sliding": Expect(2, 2, 2, rotary=4),
    "mistral_sliding_eager": Expect(2, 2, 2, rotary=4),
    "gemma": Expect(2, 2, 2, rotary=4),
    # tanh(s / 50) * 50 between the scores and the Softmax: no fused op has it
    "gemma2": Expect(2, 0, 0, SOFTCAP, SOFTCAP, rotary=4),
    "gemma2_nocap": Expect(2, 2, 2, rotary=4),  # scale query_pre_attn_scalar^-1/2 = 0.25, not head_dim^-1/2
    "phi": Expect(2, 2, 2, rotary=4),  # partial rotary
    "phi3": Expect(2, 2, 2, rotary=4),
    "gpt_neox": Expect(2, 2, 2, rotary=4),
    # multi-query: q = RotaryEmbedding(Transpose(Split(fused QKV))) has no static head count for the
    # recogniser at opset 23 (so GQA's repeat is not proven); on cann the rotary is lowered after the
    # attention, which is recognised on the decomposed rotation and lowers
    "falcon": Expect(2, 0, 2, GQA, rotary=4),
    "opt": Expect(2, 2, 2),
    # ALiBi in a 3-D baddbmm, a Reshape between the Softmax and the probabilities' MatMul: not matched
    "bloom": Expect(2, 0, 0),
    "mixtral": Expect(2, 2, 2, rotary=4),
    "qwen2_moe": Expect(2, 2, 2, rotary=4),
    # relative position bias + padding mask added as one float tensor: a fully masked row's semantics
    # would differ (Attention zeroes it), so declined; cross-attention has the same bias form
    "t5": Expect(3, 0, 0, BIAS, BIAS),
    # cross-attention fused at opset 23; lowered on cann (TorchScript: dim tracing through the decoder's
    # Split proves the heads; dynamo still needs static shapes, see DYNAMO)
    "bart": Expect(3, 3, 3),
}

#: What differs for the dynamo exports: the lowering, run on dynamic shapes, cannot read these head counts
#: (k3opt compile's static input shapes give them).
DYNAMO = {"bart": dict(lowered=0, npu_why=HEADS)}


def expected(name: str, exporter: str) -> Expect:
    """:data:`EXPECT` for ``name``, with :data:`DYNAMO`'s changes for a dynamo export."""
    return dataclasses.replace(EXPECT[name], **DYNAMO.get(name, {})) if exporter == "dynamo" else EXPECT[name]


#: Families whose torchscript export runs in the default (non-slow) test run: the safety-critical forms.
FAST = ("mistral_sliding", "gemma2", "falcon", "t5", "bart")


def _cases() -> list:
    return [pytest.param(n, e, id=f"{n}-{e}", marks=[] if e == "torchscript" and n in FAST else [pytest.mark.slow])
            for n in EXPECT for e in ("torchscript", "dynamo")]


@needs_torch
@pytest.mark.parametrize("name, exporter", _cases())
def test_opset_23(name, exporter):
    expect, path, feeds = expected(name, exporter), family_model(name, exporter), family_inputs(name)
    report = Report()
    out = k3opt.optimize(str(path), opset=23, verify=True, input_data=feeds, report=report)
    assert report.verification["status"] == "passed", report.verification
    assert op_counts(out).get("Attention", 0) == expect.fused
    assert op_counts(out).get("RotaryEmbedding", 0) == expect.rotary
    declined = [n for n in report.notes if "attention(s) declined" in n]
    if expect.why:
        assert len(declined) == 1 and declined[0].startswith(f"{expect.attentions - expect.fused} attention(s) "
                                                             f"declined: {expect.why}"), report.notes
    else:
        assert declined == []
    original = onnx.load(str(path))
    assert_same_outputs(original, out, feeds)
    assert_same_outputs(original, out, left_padded(feeds))


@needs_torch
@pytest.mark.parametrize("name, exporter", _cases())
def test_target_cann(name, exporter):
    """Lowered and verified by the pipeline (the NPU reference ops against onnxruntime), also left-padded; with
    static input shapes where only dims were missing."""
    expect, path, feeds = expected(name, exporter), family_model(name, exporter), family_inputs(name)
    out, report = lowered(path, feeds)
    assert flash_attentions(out) == expect.lowered, report.lowering
    kept = [line for line in report.lowering if "kept decomposed" in line and "attention at" in line]
    assert len(kept) == (expect.attentions - expect.lowered if expect.npu_why else 0), report.lowering
    assert all(expect.npu_why in line for line in kept)
    out, report = lowered(path, left_padded(feeds))
    assert flash_attentions(out) == expect.lowered
    if expect.npu_why in SHAPES_ONLY:
        out, report = lowered(path, feeds, input_shapes={k: list(v.shape) for k, v in feeds.items()})
        assert flash_attentions(out) == expect.attentions, report.lowering


@needs_torch
def test_gemma2_scale_is_query_pre_attn_scalar():
    """Gemma2 scales by query_pre_attn_scalar^-1/2 (16 here), not head_dim^-1/2 (8)."""
    out = k3opt.optimize(str(family_model("gemma2_nocap")), opset=23)
    scales = [helper.get_attribute_value(a) for n in out.graph.node if n.op_type == "Attention"
              for a in n.attribute if a.name == "scale"]
    assert scales == pytest.approx([16 ** -0.5] * 2)


@needs_torch
@pytest.mark.slow
def test_sliding_window_without_a_mask_input_keeps_the_band(tmp_path):
    """Mistral exported with input_ids only (dynamo, static shapes): the sliding-window mask folds to a constant
    band (window 4 of 8 tokens, filled with the dtype's lowest), which is fused as attn_mask, not is_causal."""
    import torch

    hf = family_torch_model("mistral_sliding").hf
    path = tmp_path / "model.onnx"
    ids = torch.randint(1, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.onnx.export(_ids_only(hf), (ids,), str(path), input_names=["input_ids"], dynamo=True, optimize=False,
                      opset_version=18)
    original = onnx.load(str(path))  # weights inline (the exporter writes them aside)
    feeds = {"input_ids": ids.numpy()}
    report = Report()
    out = k3opt.optimize(original, opset=23, verify=True, input_data=feeds, report=report)
    assert report.verification["status"] == "passed", report.verification
    attentions = [n for n in out.graph.node if n.op_type == "Attention"]
    assert len(attentions) == 2 and "Softmax" not in op_counts(out), report.notes
    assert all(len(n.input) == 4 and all(a.name != "is_causal" or a.i == 0 for a in n.attribute)
               for n in attentions)
    assert_same_outputs(original, out, feeds)


def _ids_only(hf):
    """``hf`` as a module of ``input_ids`` alone (no attention_mask input: the mask is folded from the shapes)."""
    import torch

    class IdsOnly(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.hf = hf

        def forward(self, ids):
            return self.hf(input_ids=ids, use_cache=False).logits

    return IdsOnly().eval()


# -- the forms on hand-made graphs -----------------------------------------------------------------------------

def _band(window: int) -> np.ndarray:
    """Mistral's sliding-window keep mask: causal, and at most ``window`` keys back."""
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    return (j <= i) & (i - j < window)


@pytest.mark.parametrize("guard", [True, False])
def test_sliding_window_band_is_not_causal(guard):
    """A constant band (window 2 < 5 tokens) is fused with the band as attn_mask, never is_causal; every row
    keeps a key, so sdpa's IsNaN guard is not needed for exactness (with -inf, no row is NaN)."""
    out, node, _ = assert_fused(Attn(mask="causal", guard=guard, causal_value=_band(2)).model())
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs.get("is_causal", 0) == 0 and len(node.input) == 4


def test_constant_mask_with_a_fully_masked_row_needs_the_guard():
    """The band with its first row masked too: NaN in the unguarded graph, zeros in Attention: declined."""
    keep = _band(2)
    keep[0] = False
    assert_declined(Attn(mask="causal", guard=False, causal_value=keep).model(), "without the IsNaN guard")


def test_sliding_window_band_lowers_with_its_mask():
    """--target cann: the band becomes the flash attention's atten_mask (sparse_mode 0, not the causal mode 3)."""
    out, report = lower(Attn(mask="causal", guard=False, causal_value=_band(2), opset=17).model())
    (pfa,) = [n for n in out.graph.node if n.op_type == "NPUPromptFlashAttention"]
    attrs = {a.name: helper.get_attribute_value(a) for a in pfa.attribute}
    assert attrs["sparse_mode"] == 0 and pfa.input[4], report.lowering
    assert report.lowering_verification["status"] == "passed"


def test_sliding_window_wider_than_the_sequence_is_causal():
    """A window covering every key is the causal triangle: is_causal, as for Llama."""
    assert_fused(Attn(mask="causal", guard=False, causal_value=_band(S)).model(), is_causal=1)


def test_unscaled_attention_has_scale_one():
    """T5 multiplies no 1/sqrt(d): the op's scale is 1, not its default."""
    out, node, _ = assert_fused(Attn(scale=None).model())
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["scale"] == pytest.approx(1.0)


def test_logit_softcapping_is_declined():
    """Gemma2's tanh(s / c) * c between the scaled scores and the mask: not a scale, no fused op has it."""
    a = Attn(scale="mul", guard=False)
    add_at = next(i for i, n in enumerate(a.nodes) if n.op_type == "Add")
    add, first = a.nodes[add_at], len(a.nodes)
    cap = a.const(50.0)
    capped = a.op("Mul", a.op("Tanh", a.op("Div", add.input[0], cap)), cap)
    new = a.nodes[first:]
    del a.nodes[first:]
    a.nodes[add_at:add_at] = new  # before the Add that reads them (nodes stay in topological order)
    add.input[0] = capped
    assert_declined(a.model(), SOFTCAP)
