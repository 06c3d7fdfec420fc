"""Tiny random-weight MoE and MLA models (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3) for the MLA and MoE lowerings.

``moe_model(name, exporter)`` is the path of a cached ONNX prefill export (k3opt.export, no optimization),
``moe_decode_model(name, exporter)`` of one KV-cache decoding step; ``moe_inputs`` / ``moe_decode_inputs``
seeded numpy inputs for them. Every model is built from its transformers config with seeded noise on every
parameter (tests/zoo.py's ``zoo_torch_model`` way), with the config's default experts: the exports rely on
``k3opt.export`` switching them to transformers' exportable ``batched_mm`` (so every export tests that switch).

The cache (``moe-*`` files in the zoo's cache folder) is keyed by the zoo's key and this file; tests/zoo.py
is not touched (its hash keys everyone's zoo cache).
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Callable

import numpy as np

from tests.zoo import BATCH, SEED, TEXT_SEQ, VOCAB, _require, build_cached, cache_dir, cache_key

_HERE = Path(__file__).resolve()
_DECODER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=VOCAB,
                max_position_embeddings=64, use_cache=False, tie_word_embeddings=False)
EXPORTERS = ("torchscript", "dynamo")
#: past and new tokens of a decode export's example (the dynamo exporter would fix a size-1 dim)
DECODE_EXAMPLE = 3


def _configs() -> dict[str, Callable[[], Any]]:
    import transformers as tf

    return {
        "mixtral": lambda: tf.MixtralConfig(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                            **_DECODER),
        "qwen2_moe": lambda: tf.Qwen2MoeConfig(
            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, norm_topk_prob=False,
            **_DECODER),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(
            num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=True, **_DECODER),
        # the zoo's deepseek_v3 (MLA with q/kv LoRA, qk 12 / v 8, group-limited gate, layer 0 dense)
        "deepseek_v3": lambda: tf.DeepseekV3Config(
            num_key_value_heads=4, moe_intermediate_size=16, q_lora_rank=24, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, head_dim=4, n_routed_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
            **_DECODER),
    }


NAMES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")


def moe_config(name: str) -> Any:
    """The transformers config of model ``name``."""
    _require()
    if name not in NAMES:
        raise KeyError(f"no MoE model {name!r}; choose one of {', '.join(NAMES)}")
    return _configs()[name]()


def moe_torch_model(name: str) -> Any:
    """The causal LM (eval mode): seeded random weights with seeded noise on every parameter."""
    _require()
    import torch
    import transformers as tf

    torch.manual_seed(SEED)
    hf = tf.AutoModelForCausalLM.from_config(moe_config(name))
    with torch.no_grad():
        gen = torch.Generator().manual_seed(SEED)
        for p in hf.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return hf.eval()


def _key() -> str:
    return hashlib.sha256(cache_key().encode() + _HERE.read_bytes()).hexdigest()[:16]


def moe_model(name: str, exporter: str = "torchscript") -> Path:
    """Path of the cached prefill export (logits from ids and mask; dynamic batch and sequence)."""
    moe_config(name)
    target = cache_dir() / f"moe-{name}-{exporter}-{_key()}.onnx"
    return build_cached(target, lambda tmp: _export(name, exporter, tmp))


def moe_decode_model(name: str, exporter: str = "torchscript") -> Path:
    """Path of the cached decode-step export (KV cache in and out, as k3opt.export's ``use_cache=True`` writes it)."""
    moe_config(name)
    target = cache_dir() / f"moe-{name}-decode-{exporter}-{_key()}.onnx"
    return build_cached(target, lambda tmp: _export(name, exporter, tmp, use_cache=True, seq_len=DECODE_EXAMPLE))


def _export(name: str, exporter: str, path: str, **options: Any) -> None:
    from k3opt.export import from_transformers

    from_transformers(moe_torch_model(name), path, exporter=exporter, batch=BATCH,
                      seq_len=options.pop("seq_len", TEXT_SEQ), optimize=False, **options)


def moe_inputs(name: str, batch: int = BATCH, seq: int = TEXT_SEQ, seed: int = SEED) -> dict[str, np.ndarray]:
    """Seeded prefill inputs; row 1's mask pads its last 3 positions."""
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, seq), dtype=np.int64)
    mask[1, -3:] = 0
    return {"input_ids": rng.integers(0, VOCAB, (batch, seq)).astype(np.int64), "attention_mask": mask}


def cache_shapes(name: str) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(heads, _, dim) of one layer's cached key and value, past length left out: ``(heads, dim)`` pairs.

    MLA caches its compressed latents, one head each: the normed kv latent (kv_lora_rank) as the "key" and the
    rotated shared key (qk_rope_head_dim) as the "value"."""
    c = moe_config(name)
    if name == "deepseek_v3":
        return (1, c.kv_lora_rank), (1, c.qk_rope_head_dim)  # type: ignore[return-value]
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return (c.num_key_value_heads, head_dim), (c.num_key_value_heads, head_dim)  # type: ignore[return-value]


def moe_decode_inputs(name: str, past: int = 6, new: int = 1, batch: int = BATCH,
                      seed: int = SEED) -> dict[str, np.ndarray]:
    """Seeded inputs of one decode step: ``new`` tokens after a cache of ``past`` random entries; row 1 is
    left-padded (its first ``min(3, past - 1)`` positions masked)."""
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, past + new), dtype=np.int64)
    if batch > 1 and past > 1:
        mask[1, :min(3, past - 1)] = 0
    feeds = {"input_ids": rng.integers(0, VOCAB, (batch, new)).astype(np.int64), "attention_mask": mask}
    (kh, kd), (vh, vd) = cache_shapes(name)
    for layer in range(moe_config(name).num_hidden_layers):
        feeds[f"past_key_values.{layer}.key"] = rng.standard_normal((batch, kh, past, kd)).astype(np.float32)
        feeds[f"past_key_values.{layer}.value"] = rng.standard_normal((batch, vh, past, vd)).astype(np.float32)
    return feeds


def traced_eager_model(name: str) -> Path:
    """The export trap: transformers' eager experts loop traced by TorchScript on ONE token (ids and mask, dynamic
    batch and sequence axes): the graph keeps only the experts that token hit."""
    moe_config(name)
    target = cache_dir() / f"moe-{name}-traced-eager-{_key()}.onnx"
    return build_cached(target, lambda tmp: _trace_eager(name, tmp))


def _trace_eager(name: str, path: str) -> None:
    import torch

    hf = moe_torch_model(name)
    hf.config._experts_implementation = "eager"

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.hf = hf

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            return self.hf(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    ids = torch.tensor([[5]])
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"}}
    with torch.no_grad():
        torch.onnx.export(Logits().eval(), (ids, torch.ones_like(ids)), path, dynamo=False,
                          input_names=["input_ids", "attention_mask"], output_names=["logits"], dynamic_axes=axes)
