"""Click options shared by ``k3opt optimize``, ``k3opt compile`` and ``k3opt export``.

Decorate a command with the groups it needs, then turn the parsed values
into :func:`k3opt.optimize` keyword arguments with :func:`optimize_kwargs`::

    @click.command()
    @pipeline_options
    @verify_options
    @output_options
    @run_options
    def compile(**kw): ...
        report = k3opt.optimize_file(src, dst, **optimize_kwargs(kw), progress=progress_for(kw))

Errors need no handling in a command: raise a K3optError and the ``k3opt``
group prints it as one line with its exit code (see k3opt/cli.py).
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable, Optional, Sequence, TypeVar, Union

import click

from .errors import UsageError
from .targets import all_targets, get_target, names as target_names
from .modelio.opset import MIN_OPSET, max_opset
from .pipeline.progress import Progress

F = TypeVar("F", bound=Callable[..., Any])
PathLike = Union[str, "os.PathLike[str]"]


@dataclasses.dataclass
class RunState:
    """Flags the top-level error handler needs, for one command run (set while the options are parsed).

    ``k3opt``'s group hands a fresh one to click as the run's context object (:func:`run_state`): nothing of
    one command run reaches the next in the same process.
    """

    debug: bool = False
    quiet: bool = False
    progress: Optional[Progress] = None
    #: The files this run may write, each with its identity before the run (None: absent): see :func:`changed`.
    outputs: list[tuple[str, Optional[tuple[int, int, int]]]] = dataclasses.field(default_factory=list)

    def changed(self) -> list[str]:
        """The outputs written (replaced, created) since :func:`check_outputs` saw them."""
        return [path for path, before in self.outputs if _identity(path) != before]


def _identity(path: str) -> Optional[tuple[int, int, int]]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def check_outputs(models: Sequence[Optional[PathLike]] = (), others: Sequence[Optional[PathLike]] = (),
                  inputs: Sequence[Optional[PathLike]] = (), *, overwrite: bool = False,
                  make_folders: bool = False) -> None:
    """Every command's first step: refuse outputs that cannot or must not be written, before any work.

    :func:`k3opt.modelio.check_outputs` (a device, FIFO, socket or folder is never replaced; no output
    is an input or another output, or the ``.data`` of one), then remember the outputs as they are, so
    an interrupted run says which of them it had written (docs/cli.md, "Guarantees").
    """
    from .modelio.output_paths import check_outputs as check, data_path

    check(models, others, inputs, overwrite=overwrite, make_folders=make_folders)
    state = run_state()
    if state is not None:
        paths = [str(p) for m in models if m is not None for p in (m, data_path(m))]
        paths += [str(p) for p in others if p is not None]
        state.outputs += [(p, _identity(p)) for p in paths]


def run_state() -> Optional[RunState]:
    """The current command run's state (None outside a click command)."""
    ctx = click.get_current_context(silent=True)
    return None if ctx is None else ctx.ensure_object(RunState)


class _Tolerance(click.FloatRange):
    """A finite number >= 0 (``nan`` or ``inf`` would make every comparison pass or fail)."""

    name = "tolerance"

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number >= 0 (e.g. 1e-4)", param, ctx)
        return number


TOLERANCE = _Tolerance(0)


def _comma_list(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> Optional[list[str]]:
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


def _key_values(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, Any]:
    """``KEY=VALUE`` strings -> dict; values that read as numbers become int/float."""
    parsed: dict[str, Any] = {}
    for item in values:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"expected KEY=VALUE, got '{item}'")
        value: Any = raw.strip()
        for convert in (int, float):
            try:
                number = convert(raw)
            except ValueError:
                continue
            if isinstance(number, int) or math.isfinite(number):  # "inf", "nan", "1e400" stay as written
                value = number
            break
        parsed[key.strip()] = value
    return parsed


