"""The torch wrapper that turns a transformers model into what the exporters take (imports torch)."""
from __future__ import annotations

from typing import Any

import torch


class TaskModule(torch.nn.Module):
    """Runs a transformers model on positional inputs and returns plain tensors (what the exporters want)."""

    def __init__(self, model: Any, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> None:
        super().__init__()
        self.model, self.inputs, self.outputs = model, tuple(inputs), tuple(outputs)

    def forward(self, first: Any, second: Any = None) -> Any:
        out = self.model(**{k: v for k, v in zip(self.inputs, (first, second)) if v is not None})
        values = tuple(out[k] for k in self.outputs)
        return values[0] if len(values) == 1 else values

    def present_outputs(self, inputs: tuple[Any, ...]) -> tuple[str, ...]:
        """The task's outputs this model actually returns (e.g. BERT without pooler has no pooler_output)."""
        with torch.no_grad():
            out = self.model(**dict(zip(self.inputs, inputs)))
        return tuple(k for k in self.outputs if out.get(k) is not None)


class CachedCausalLM(torch.nn.Module):
    """A causal LM whose KV cache is plain tensors: ``(input_ids, attention_mask, past) -> (logits, *present)``.

    ``past`` is the tuple ``(layer0 key, layer0 value, layer1 key, ...)`` of
    whatever the model caches (for MLA the compressed latents), so the ONNX
    graph has one input and one output per cached tensor.
    """

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, past: tuple) -> tuple:
        from transformers import DynamicCache

        cache = DynamicCache(ddp_cache_data=list(zip(past[0::2], past[1::2])), config=self.model.config)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, cache=cache)
        return (out["logits"], *flat_cache(out["past_key_values"]))


def flat_cache(cache: Any) -> list[torch.Tensor]:
    """A transformers cache as ``[layer0 key, layer0 value, layer1 key, ...]``."""
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


def prefix_cache(model: Any, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """The flat KV cache the model builds for ``input_ids`` (the example ``past`` of an export)."""
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=True)
    return flat_cache(out["past_key_values"])
