"""Run one of torch's ONNX exporters and turn its failures into one K3optError line.

The two exporters behave differently enough that callers pick one by name:

* ``"torchscript"``: ``torch.onnx.export(dynamo=False)`` (tracing), default
  opset 14; LayerNorm comes out decomposed, shapes follow ``dynamic_axes``.
* ``"dynamo"``: ``torch.onnx.export(dynamo=True, optimize=False)``
  (torch.export), default opset 18; shapes follow ``dynamic_shapes``.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import logging
import os
import re
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from ..errors import K3optError

EXPORTERS = ("torchscript", "dynamo")
DEFAULT_OPSET = {"torchscript": 14, "dynamo": 18}
LARGE_BYTES = 1 << 30
INSTALL_HINT = "torch and transformers are needed for export: pip install 'k3opt[export]'"
#: torch's dynamo exporter imports onnxscript, which torch itself does not declare (see setup.cfg).
DYNAMO_HINT = ("the dynamo exporter needs onnxscript, which is not installed: pip install 'k3opt[export]' "
               "(or pip install onnxscript), or use the torchscript exporter")


class ExportError(K3optError):
    """The exporter (torch.onnx) could not turn the module into ONNX; names the exporter and the op."""


def require_torch(*also: str) -> Any:
    """Import torch (and the modules in ``also``), or raise a K3optError telling how to install the export extra."""
    try:
        import torch

        for name in also:
            importlib.import_module(name)
    except ImportError as exc:
        raise K3optError(INSTALL_HINT) from exc
    return torch


def require_exporter(exporter: str) -> None:
    """Raise a K3optError naming what to install when ``exporter`` needs a module that is missing."""
    if exporter == "dynamo":
        try:
            importlib.import_module("onnxscript")
        except ImportError as exc:
            raise K3optError(DYNAMO_HINT) from exc


def export_onnx(
    module: Any,
    example_inputs: Sequence[Any],
    path: os.PathLike | str,
    *,
    input_names: Sequence[str],
    output_names: Sequence[str],
    dynamic_axes: Optional[Mapping[str, Mapping[int, str]]] = None,
    dynamic_shapes: Optional[Any] = None,
    exporter: str = "torchscript",
    opset: Optional[int] = None,
    external_data: Optional[bool] = None,
) -> Path:
    """Export ``module(*example_inputs)`` to ``path`` (weights inline) with no optimization; returns ``path``.

    For the dynamo exporter ``dynamic_shapes`` wins; without it, names in
    ``dynamic_axes`` become ``torch.export.Dim`` objects, so one mapping
    serves both exporters. Exporter output is captured and only summarized in
    the :class:`ExportError` raised on failure. Weights go to external data
    files when ``external_data`` is true (default: when they exceed 1 GiB,
    well under protobuf's 2 GiB limit).
    """
    torch = require_torch()
    if exporter not in EXPORTERS:
        raise K3optError(f"unknown exporter {exporter!r}; choose one of {', '.join(EXPORTERS)}")
    require_exporter(exporter)
    opset = opset or DEFAULT_OPSET[exporter]
    path = Path(path)
    args = tuple(example_inputs)
    kwargs: dict[str, Any] = dict(input_names=list(input_names), output_names=list(output_names), opset_version=opset)
    if exporter == "torchscript":
        kwargs.update(dynamo=False, dynamic_axes=dict(dynamic_axes or {}))
    else:
        shapes = dynamic_shapes if dynamic_shapes is not None else _dims(torch, args, input_names, dynamic_axes)
        kwargs.update(dynamo=True, optimize=False, dynamic_shapes=shapes,
                      external_data=wants_external_data(module, external_data))
    torch_log = logging.getLogger("torch.onnx")
    level = torch_log.level
    try:
        with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            torch_log.setLevel(logging.ERROR)  # e.g. "torchvision is not installed" on every dynamo export
            torch.onnx.export(module, args, str(path), **kwargs)
    except Exception as exc:  # every exporter failure, whatever torch calls it
        raise ExportError(explain_failure(exporter, opset, exc)) from exc
    finally:
        torch_log.setLevel(level)
    return path


def wants_external_data(module: Any, external_data: Optional[bool]) -> bool:
    """``external_data`` when given, else whether the module's parameters and buffers pass LARGE_BYTES."""
    if external_data is not None:
        return external_data
    tensors = list(module.parameters()) + list(module.buffers()) if hasattr(module, "parameters") else []
    return sum(t.numel() * t.element_size() for t in tensors) > LARGE_BYTES


def _dims(torch: Any, args: tuple, input_names: Sequence[str],
          dynamic_axes: Optional[Mapping[str, Mapping[int, str]]]) -> Any:
    """``dynamic_axes`` as torch.export's ``dynamic_shapes``: ``{axis: Dim}`` per tensor, nested like ``args``.

    Input names label the flattened tensors in order (as for the TorchScript
    exporter); equal labels share one ``Dim``. None when nothing is dynamic.
    """
    if not dynamic_axes:
        return None
    dims: dict[str, Any] = {}
    names = iter(input_names)

    def spec(arg: Any) -> Any:
        if isinstance(arg, (tuple, list)):
            return tuple(spec(a) for a in arg)
        axes = dict(dynamic_axes.get(next(names, ""), {}))
        return {axis: dims.setdefault(label, torch.export.Dim(label)) for axis, label in axes.items()} or None

    return tuple(spec(a) for a in args)


_OP_PATTERNS = (
    re.compile(r"operator '([\w:.]+)'"),  # torchscript: UnsupportedOperatorError
    re.compile(r"unrecognized namespace ([\w:]+)"),  # torchscript: custom op
    re.compile(r"target=([\w.:]+)"),  # dynamo: ConversionError "Error when translating node ..."
    re.compile(r"\b(aten::\w+|aten\.\w+(?:\.\w+)?)"),
)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def explain_failure(exporter: str, opset: int, exc: BaseException) -> str:
    """One line: which exporter failed, on which op (when the message names one), and why (with the root cause)."""
    chain = _chain(exc)
    text = "\n".join(str(e) for e in chain)
    op = next((m.group(1) for p in _OP_PATTERNS if (m := p.search(text))), None)
    reasons = list(dict.fromkeys(_first_line(e) for e in (chain[0], chain[-1])))
    where = f" on op {op}" if op else ""
    other = "dynamo" if exporter == "torchscript" else "torchscript"
    missing = next((e.name for e in chain if isinstance(e, ModuleNotFoundError) and e.name), None)
    advice = (f"module {missing.split('.')[0]} is not installed: pip install 'k3opt[export]', or the package "
              f"that provides it" if missing else f"try exporter={other!r} or another opset")
    return (f"the {exporter} exporter (opset {opset}) failed{where}: {'; caused by: '.join(reasons)[:400]} "
            f"[{type(exc).__name__}; {advice}]")


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes/contexts, outermost first."""
    chain: list[BaseException] = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


def _first_line(exc: BaseException) -> str:
    first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
    return re.split(r"\s*This is step|\s*Next steps|\s*For more information", _ANSI.sub("", first))[0]