def _size(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> Optional[int]:
    """``4GB`` -> bytes (a bad size is a usage error)."""
    if value is None:
        return None
    from .blocks.run_hook import parse_size

    return parse_size(value)


def _set_flag(name: str) -> Callable[[click.Context, click.Parameter, bool], bool]:
    def callback(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
        if value:
            setattr(ctx.ensure_object(RunState), name, True)
        return value

    return callback


def _apply(f: F, options: list[Callable[[F], F]]) -> F:
    for option in reversed(options):
        f = option(f)
    return f


_PASSES = click.option("--passes", callback=_comma_list, metavar="A,B", help="Run exactly these passes, in this order.")
_SKIP = click.option("--skip", callback=_comma_list, metavar="X,Y", help="Remove passes from the default pipeline.")
_OPSET = click.option("--opset", type=click.IntRange(MIN_OPSET, max_opset()), metavar="N",
                      help=f"Output opset, {MIN_OPSET} to {max_opset()} (default: raise below 17 to 17).")
_PLUGIN = click.option("--plugin", "plugins", multiple=True, metavar="MODULE|FILE.py",
                       help="Load fusion rules from a plugin (repeatable).")
_PASS_OPTION = click.option("--pass-option", "pass_options", multiple=True, callback=_key_values, metavar="KEY=VALUE",
                            help="Set a pass option, e.g. matmul_add_nd=flatten (repeatable; `k3opt passes` lists them).")


def target_option(help: str) -> Callable[[F], F]:
    """``--target``: one of the targets (:func:`k3opt.targets.names`), the default first."""
    return click.option("--target", type=click.Choice(target_names()), default=target_names()[0], show_default=True,
                        help=help)


def pipeline_options(f: F) -> F:
    """--passes, --skip, --target, --opset, --input-shape, --plugin, --pass-option."""
    return _apply(f, [
        _PASSES, _SKIP,
        target_option("; ".join(f"{t.name}: {t.summary}" for t in all_targets()) + "."),
        _OPSET,
        click.option("--input-shape", "input_shapes", multiple=True, metavar="NAME:D1,D2",
                     help="Fix an input's dimensions, e.g. input_ids:1,128 (repeatable)."),
        _PLUGIN, _PASS_OPTION,
        click.option("--soc-version", metavar="SOC", help="With --target cann: the Ascend chip (e.g. Ascend310P3); "
                     "NPU ops without a kernel there are not emitted (docs/cann.md)."),
    ])


def graph_options(f: F) -> F:
    """The options that shape the graph, for commands whose target is fixed (``k3opt compile``): --passes,
    --skip, --opset, --plugin, --pass-option (the same option objects as :func:`pipeline_options`)."""
    return _apply(f, [_PASSES, _SKIP, _OPSET, _PLUGIN, _PASS_OPTION])


def verify_options(f: F) -> F:
    """--verify/--no-verify, --input-data, --rtol, --atol, --verify-memory."""
    return _apply(f, [
        click.option("--verify/--no-verify", default=True, show_default=True,
                     help="Compare original and optimized outputs in onnxruntime."),
        click.option("--input-data", type=click.Path(dir_okay=False), metavar="F.npz",
                     help="Inputs for verification (arrays named like the graph inputs)."),
        click.option("--rtol", type=TOLERANCE, help="Relative tolerance (default 1e-4 fp32, 1e-2 fp16)."),
        click.option("--atol", type=TOLERANCE, help="Absolute tolerance (default 1e-5 fp32, 1e-3 fp16)."),
        click.option("--verify-memory", callback=_size, metavar="SIZE",
                     help="Memory verification may use for weights (default 1GB): a model over a third of it "
                          "is verified block by block, between its decoder layers."),
    ])


def output_options(f: F) -> F:
    """-o/--output, --external-data, --fsync, --overwrite, --report."""
    return _apply(f, [
        click.option("-o", "--output", type=click.Path(), help="Output model (default: IN.k3opt.onnx)."),
        click.option("--external-data", is_flag=True, default=None,
                     help="Save weights to OUT.onnx.data (automatic above 2 GB or when the input has external data)."),
        click.option("--fsync", is_flag=True,
                     help="Flush the output to disk before exiting (survives a power loss; costs writing out what is cached)."),
        click.option("--overwrite", is_flag=True, help="Allow the output to replace the input."),
        click.option("--report", "report_path", type=click.Path(dir_okay=False), metavar="F.json|F.html",
                     help="Also write the report: JSON, or a self-contained HTML page for F.html."),
    ])


def run_options(f: F) -> F:
    """-q/--quiet and --debug."""
    return _apply(f, [
        click.option("-q", "--quiet", is_flag=True, callback=_set_flag("quiet"), help="Print nothing but errors."),
        click.option("--debug", is_flag=True, callback=_set_flag("debug"), help="Show tracebacks on errors."),
    ])


def optimize_kwargs(params: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for k3opt.optimize/optimize_file from the parsed option values."""
    keys = ("passes", "target", "opset", "plugins", "verify", "rtol", "atol", "input_data", "verify_memory")
    kwargs = {k: params[k] for k in keys if k in params}
    if "skip" in params:
        kwargs["skip"] = tuple(params["skip"] or ())
    if "input_shapes" in params:
        kwargs["input_shapes"] = list(params["input_shapes"])
    if "plugins" in kwargs:
        kwargs["plugins"] = list(kwargs["plugins"])
    kwargs.update(params.get("pass_options") or {})
    if params.get("soc_version"):
        if not get_target(params.get("target") or target_names()[0]).lowers:  # the SoC picks the NPU ops
            raise UsageError("--soc-version applies to --target cann only")
        if kwargs.get("soc_version", params["soc_version"]) != params["soc_version"]:
            raise UsageError(f"--pass-option soc_version={kwargs['soc_version']} contradicts --soc-version "
                             f"{params['soc_version']}")
        kwargs["soc_version"] = params["soc_version"]
    return kwargs


def progress_for(params: dict[str, Any]) -> Progress:
    """The progress sink for a command run (silent with -q); also kept in its :class:`RunState` for error messages."""
    progress = Progress(enabled=not params.get("quiet"))
    state = run_state()
    if state is not None:
        state.progress = progress
    return progress
