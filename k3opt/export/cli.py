"""CLI commands of k3opt.export, listed in k3opt.cli.COMMANDS (imported when run).

``k3opt export SOURCE -o OUT.onnx``: SOURCE is a local transformers
checkpoint folder or a config JSON (random weights); the options after the
export ones are those of ``k3opt optimize``.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Optional

import click

from ..cli_options import (check_outputs, optimize_kwargs, output_options, pipeline_options, progress_for, run_options,
                           verify_options)
from ..errors import K3optError, VerificationError
from ..report import Report
from ..report_html import write_report
from .exporters import EXPORTERS, INSTALL_HINT
from .from_transformers import TASKS, from_transformers


def default_export_output(source: str) -> Path:
    """``ckpt/`` -> ``ckpt/model.k3opt.onnx``; ``tiny.json`` -> ``tiny.k3opt.onnx`` next to it."""
    src = Path(source)
    return src / "model.k3opt.onnx" if src.is_dir() else src.with_name(src.stem + ".k3opt.onnx")


@click.command("export")
@click.argument("source", type=click.Path(exists=True))
@click.option("--task", type=click.Choice(list(TASKS)), help="Default: the one the architecture implies.")
@click.option("--exporter", type=click.Choice(EXPORTERS), default="torchscript", show_default=True)
@click.option("--export-opset", type=click.IntRange(1), help="Exporter opset (default 14 torchscript, 18 dynamo).")
@click.option("--seq-len", type=click.IntRange(1), default=8, show_default=True, help="Example sequence length.")
@click.option("--batch", type=click.IntRange(1), default=1, show_default=True, help="Example batch size.")
@click.option("--use-cache", is_flag=True, help="text-generation: export one decoding step with the KV cache.")
@click.option("--no-optimize", is_flag=True, help="Write the raw export (no k3opt passes).")
@output_options
@pipeline_options
@verify_options
@run_options
def export_cmd(source: str, task: Optional[str], exporter: str, export_opset: Optional[int], seq_len: int,
               batch: int, use_cache: bool, no_optimize: bool, output: Optional[str], external_data: Optional[bool], fsync: bool,
               overwrite: bool, report_path: Optional[str], quiet: bool, debug: bool, **params: Any) -> None:
    """Export SOURCE (a checkpoint folder or a config JSON) to ONNX and optimize it.

    Writes -o OUT, by default FOLDER/model.k3opt.onnx or NAME.k3opt.onnx next to NAME.json.
    """
    if not all(importlib.util.find_spec(m) for m in ("torch", "transformers")):
        raise K3optError(INSTALL_HINT)
    out = output or default_export_output(source)
    check_outputs([out], [report_path], [source], overwrite=overwrite)
    kwargs = optimize_kwargs(params)
    kwargs["output_opset"] = kwargs.pop("opset", None)
    report = Report()
    try:
        from_transformers(source, out, task=task, seq_len=seq_len, batch=batch,
                          use_cache=use_cache, exporter=exporter, opset=export_opset, optimize=not no_optimize,
                          external_data=external_data, fsync=fsync, report=report,
                          progress=progress_for({"quiet": quiet}), **kwargs)
    except VerificationError:
        if not quiet:
            click.echo(report.table(), err=True)
        raise
    finally:
        if report_path:
            write_report(report, report_path)
    if not quiet:
        for warning in report.warnings:
            click.echo(f"k3opt: warning: {warning}", err=True)
        click.echo(report.table() if report.after else f"wrote {report.output}")
