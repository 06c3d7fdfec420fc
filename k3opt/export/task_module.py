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
