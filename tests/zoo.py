"""The shared test model zoo: tiny transformers models (random weights, fixed seed) exported to ONNX.

``zoo_model(name, exporter)`` returns the path of a cached ``.onnx``;
``zoo_inputs(name)`` numpy inputs for it (batch 2, sequence 8, the second row
padded so the attention mask matters); ``zoo_torch_model(name)`` the torch
module that was exported (same weights), taking the same inputs positionally.
``zoo_decode_model``/``zoo_decode_inputs``/``decode_torch_outputs`` are the
same for one decoding step with the KV cache (``DECODE_NAMES``; see that block).

Names: ``bert``, ``gpt2``, ``llama`` (GQA: 2 KV heads for 4 heads), ``qwen2``
(QKV bias, GQA), ``deepseek_v3`` (the Kimi K2 architecture: MLA with
q_lora_rank/kv_lora_rank, MoE with shared + routed experts, layer 0 dense and
layer 1 MoE), ``vit``. Exporters: ``torchscript`` (opset 14, LayerNorm
decomposed) and ``dynamo`` (opset 18, optimize=False). Every model has a
dynamic batch axis; text models a dynamic sequence axis too.

Notes on what it takes for these to export (transformers 5.x, torch 2.13):
MoE experts use ``experts_implementation="batched_mm"`` (the default
grouped_mm path uses ``aten::histc``, which the TorchScript exporter lacks, and
a custom op the dynamo exporter cannot translate; the eager loop would bake the
example's routing into a traced graph). The export itself is
``k3opt.export.from_transformers(..., optimize=False)``, whose padded example
mask keeps the mask in the TorchScript trace (see its module doc).

The cache lives in ``$K3OPT_ZOO_CACHE`` (default ``~/.cache/k3opt-zoo``),
keyed by a hash of this file, k3opt/export/*.py and the torch and
transformers versions; a file lock per model keeps parallel pytest workers
from exporting the same model twice or reading a half-written file.

Tests using the zoo are skipped cleanly without torch/transformers: decorate
them with ``needs_torch`` (or just call the functions: they skip).
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import pytest

NAMES = ("bert", "gpt2", "llama", "qwen2", "deepseek_v3", "vit")
EXPORTERS = ("torchscript", "dynamo")
TEXT_SEQ, BATCH, VOCAB, IMAGE = 8, 2, 100, 16
SEED = 0

HAVE_TORCH = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
NO_TORCH = "torch and transformers not installed (pip install 'k3opt[export]')"
needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason=NO_TORCH)

_HERE = Path(__file__).resolve()
_EXPORT_PKG = _HERE.parent.parent / "k3opt" / "export"


def zoo_params() -> list:
    """``pytest.param(name, exporter)`` for every zoo pair (ids ``bert-torchscript``...); dynamo ones marked slow."""
    return [pytest.param(n, e, marks=[pytest.mark.slow] if e == "dynamo" else [], id=f"{n}-{e}")
            for n in NAMES for e in EXPORTERS]


def max_rel_err(got: Sequence[np.ndarray], want: Sequence[np.ndarray]) -> float:
    """Largest ``max|got - want| / max|want|`` over paired outputs."""
    return max(float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-12)) for g, w in zip(got, want))


def _require() -> None:
    if not HAVE_TORCH:
        pytest.skip(NO_TORCH)


def zoo_config(name: str) -> Any:
    """The transformers config of zoo model ``name`` (tiny: hidden 32, 2 layers, vocab 100)."""
    _require()
    import transformers as tf

    text = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                vocab_size=VOCAB, max_position_embeddings=64)
    decoder = dict(text, use_cache=False, tie_word_embeddings=False)
    configs = {
        "bert": lambda: tf.BertConfig(**text),
        "gpt2": lambda: tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64,
                                      use_cache=False),
        "llama": lambda: tf.LlamaConfig(num_key_value_heads=2, **decoder),
        "qwen2": lambda: tf.Qwen2Config(num_key_value_heads=2, **decoder),
        "deepseek_v3": lambda: tf.DeepseekV3Config(
            num_key_value_heads=4, moe_intermediate_size=16, q_lora_rank=24, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, head_dim=4, n_routed_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
            experts_implementation="batched_mm", **decoder),
        "vit": lambda: tf.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                    image_size=IMAGE, patch_size=8, num_channels=3),
    }
    if family(name) not in configs:
        raise KeyError(f"no zoo model {name!r}; choose one of {', '.join(NAMES + EAGER_NAMES)}")
    config = configs[family(name)]()
    if name in EAGER_NAMES:
        config._attn_implementation = "eager"
    return config


def input_names(name: str) -> list[str]:
    """Graph input names of zoo model ``name``."""
    return ["pixel_values"] if family(name) == "vit" else ["input_ids", "attention_mask"]


def output_names(name: str) -> list[str]:
    """Graph output names of zoo model ``name``."""
    return ["last_hidden_state", "pooler_output"] if family(name) in ("bert", "vit") else ["logits"]


def zoo_inputs(name: str, batch: int = BATCH, seq: int = TEXT_SEQ, seed: int = SEED) -> dict[str, np.ndarray]:
    """Seeded numpy inputs for zoo model ``name``; row 1 of a text model's mask pads its last 3 positions."""
    rng = np.random.default_rng(seed)
    if family(name) == "vit":
        return {"pixel_values": rng.standard_normal((batch, 3, IMAGE, IMAGE)).astype(np.float32)}
    mask = np.ones((batch, seq), dtype=np.int64)
    if batch > 1:
        mask[1, -3:] = 0
    return {"input_ids": rng.integers(0, VOCAB, (batch, seq)).astype(np.int64), "attention_mask": mask}


