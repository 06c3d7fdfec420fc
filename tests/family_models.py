"""Tiny random-weight transformers of families the zoo does not export, for the attention and RoPE fusions.

``family_model(name, exporter)`` is the path of a cached ONNX export (no
optimization), ``family_inputs(name)`` seeded numpy inputs for it (batch 2,
sequence 8, the second row padded at the end so the mask matters).

Every family stresses what the zoo's do not: a banded mask (Mistral's sliding
window of 4 < 8 tokens), logit softcapping and ``query_pre_attn_scalar``
(Gemma2), partial rotary (Phi, Phi3, GPT-NeoX), multi-query (Falcon), ALiBi
(Bloom), MoE (Mixtral, Qwen2-MoE), a relative position bias with no ``1/sqrt(d)`` (T5), and
cross-attention (BART, T5's decoder). Encoder-decoders are exported as
``(input_ids, attention_mask, decoder_input_ids) -> logits``.

The cache (``family-*`` files in the zoo's cache folder) is keyed by the zoo's
key and this file; tests/zoo.py is not touched (its hash keys everyone's zoo cache).
"""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any, Callable

import numpy as np

from tests.zoo import BATCH, SEED, TEXT_SEQ, VOCAB, _require, build_cached, cache_dir, cache_key

_HERE = Path(__file__).resolve()

_TEXT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=VOCAB,
             max_position_embeddings=64, use_cache=False, tie_word_embeddings=False)


@dataclasses.dataclass(frozen=True)
class Family:
    """How to configure one family: ``config()`` builds its transformers config, ``seq2seq`` for encoder-decoders."""

    config: Callable[[], Any]
    seq2seq: bool = False
    attn: str = "sdpa"


def _families() -> dict[str, Family]:
    import transformers as tf

    return {
        "mistral_sliding": Family(lambda: tf.MistralConfig(num_key_value_heads=2, sliding_window=4, **_TEXT)),
        "mistral_sliding_eager": Family(lambda: tf.MistralConfig(num_key_value_heads=2, sliding_window=4, **_TEXT),
                                        attn="eager"),
        "gemma": Family(lambda: tf.GemmaConfig(num_key_value_heads=2, head_dim=8, **_TEXT)),
        "gemma2": Family(lambda: tf.Gemma2Config(
            num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=16, attn_logit_softcapping=50.0,
            final_logit_softcapping=None, sliding_window=4, **_TEXT), attn="eager"),
        "gemma2_nocap": Family(lambda: tf.Gemma2Config(
            num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=16, attn_logit_softcapping=None,
            final_logit_softcapping=None, sliding_window=4, **_TEXT), attn="eager"),
        "phi": Family(lambda: tf.PhiConfig(partial_rotary_factor=0.5, **_TEXT)),
        "phi3": Family(lambda: tf.Phi3Config(num_key_value_heads=2, partial_rotary_factor=0.5, pad_token_id=0,
                                             **_TEXT)),
        "gpt_neox": Family(lambda: tf.GPTNeoXConfig(rotary_pct=0.25, **_TEXT)),
        "falcon": Family(lambda: tf.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                 vocab_size=VOCAB, use_cache=False)),
        "opt": Family(lambda: tf.OPTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                                           word_embed_proj_dim=32, vocab_size=VOCAB, max_position_embeddings=64,
                                           use_cache=False)),
        "bloom": Family(lambda: tf.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=VOCAB,
                                               use_cache=False), attn="eager"),
        "mixtral": Family(lambda: tf.MixtralConfig(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                                   experts_implementation="batched_mm", **_TEXT)),
        "qwen2_moe": Family(lambda: tf.Qwen2MoeConfig(
            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, experts_implementation="batched_mm", **_TEXT)),
        "t5": Family(lambda: tf.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4,
                                         vocab_size=VOCAB, relative_attention_num_buckets=8, use_cache=False,
                                         decoder_start_token_id=0, pad_token_id=0), seq2seq=True),
        "bart": Family(lambda: tf.BartConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                                             decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                             vocab_size=VOCAB, max_position_embeddings=64, use_cache=False),
                       seq2seq=True),
    }


def input_names(name: str) -> list[str]:
    """Graph inputs: ids and mask, plus ``decoder_input_ids`` for an encoder-decoder."""
    seq2seq = _families()[name].seq2seq
    return ["input_ids", "attention_mask"] + (["decoder_input_ids"] if seq2seq else [])


def family_inputs(name: str, batch: int = BATCH, seq: int = TEXT_SEQ, seed: int = SEED) -> dict[str, np.ndarray]:
    """Seeded inputs; row 1's mask pads its last 3 positions (the decoder of an encoder-decoder gets seq - 2 ids)."""
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, seq), dtype=np.int64)
    mask[1, -3:] = 0
    feeds = {"input_ids": rng.integers(1, VOCAB, (batch, seq)).astype(np.int64), "attention_mask": mask}
    if "decoder_input_ids" in input_names(name):
        feeds["decoder_input_ids"] = rng.integers(1, VOCAB, (batch, seq - 2)).astype(np.int64)
    return feeds


def family_torch_model(name: str) -> Any:
    """The torch module exported as family ``name``: eval mode, seeded random weights (noise on every parameter, so
    no bias is zero and no norm scale one), positional inputs (:func:`input_names`), logits out."""
    _require()
    import torch
    import transformers as tf

    fam = _families()[name]
    torch.manual_seed(SEED)
    auto = tf.AutoModelForSeq2SeqLM if fam.seq2seq else tf.AutoModelForCausalLM
    hf = auto.from_config(fam.config(), attn_implementation=fam.attn)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(SEED)
        for p in hf.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return _logits_module()(hf).eval()


def _logits_module() -> type:
    import torch

    class Logits(torch.nn.Module):
        """``hf(...).logits`` on positional tensors (named parameters: the dynamo exporter maps dims by name)."""

        def __init__(self, hf: Any) -> None:
            super().__init__()
            self.hf = hf

        def forward(self, input_ids: Any, attention_mask: Any, decoder_input_ids: Any = None) -> Any:
            extra = {} if decoder_input_ids is None else {"decoder_input_ids": decoder_input_ids}
            return self.hf(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra).logits

    return Logits


def _cache_key() -> str:
    """The zoo's key (tests/zoo.py, k3opt/export, torch/transformers versions) with this file's bytes."""
    return hashlib.sha256(cache_key().encode() + _HERE.read_bytes()).hexdigest()[:16]


def family_model(name: str, exporter: str = "torchscript") -> Path:
    """Path of the cached ONNX export of family ``name`` (dynamic batch and sequence axes), exported on first use."""
    _require()
    if name not in _families():
        raise KeyError(f"no family {name!r}; choose one of {', '.join(_families())}")
    target = cache_dir() / f"family-{name}-{exporter}-{_cache_key()}.onnx"
    return build_cached(target, lambda tmp: _export(name, exporter, tmp))


def _export(name: str, exporter: str, path: str) -> None:
    import torch

    from k3opt.export.exporters import export_onnx

    names = input_names(name)
    feeds = family_inputs(name)
    axes = {n: {0: "batch", 1: "decoder_sequence" if n.startswith("decoder") else "sequence"} for n in names}
    export_onnx(family_torch_model(name), tuple(torch.from_numpy(feeds[n]) for n in names), path,
                input_names=names, output_names=["logits"], dynamic_axes=axes, exporter=exporter)
