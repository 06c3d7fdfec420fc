"""k3opt.cann_bridge: from an optimized ONNX model to an Ascend ``.om`` through Huawei's ATC (docs/cann.md).

- :func:`lower`: the NPU lowerings of ``--target cann`` (called by the core pipeline after verification).
- :func:`compile_model`: optimize for cann, pre-flight check, run ATC (``k3opt compile``).
- :func:`check_model`: what ATC will refuse in a model (``k3opt check --target cann``).
"""
from __future__ import annotations

from .atc_command import AtcOptions, build_command
from .atc_locate import find_atc
from .compat import Finding, check_model
from .compile import AtcUnavailable, CompileResult, compile_model
from .lowering import invariant_violations, lower

__all__ = [
    "AtcOptions",
    "AtcUnavailable",
    "CompileResult",
    "Finding",
    "build_command",
    "check_model",
    "compile_model",
    "find_atc",
    "invariant_violations",
    "lower",
]
