"""Models for the block and split tests: the zoo's transformers configs with 4 decoder layers (random weights,
fixed seed), exported by k3opt.export as prefill graphs and decode steps (KV cache in and out).

``split_model(name, decode=False)`` returns the path of a cached ``.onnx`` (the zoo's cache and file lock);
``split_inputs(name, decode=False)`` seeded numpy inputs for it. ``big_model(folder)`` writes a model
with external data by tiling random weights over one exported layer structure (for slow tests).
Names: ``llama``, ``qwen2``, ``gpt2``, ``deepseek_v3`` (MLA; layer 0 dense, layers 1..3 MoE).
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from . import zoo

NAMES = ("llama", "qwen2", "gpt2", "deepseek_v3")
DECODE_NAMES = ("llama", "qwen2", "gpt2")
LAYERS = 4
_HERE = Path(__file__).resolve()


def split_config(name: str) -> Any:
    """The zoo's config of ``name`` with :data:`LAYERS` layers."""
    base = zoo.zoo_config(name)
    values = {k: v for k, v in base.to_dict().items() if k not in ("layer_types", "mlp_layer_types")}
    values["n_layer" if name == "gpt2" else "num_hidden_layers"] = LAYERS
    config = type(base).from_dict(values)
    config._attn_implementation = base._attn_implementation
    return config


def _torch_model(name: str) -> Any:
    import torch
    import transformers as tf

    torch.manual_seed(zoo.SEED)
    hf = tf.AutoModelForCausalLM.from_config(split_config(name))
    with torch.no_grad():  # no zero bias, no unit norm scale (as the zoo does)
        gen = torch.Generator().manual_seed(zoo.SEED)
        for p in hf.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return hf.eval()


def split_model(name: str, decode: bool = False) -> Path:
    """Path of the cached 4-layer export of ``name`` (a decode step with the KV cache when ``decode``)."""
    zoo._require()
    key = hashlib.sha256(_HERE.read_bytes() + zoo.cache_key().encode()).hexdigest()[:12]
    target = zoo.cache_dir() / f"split-{name}{'-decode' if decode else ''}-{key}.onnx"

    def write(path: str) -> None:
        from k3opt.export import from_transformers

        options = dict(use_cache=True, seq_len=zoo.DECODE_EXAMPLE) if decode else dict(seq_len=zoo.TEXT_SEQ)
        from_transformers(_torch_model(name), path, exporter="torchscript", batch=zoo.BATCH, optimize=False,
                          **options)

    return zoo.build_cached(target, write)


def split_inputs(name: str, decode: bool = False, past: int = 5) -> dict[str, np.ndarray]:
    """Seeded inputs: the zoo's prefill inputs, or one decode step of 1 token after ``past`` cached ones."""
    if not decode:
        return zoo.zoo_inputs(name)
    config = split_config(name)
    rng = np.random.default_rng(zoo.SEED)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    mask = np.ones((zoo.BATCH, past + 1), dtype=np.int64)
    mask[1, :2] = 0
    feeds = {"input_ids": rng.integers(0, zoo.VOCAB, (zoo.BATCH, 1)).astype(np.int64), "attention_mask": mask}
    for layer in range(LAYERS):
        for part in ("key", "value"):
            feeds[f"past_key_values.{layer}.{part}"] = rng.standard_normal(
                (zoo.BATCH, kv_heads, past, config.hidden_size // heads)).astype(np.float32)
    return feeds