def zoo_torch_model(name: str) -> Any:
    """The torch module exported as zoo model ``name``: eval mode, seeded random weights, positional inputs.

    Every parameter gets seeded noise on top of transformers' initialization,
    so no bias is zero and no norm scale is one (numerics would hide a lost bias).

    It is k3opt.export's ``TaskModule`` around the transformers model (``.model``).
    """
    _require()
    import torch
    import transformers as tf

    from k3opt.export.task_module import TaskModule

    config = zoo_config(name)
    torch.manual_seed(SEED)
    if family(name) == "bert":
        hf = tf.BertModel(config)
    elif family(name) == "vit":
        hf = tf.ViTModel(config)
    else:
        hf = tf.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # transformers initializes biases to 0 and norm scales to 1: a fusion dropping one would pass
        gen = torch.Generator().manual_seed(SEED)
        for p in hf.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return TaskModule(hf, tuple(input_names(name)), tuple(output_names(name))).eval()


def torch_outputs(name: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Outputs of the torch model for ``feeds`` (numpy in, numpy out), in graph output order."""
    import torch

    model = zoo_torch_model(name)
    with torch.no_grad():
        out = model(*(torch.from_numpy(feeds[n]) for n in input_names(name)))
    return [t.numpy() for t in (out if isinstance(out, tuple) else (out,))]


def cache_dir() -> Path:
    """Where exported zoo models are cached."""
    return Path(os.environ.get("K3OPT_ZOO_CACHE") or Path.home() / ".cache" / "k3opt-zoo")


def cache_key() -> str:
    """Hash of what decides the exported bytes: this file, k3opt/export, torch/transformers versions."""
    import torch
    import transformers

    h = hashlib.sha256(_HERE.read_bytes())
    for source in sorted(_EXPORT_PKG.glob("*.py")):
        h.update(source.read_bytes())
    h.update(f"{torch.__version__}|{transformers.__version__}".encode())
    return h.hexdigest()[:16]


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def zoo_model(name: str, exporter: str = "torchscript") -> Path:
    """Path of the cached ONNX export of zoo model ``name`` with ``exporter`` (exported on first use)."""
    _require()
    if name not in NAMES + EAGER_NAMES or exporter not in EXPORTERS:
        raise KeyError(f"no zoo model {name!r}/{exporter!r}; names {NAMES + EAGER_NAMES}, exporters {EXPORTERS}")
    target = cache_dir() / f"{name}-{exporter}-{cache_key()}.onnx"
    return build_cached(target, lambda tmp: _export(name, exporter, tmp))


def _export(name: str, exporter: str, path: str, **options: Any) -> None:
    """Export zoo model ``name`` to ``path`` (k3opt.export, optimize=False); ``options`` go to from_transformers."""
    from k3opt.export import from_transformers

    from_transformers(zoo_torch_model(name).model, path, exporter=exporter, batch=BATCH,
                      seq_len=options.pop("seq_len", TEXT_SEQ), optimize=False, **options)


def build_cached(target: Path, write: Callable[[str], None]) -> Path:
    """``target``, written by ``write(temp path)`` unless cached: a file lock, a temp file renamed into place."""
    if target.exists():
        return target
    with _locked(target.with_suffix(".lock")):
        if target.exists():
            return target
        fd, tmp = tempfile.mkstemp(suffix=".onnx", dir=target.parent)
        os.close(fd)
        try:
            write(tmp)
            os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is shared
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


# ----------------------------------------------------------------------------- decode steps (KV cache)
# One decoding step with the KV cache as plain tensors, k3opt.export's ``use_cache=True`` form:
# inputs ``input_ids`` (batch, sequence) -- the new tokens --, ``attention_mask`` (batch, total_sequence)
# over past + new, ``past_key_values.{layer}.key|value`` (batch, kv heads, past_sequence, head dim);
# outputs ``logits`` and ``present.{layer}.key|value`` (past + new long). All four axes are dynamic.
# The export's example has 3 past and 3 new tokens (the dynamo exporter would fix a size-1 dim), so
# one graph serves a one-token step (new=1) and a prefill with past (new > 1).

DECODE_NAMES = ("gpt2", "llama", "qwen2")
DECODE_EXAMPLE = 3  # past and new tokens of the export's example


def _require_decode(name: str, exporter: str = "torchscript") -> None:
    _require()
    if name not in DECODE_NAMES or exporter not in EXPORTERS:
        raise KeyError(f"no decode zoo model {name!r}/{exporter!r}; names {DECODE_NAMES}, exporters {EXPORTERS}")


def zoo_decode_params() -> list:
    """``pytest.param(name, exporter)`` for every decode model (ids ``llama-torchscript``...); dynamo ones slow."""
    return [pytest.param(n, e, marks=[pytest.mark.slow] if e == "dynamo" else [], id=f"{n}-{e}")
            for n in DECODE_NAMES for e in EXPORTERS]


def zoo_decode_model(name: str, exporter: str = "torchscript") -> Path:
    """Path of the cached decode-step export (KV cache in and out) of zoo model ``name``."""
    _require_decode(name, exporter)
    target = cache_dir() / f"{name}-decode-{exporter}-{cache_key()}.onnx"
    return build_cached(target, lambda tmp: _export(name, exporter, tmp, use_cache=True, seq_len=DECODE_EXAMPLE))


def zoo_one_token_decode_model(name: str) -> Path:
    """The decode step of ``name`` exported by TorchScript with a static one-token query: ``input_ids`` is
    (batch, 1), batch and the cache lengths dynamic (another recipe than :func:`zoo_decode_model`'s, whose
    query length is dynamic: the trace keeps the 1, as a serving export for token-by-token generation does)."""
    _require_decode(name)
    target = cache_dir() / f"{name}-decode1-torchscript-{cache_key()}.onnx"
    return build_cached(target, lambda tmp: _export_one_token(name, tmp))


def _export_one_token(name: str, path: str) -> None:
    import torch

    from k3opt.export.task_module import CachedCausalLM, prefix_cache

    hf = zoo_torch_model(name).model
    past = prefix_cache(hf, torch.randint(0, VOCAB, (BATCH, DECODE_EXAMPLE)))
    names = decode_input_names(name)
    axes = {"input_ids": {0: "batch"}, "attention_mask": {0: "batch", 1: "total_sequence"}}
    axes.update({n: {0: "batch", 2: "past_sequence"} for n in names[2:]})
    example = (torch.randint(0, VOCAB, (BATCH, 1)), torch.ones(BATCH, DECODE_EXAMPLE + 1, dtype=torch.int64),
               tuple(past))
    with torch.no_grad():
        torch.onnx.export(CachedCausalLM(hf).eval(), example, path, input_names=names,
                          output_names=decode_output_names(name), dynamic_axes=axes, opset_version=14, dynamo=False)


def decode_input_names(name: str) -> list[str]:
    """Graph input names of decode model ``name``: ids, mask, then each layer's past key and value."""
    layers = zoo_config(name).num_hidden_layers
    return ["input_ids", "attention_mask",
            *(f"past_key_values.{i}.{part}" for i in range(layers) for part in ("key", "value"))]


def decode_output_names(name: str) -> list[str]:
    """Graph output names of decode model ``name``: logits, then each layer's present key and value."""
    return ["logits", *(n.replace("past_key_values.", "present.") for n in decode_input_names(name)[2:])]


def zoo_decode_inputs(name: str, past: int = 6, new: int = 1, batch: int = BATCH,
                      seed: int = SEED) -> dict[str, np.ndarray]:
    """Seeded inputs of one decode step: ``new`` tokens after a cache of ``past`` (random keys/values).

    Row 1 is left-padded, as batched generation pads a decoder-only model: the
    mask's first ``min(3, past - 1)`` positions (all in the past) are 0, so the
    new tokens still see some past and the mask matters.
    """
    _require_decode(name)
    config = zoo_config(name)
    rng = np.random.default_rng(seed)
    heads = config.num_attention_heads
    kv_heads, head_dim = getattr(config, "num_key_value_heads", None) or heads, config.hidden_size // heads
    mask = np.ones((batch, past + new), dtype=np.int64)
    if batch > 1 and past > 1:
        mask[1, :min(3, past - 1)] = 0
    feeds = {"input_ids": rng.integers(0, VOCAB, (batch, new)).astype(np.int64), "attention_mask": mask}
    for cache in decode_input_names(name)[2:]:
        feeds[cache] = rng.standard_normal((batch, kv_heads, past, head_dim)).astype(np.float32)
    return feeds


def decode_torch_outputs(name: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Outputs of the torch decode step for ``feeds`` (numpy in and out), in graph output order."""
    import torch

    from k3opt.export.task_module import CachedCausalLM

    model = CachedCausalLM(zoo_torch_model(name).model).eval()
    tensors = [torch.from_numpy(feeds[n].copy()) for n in decode_input_names(name)]
    with torch.no_grad():
        out = model(tensors[0], tensors[1], tuple(tensors[2:]))
    return [t.numpy() for t in out]
# ----------------------------------------------------------------------------- end of decode steps


# ----------------------------------------------------------------------------- eager attention
# ``<family>_eager``: the same model (same weights and inputs) with transformers' eager attention
# (``attn_implementation="eager"``: MatMul, scale, additive float mask, Softmax, MatMul) instead of
# the default ``sdpa``, whose exported decomposition differs (split scale, -inf mask, IsNaN guard).

EAGER_NAMES = tuple(f"{n}_eager" for n in NAMES)


def family(name: str) -> str:
    """The model family of a zoo name (``llama_eager`` -> ``llama``)."""
    return name[:-len("_eager")] if name in EAGER_NAMES else name


def zoo_attention_params() -> list:
    """``pytest.param(name, exporter)`` for every zoo pair, sdpa and eager; dynamo ones marked slow."""
    return [pytest.param(n, e, marks=[pytest.mark.slow] if e == "dynamo" else [], id=f"{n}-{e}")
            for n in NAMES + EAGER_NAMES for e in EXPORTERS]
# ----------------------------------------------------------------------------- end of eager attention
