"""The standard ONNX target (the default): every trait and hook is :class:`~k3opt.targets.base.Target`'s."""
from __future__ import annotations

from .base import Target


class OnnxTarget(Target):
    name = "onnx"
    summary = "standard ONNX"
    default = True


TARGET = OnnxTarget()
