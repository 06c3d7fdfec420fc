"""k3opt.export: from a PyTorch / transformers model to an optimized ONNX in one call (docs/export.md).

torch and transformers are optional (``pip install 'k3opt[export]'``): this
package imports without them and each entry point says how to install them.
"""
from __future__ import annotations

from .exporters import DEFAULT_OPSET, EXPORTERS, ExportError, export_onnx
from .from_torch import from_torch
from .from_transformers import TASKS, from_transformers, infer_task

__all__ = ["DEFAULT_OPSET", "EXPORTERS", "ExportError", "TASKS", "export_onnx", "from_torch", "from_transformers",
           "infer_task"]
