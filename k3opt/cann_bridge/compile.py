"""``compile_model``: an ONNX model to an Ascend ``.om``: optimize for cann, pre-flight check, run ATC.

The library call behind ``k3opt compile``, for export pipelines. Everything
ATC would refuse is refused first (options, then the optimized graph), so a
failure costs seconds, not an ATC run.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Callable, Optional, Union

import onnx

from .. import modelio, optimize, optimize_file
from ..errors import CompileError, UsageError
from ..report import Report
from ..pipeline.verify import summary_line
from .atc_command import AtcOptions, build_command, check_output_prefix, render, validate
from .atc_locate import find_atc
from .atc_run import raise_for_result, run_atc, summarize_fusion_result
from ..targets.cann import target_form
from ..targets.cann.compat import Finding, check_model, check_record

Echo = Callable[[str], None]


class AtcUnavailable(CompileError):
    """ATC could not be found or started: an environment problem, so exit status 2 like a usage error.

    Status 1 stays for a model that does not compile (pre-flight findings, ATC ran and failed).
    """

    exit_code = 2


@dataclasses.dataclass
class CompileResult:
    """What a compile produced: the ``.om`` (None on a dry run), the optimized ONNX and the ATC command."""

    om_path: Optional[Path]
    onnx_path: Path
    command: list[str]
    report: Report
    findings: list[Finding]
    fusion_summary: list[str]


def _optimize(model: Union[str, os.PathLike, onnx.ModelProto], dst: Path, static_shapes: list[str],
              optimize_options: dict) -> Report:
    options = dict(optimize_options)
    options.setdefault("verify", True)
    shapes = static_shapes or None
    if isinstance(model, onnx.ModelProto):
        report = options.pop("report", None) or Report()
        out = optimize(model, target="cann", input_shapes=shapes, report=report, **options)
        report.files = [str(p) for p in modelio.save(out, dst, check=target_form.check_written)]
        report.output = str(dst)
        return report
    return optimize_file(model, dst, target="cann", input_shapes=shapes, **options)


def compile_model(
    model: Union[str, os.PathLike, onnx.ModelProto],
    output: Union[str, os.PathLike],
    options: AtcOptions,
    *,
    atc: Optional[str] = None,
    dry_run: bool = False,
    echo: Optional[Echo] = None,
    **optimize_options,
) -> CompileResult:
    """Optimize ``model`` with the cann target into ``OUTPUT.onnx``, check it, and run ATC into ``OUTPUT.om``.

    ``output`` is ATC's prefix (no ``.om``). ``dry_run`` stops before ATC
    (pre-flight findings are reported, not raised) and needs no ATC install.
    ``echo`` receives ATC's output lines as they come. Extra keyword
    arguments go to :func:`k3opt.optimize` (``verify``, ``rtol``, ``report``: a Report to fill in,
    which also gets the pre-flight check's findings in ``check``).
    Raises UsageError for options ATC would reject, AtcUnavailable (a
    CompileError, exit status 2) when ATC cannot be found or started,
    CompileError when the model will not parse or ATC fails (exit status 1).
    """
    say = echo or (lambda line: None)
    shapes = validate(options)
    check_output_prefix(str(output))
    prefix = Path(output).absolute()
    tool = _locate(atc, dry_run)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    onnx_path = prefix.with_name(prefix.name + ".onnx")
    if not isinstance(model, onnx.ModelProto) and Path(model).absolute() == onnx_path:
        raise UsageError(f"-o {output} would write the optimized model over the input {model}: choose another prefix")
    static = [str(s) for s in shapes if s.static]  # fixed sizes help folding; scalars have none to fix
    report = _optimize(model, onnx_path, static, optimize_options)
    for line in report.lowering:
        say(f"lowering: {line}")
    if report.lowering_verification:
        say("lowering verification (reference evaluator): " + summary_line(report.lowering_verification))
    optimized = onnx.load(str(onnx_path), load_external_data=False)
    findings = check_model(optimized, shapes, options.dynamic_option())
    report.check = check_record(onnx_path, findings)
    cmd = build_command(tool, str(onnx_path), str(prefix), options)
    if dry_run:
        for f in findings:
            say(f"warning: ATC will refuse: {f}")
        say(render(cmd))
        return CompileResult(None, onnx_path, cmd, report, findings, [])
    if findings:
        raise CompileError("ATC would refuse the optimized model (nothing was run):\n"
                           + "\n".join(f"  {f}" for f in findings))
    fusion = prefix.parent / "fusion_result.json"
    before = fusion.stat().st_mtime_ns if fusion.exists() else None
    say(render(cmd))
    progress = optimize_options.get("progress")
    if progress is not None:
        progress("running ATC")
    try:
        result = run_atc(cmd, cwd=prefix.parent, echo=say)
    except CompileError as exc:  # raised only when the executable cannot be started
        raise AtcUnavailable(str(exc)) from None
    raise_for_result(result)
    om = prefix.with_name(prefix.name + ".om")
    if not om.is_file():
        raise CompileError(f"ATC reported success but {om} was not written")
    written = fusion.exists() and fusion.stat().st_mtime_ns != before
    summary = summarize_fusion_result(fusion) if written else []
    return CompileResult(om, onnx_path, cmd, report, findings, summary)


def _locate(atc: Optional[str], dry_run: bool) -> str:
    try:
        return str(find_atc(atc))
    except CompileError as exc:
        if dry_run:
            return "atc"
        raise AtcUnavailable(str(exc)) from None
