"""CLI commands of k3opt.cann_bridge, listed in k3opt.cli.COMMANDS (imported when run).

``k3opt check --target cann MODEL``: what ATC will refuse (exit 0 clean, 1 not).
``k3opt compile MODEL --soc-version ... -o PREFIX [-- extra ATC flags]``: to ``PREFIX.om``.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Optional

import click
import onnx

from ..cli_options import check_outputs, graph_options, optimize_kwargs, progress_for, run_options, verify_options
from ..errors import InputError, UsageError
from ..modelio.traced_experts import traced_experts_warnings
from ..report import Report
from ..report_html import write_report
from .atc_command import AtcOptions, parse_input_shape
from ..targets.cann.compat import check_model
from .compile import compile_model


def _dynamic_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    for flag in ("--dynamic-image-size", "--dynamic-batch-size", "--dynamic-dims"):
        fn = click.option(flag, metavar="PROFILES", help=f"ATC {flag.replace('-', '_')[2:]} (needs -1 dims)")(fn)
    return click.option("--input-shape", "input_shapes", multiple=True, metavar="NAME:D1,D2",
                        help="input shape for ATC (repeatable; -1 for a dynamic dim, a~b for a range)")(fn)


@click.command("check")
@click.argument("model", type=click.Path(exists=True))
@click.option("--target", type=click.Choice(["cann"]), default="cann", show_default=True,
              help="the compiler to check against")
@_dynamic_options
def check(model: str, target: str, input_shapes: tuple[str, ...], dynamic_dims: str, dynamic_batch_size: str,
          dynamic_image_size: str) -> None:
    """List every node ATC will not parse, dynamic inputs without a shape, and rejected input dtypes.

    MODEL may be a `k3opt llm` pair folder: every graph is checked with its manifest's shapes.
    """
    if Path(model).is_dir():
        from ..llm.compile_pair import check_pair

        findings: list = check_pair(Path(model))
        model = f"the pair in {model}"
    else:
        findings = _check_file(model, input_shapes, dynamic_dims, dynamic_batch_size, dynamic_image_size)
    for f in findings:
        click.echo(str(f))
    if findings:
        click.echo(f"{len(findings)} problem(s): ATC ({target}) will refuse {model}", err=True)
        sys.exit(1)
    click.echo(f"{model}: ATC can parse every node (opset, inputs and dtypes OK)")


def _check_file(model: str, input_shapes: tuple[str, ...], dynamic_dims: str, dynamic_batch_size: str,
                dynamic_image_size: str) -> list:
    try:
        proto = onnx.load(model, load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError, OSError... for a bad file
        raise InputError(f"{model}: not a readable ONNX model ({exc})") from None
    for warning in traced_experts_warnings(proto):
        click.echo(f"warning: {warning}", err=True)
    dynamic = next((f for f, v in (("dynamic_dims", dynamic_dims), ("dynamic_batch_size", dynamic_batch_size),
                                   ("dynamic_image_size", dynamic_image_size)) if v), None)
    return check_model(proto, [parse_input_shape(s) for s in input_shapes], dynamic)


@click.command("compile", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model", type=click.Path(exists=True))
@click.argument("extra_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- EXTRA_ATC_FLAGS]")
@click.option("--soc-version", required=True, help="Ascend + chip name from `npu-smi info`, e.g. Ascend910B3")
@click.option("-o", "--output", required=True, help="output prefix: writes OUTPUT.onnx and OUTPUT.om")
@_dynamic_options
@click.option("--precision-mode", help="ATC --precision_mode (force_fp16, allow_mix_precision, ...)")
@click.option("--precision-mode-v2", help="ATC --precision_mode_v2 (fp16, origin, mixed_float16, ...)")
@click.option("--fusion-switch-file", help="ATC fusion switch file (turns ATC fusion passes on/off)")
@click.option("--input-format", default="ND", show_default=True, help="ND for transformers; NCHW, NCDHW")
@click.option("--log", "log", default="error", show_default=True, help="ATC log level")
@click.option("--atc", "atc", help="path of the atc executable (default: PATH, then the CANN install)")
@click.option("--dry-run", is_flag=True, help="optimize and print the ATC command without running ATC")
@click.option("--report", "report_path", type=click.Path(dir_okay=False), metavar="F.json|F.html",
              help="also write the report (lowerings, pre-flight check): JSON, or an HTML page for F.html")
@graph_options
@verify_options
@run_options
def compile_cmd(model: str, extra_args: tuple[str, ...], soc_version: str, output: str,
                input_shapes: tuple[str, ...], dynamic_dims: str, dynamic_batch_size: str, dynamic_image_size: str,
                precision_mode: str, precision_mode_v2: str, fusion_switch_file: str, input_format: str, log: str,
                atc: str, dry_run: bool, report_path: Optional[str], **kw: Any) -> None:
    """Optimize MODEL for Ascend (target cann) and compile it with ATC into OUTPUT.om.

    The optimized ONNX is written to OUTPUT.onnx; the graph is verified in
    onnxruntime before the NPU lowering, the lowered one with the reference NPU
    ops. Flags after `--` go to ATC as they are. --skip, --passes, --opset, --plugin and
    --pass-option shape the graph as in `k3opt optimize`; --soc-version also keeps
    the NPU ops without a kernel on that chip out of the lowering.
    MODEL may be a `k3opt llm --target cann` pair folder: each graph is compiled as written into
    OUTPUT/<graph>.om, with its manifest's shapes and gears (a `k3opt split` of such a pair: each stage's
    graphs into OUTPUT/stage<i>/<graph>.om, the prefills with the pair's gears). MODEL may be a `k3opt split` folder (or its
    manifest.json): each stage is compiled into OUTPUT_stage<i>.om (docs/split.md).
    """
    opts = AtcOptions(soc_version=soc_version, input_shapes=input_shapes, input_format=input_format,
                      precision_mode=precision_mode, precision_mode_v2=precision_mode_v2,
                      dynamic_dims=dynamic_dims, dynamic_batch_size=dynamic_batch_size,
                      dynamic_image_size=dynamic_image_size, fusion_switch_file=fusion_switch_file, log=log,
                      extra_args=extra_args)
    from ..blocks.split import MANIFEST, is_split
    from ..llm.split_pair import is_split_pair

    if is_split_pair(Path(model).parent if Path(model).name == MANIFEST else model):
        model = str(Path(model).parent) if Path(model).name == MANIFEST else model  # a split pair: as a pair
    elif is_split(model):  # a `k3opt split` folder or manifest: one .om per stage
        from ..blocks.compile_stages import compile_stages

        results = compile_stages(model, output, opts, atc=atc, dry_run=dry_run, echo=None if kw["quiet"] else click.echo,
                                 progress=progress_for(kw), **_with_soc(optimize_kwargs(kw), soc_version))
        if not kw["quiet"]:
            click.echo("dry run: ATC not run" if dry_run else f"wrote {', '.join(str(r.om_path) for r in results)}")
        return
    if Path(model).is_dir():
        from ..llm.compile_pair import compile_pair

        extra = {k: v for k, v in (("precision_mode", precision_mode), ("precision_mode_v2", precision_mode_v2),
                                   ("fusion_switch_file", fusion_switch_file)) if v}
        oms = compile_pair(Path(model), Path(output), soc_version, atc=atc, dry_run=dry_run,
                           echo=None if kw["quiet"] else click.echo, input_format=input_format, log=log,
                           extra_args=extra_args, **extra)
        if not kw["quiet"]:
            click.echo(f"wrote {', '.join(str(p) for p in oms)}" if oms else "dry run: ATC not run")
        return
    say = None if kw["quiet"] else click.echo
    check_outputs([output + ".onnx"], [output + ".om", report_path], [model], make_folders=True)
    report = Report()
    try:
        result = compile_model(model, output, opts, atc=atc, dry_run=dry_run, echo=say, progress=progress_for(kw),
                               report=report, **_with_soc(optimize_kwargs(kw), soc_version))
    finally:
        if report_path and report.before is not None:  # nothing to report before the optimization ran
            write_report(report, report_path)
    if say is None:
        return
    if dry_run:
        say(f"dry run: optimized model written to {result.onnx_path}; ATC not run")
        return
    for line in result.fusion_summary:
        say(line)
    say(f"wrote {result.om_path}")


def _with_soc(kwargs: dict[str, Any], soc_version: str) -> dict[str, Any]:
    """The optimize keyword arguments with the SoC as the lowerings' ``soc_version`` pass option (one given
    by --pass-option must agree)."""
    given = kwargs.get("soc_version")
    if given is not None and given != soc_version:
        raise UsageError(f"--pass-option soc_version={given} contradicts --soc-version {soc_version}")
    return {**kwargs, "soc_version": soc_version}
