"""k3opt: a graph-optimization compiler for ONNX transformer models headed for Ascend NPUs.

The root is light: the errors are imported here, the rest (``optimize``, ``Pass``...) on first use
(PEP 562), so the command line installs its signal handlers before anything heavy loads.
"""
from __future__ import annotations

import importlib
from typing import Any

from .errors import (
    CompileError,
    InputError,
    InvalidOutputError,
    K3optError,
    OutputError,
    PluginError,
    UnverifiableError,
    UsageError,
    VerificationError,
)

__version__ = "0.1.0"

_LAZY = {"Pass": ".pipeline.pass_base", "PassContext": ".pipeline.pass_base", "register_pass": ".pipeline.pass_base",
         "optimize": ".api", "optimize_file": ".api"}

__all__ = [
    "CompileError",
    "InputError",
    "InvalidOutputError",
    "K3optError",
    "OutputError",
    "Pass",
    "PassContext",
    "PluginError",
    "UnverifiableError",
    "UsageError",
    "VerificationError",
    "optimize",
    "optimize_file",
    "register_pass",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
