"""The LLM serving pair: a prefill graph and a static-shape decode graph over a fixed KV cache (docs/llm.md).

``build_pair`` writes one from a decode-step export or a transformers
checkpoint; ``PairRunner`` generates through it; ``original_greedy`` is the
reference loop it must equal token for token.
"""
from __future__ import annotations

from .cache_form import CacheLayout, recognise
from .generate import PairRunner, left_pad, original_greedy
from .manifest import Manifest
from .pair import build_pair
from .rewrite import decode_graph, prefill_graph

__all__ = ["CacheLayout", "Manifest", "PairRunner", "build_pair", "decode_graph", "left_pad", "original_greedy",
           "prefill_graph", "recognise"]
