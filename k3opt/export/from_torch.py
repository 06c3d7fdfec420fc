"""``from_torch``: export a torch module with either exporter, then run k3opt's pipeline on the result."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from .. import modelio
from ..api import optimize_file
from ..report import Report
from .exporters import export_onnx, wants_external_data


def from_torch(
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
    optimize: bool = True,
    target: str = "onnx",
    external_data: Optional[bool] = None,
    fsync: bool = False,
    **optimize_options: Any,
) -> Report:
    """Export ``module(*example_inputs)`` to ONNX and optimize it into ``path``; returns the Report.

    ``opset`` is the exporter's opset (default 14 for torchscript, 18 for
    dynamo); the pipeline then raises it as ``k3opt.optimize`` does (pass
    ``output_opset=N`` to choose). ``optimize_options`` are the keyword
    arguments of :func:`k3opt.api.optimize_file` (passes, skip, verify,
    input_shapes, plugins, rtol, atol...). The raw export is made in a
    temporary folder next to ``path``; weights are saved as external data
    (``PATH.data``) above 1 GiB, or as ``external_data`` says; ``fsync``
    makes them durable (see :func:`k3opt.modelio.save`). With
    ``optimize=False`` the raw export is saved to ``path`` unchanged. Exporter failures raise
    :class:`k3opt.export.ExportError` (one line: exporter, op, reason).
    """
    path = Path(path)
    modelio.check_output_path(path)
    if "output_opset" in optimize_options:
        optimize_options["opset"] = optimize_options.pop("output_opset")
    external_data = wants_external_data(module, external_data)
    progress = optimize_options.get("progress")
    if progress is not None:  # the torch export is the longest silent phase of a big model
        progress(f"exporting with the {exporter} exporter")
    with tempfile.TemporaryDirectory(prefix=".k3opt-export-", dir=path.parent) as tmp:
        raw = export_onnx(module, example_inputs, Path(tmp) / "exported.onnx", input_names=input_names,
                          output_names=output_names, dynamic_axes=dynamic_axes, dynamic_shapes=dynamic_shapes,
                          exporter=exporter, opset=opset, external_data=external_data)
        if optimize:
            report = optimize_file(raw, path, overwrite=True, external_data=external_data, fsync=fsync,
                                   target=target, **optimize_options)
        else:
            report = optimize_options.get("report") or Report()
            written = modelio.save(modelio.load(raw), path, external_data=external_data, fsync=fsync)
            report.output, report.files = str(path), [str(p) for p in written]
    report.input = f"{type(module).__name__} ({exporter} exporter)"  # the temporary raw export is gone
    return report
