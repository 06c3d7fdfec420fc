"""numpy reference ops for the NPU ops the cann target emits; :func:`evaluator` runs a lowered model with them.

Each op is an ``onnx.reference`` ``OpRun`` class in a module of this package, registered by
``@reference_op("OpType")`` (:mod:`.registry`); add an op by adding a module.
"""
from __future__ import annotations

from .registry import ReferenceError, evaluator, reference_op, reference_ops

__all__ = ["ReferenceError", "evaluator", "reference_op", "reference_ops"]
