"""k3opt: a graph-optimization compiler for ONNX transformer models headed for Ascend NPUs."""
from __future__ import annotations

from .errors import (
    CompileError,
    InputError,
    InvalidOutputError,
    K3optError,
    OutputError,
    PluginError,
    UsageError,
    VerificationError,
)
from .pipeline.pass_base import Pass, PassContext, register_pass
from .api import optimize, optimize_file

__version__ = "0.1.0"

__all__ = [
    "CompileError",
    "InputError",
    "InvalidOutputError",
    "K3optError",
    "OutputError",
    "Pass",
    "PassContext",
    "PluginError",
    "UsageError",
    "VerificationError",
    "optimize",
    "optimize_file",
    "register_pass",
]
