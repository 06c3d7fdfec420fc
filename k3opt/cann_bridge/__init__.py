"""k3opt.cann_bridge: from an optimized ONNX model to an Ascend ``.om`` through Huawei's ATC (docs/cann.md).

- The NPU lowerings of ``--target cann`` are passes (``lower-rmsnorm-npu``, ``lower-attention-npu``,
  ``lower-rotary-npu``) that the core pipeline runs after its verification; :func:`finish_model` puts the result in the target's
  form and checks :func:`invariant_violations`; :mod:`k3opt.targets.cann.reference` runs the NPU ops in numpy.
- :func:`compile_model`: optimize for cann, pre-flight check, run ATC (``k3opt compile``).
- :func:`check_model`: what ATC will refuse in a model (``k3opt check --target cann``).
"""
from __future__ import annotations

from .atc_command import AtcOptions, build_command
from .atc_locate import find_atc
from ..targets.cann.compat import Finding, check_model
from .compile import AtcUnavailable, CompileResult, compile_model
from ..targets.cann.target_form import finish_model, invariant_violations

__all__ = [
    "AtcOptions",
    "AtcUnavailable",
    "CompileResult",
    "Finding",
    "build_command",
    "check_model",
    "compile_model",
    "find_atc",
    "finish_model",
    "invariant_violations",
]
