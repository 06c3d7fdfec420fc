"""numpy reference ops for the NPU ops the cann target emits (:func:`evaluator` runs a lowered model)."""
from __future__ import annotations

from .npu_ops import REFERENCE_OPS, ReferenceError, evaluator

__all__ = ["REFERENCE_OPS", "ReferenceError", "evaluator"]
