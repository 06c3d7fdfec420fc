"""Decode-step exports (KV cache in and out) for the serving-pair tests, one per RoPE family and MoE family.

``llm_decode_model(name, exporter)`` is the path of a cached
``k3opt.export.from_transformers(use_cache=True, optimize=False)`` export:
``llama``, ``qwen2``, ``gpt2`` (learned positions) and ``deepseek_v3`` (MLA,
MoE) are the zoo's models (tests/zoo.py, same weights and cache file names);
``mixtral`` and ``qwen2_moe`` the families of tests/family_models.py.
``llm_torch_model(name)`` is the transformers model that was exported.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from tests.zoo import EXPORTERS, NAMES, _export, _require, build_cached, cache_dir, cache_key

ZOO_LLMS = ("llama", "qwen2", "gpt2", "deepseek_v3")
FAMILY_LLMS = ("mixtral", "qwen2_moe")
LLMS = ZOO_LLMS + FAMILY_LLMS
_HERE = Path(__file__).resolve()


def llm_params(names: tuple = LLMS) -> list:
    """``pytest.param(name, exporter)`` for every model; dynamo exports and the MoE families marked slow."""
    return [pytest.param(n, e, marks=[pytest.mark.slow] if e == "dynamo" or n in FAMILY_LLMS else [],
                         id=f"{n}-{e}") for n in names for e in EXPORTERS]


def llm_torch_model(name: str) -> Any:
    """The transformers model (eval, seeded weights) behind ``llm_decode_model(name, ...)``."""
    _require()
    if name in ZOO_LLMS:
        from tests.zoo import zoo_torch_model

        return zoo_torch_model(name).model
    from tests.family_models import family_torch_model

    return family_torch_model(name).hf


def llm_decode_model(name: str, exporter: str = "torchscript") -> Path:
    """Path of the cached decode-step export of ``name`` with ``exporter`` (exported on first use)."""
    _require()
    if name not in LLMS or exporter not in EXPORTERS:
        raise KeyError(f"no llm model {name!r}/{exporter!r}; names {LLMS}, exporters {EXPORTERS}")
    if name in ZOO_LLMS:  # the zoo's own file name: tests/zoo.py's zoo_decode_model writes the same bytes
        assert name in NAMES
        target = cache_dir() / f"{name}-decode-{exporter}-{cache_key()}.onnx"
        return build_cached(target, lambda tmp: _export(name, exporter, tmp, use_cache=True, seq_len=3))
    key = hashlib.sha256(cache_key().encode() + _HERE.read_bytes()).hexdigest()[:16]
    target = cache_dir() / f"llm-{name}-decode-{exporter}-{key}.onnx"

    def write(tmp: str) -> None:
        from k3opt.export import from_transformers

        from_transformers(llm_torch_model(name), tmp, exporter=exporter, batch=2, seq_len=3, use_cache=True,
                          optimize=False)

    return build_cached(target, write)
