"""The ``k3opt`` command line: ``optimize``, ``passes``, plus the commands of the bridge and export packages.

Every error is one line on stderr (a traceback only with --debug). Exit
codes: 0 success, 1 verification (or compile) failure, 2 usage error or
unusable input; see k3opt/errors.py.
"""
from __future__ import annotations

import importlib
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import click

from . import __version__
from .api import default_output, optimize_file
from .cli_options import (
    RunState,
    check_outputs,
    optimize_kwargs,
    output_options,
    pipeline_options,
    progress_for,
    run_options,
    verify_options,
)
from .errors import InputError, K3optError, UsageError, VerificationError
from .pipeline.verify import first_line, out_of_memory
from .interrupts import Interrupted, install as install_signal_handlers, restore as restore_signal_handlers
from .report import Report
from .report_html import write_report
from .targets import get_target

EXIT_USAGE = 2
# click >= 8.2 raises this for a group called without a command.
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


#: The commands defined outside this module, by name -> ``module:attribute`` of the click command; imported
#: only when listed or run. A new command is one line here.
COMMANDS = {
    "check": "k3opt.cann_bridge.cli:check",
    "compile": "k3opt.cann_bridge.cli:compile_cmd",
    "export": "k3opt.export.cli:export_cmd",
    "generate": "k3opt.llm.cli:generate_cmd",
    "llm": "k3opt.llm.cli:llm_cmd",
    "quantize": "k3opt.quantize.cli:quantize_cmd",
    "split": "k3opt.blocks.cli:split_cmd",
}


class _Group(click.Group):
    """A click group whose every failure is one line on stderr and exit 0/1/2, and whose :data:`COMMANDS` are
    imported when used."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(COMMANDS))

    def get_command(self, ctx: click.Context, cmd_name: str) -> Optional[click.Command]:
        if cmd_name in COMMANDS and cmd_name not in self.commands:
            module, _, attr = COMMANDS[cmd_name].partition(":")
            self.add_command(getattr(importlib.import_module(module), attr), cmd_name)
        return super().get_command(ctx, cmd_name)

    def main(self, args: Any = None, prog_name: Optional[str] = None, **extra: Any) -> Any:
        extra.pop("standalone_mode", None)
        extra.pop("obj", None)
        # SIGTERM and SIGHUP too: one line, exit 2, the save's temporary files removed; put back afterwards
        previous = install_signal_handlers()
        state = RunState()  # this run's: handed to click as the context object, read back here on failure
        try:
            with warnings.catch_warnings():  # a library's warning (numpy's overflow in onnx's reference evaluator)
                warnings.simplefilter("ignore")  # is no line of k3opt's: what matters is in the report
                code = super().main(args, prog_name, standalone_mode=False, obj=state, **extra)
        except click.exceptions.Exit as exc:
            code = exc.exit_code
        except _NO_ARGS_IS_HELP as exc:  # bare ``k3opt``: the help, not an error line
            click.echo(exc.ctx.get_help() if exc.ctx else str(exc))
            code = 0
        except click.ClickException as exc:
            _fail(state, exc.format_message(), EXIT_USAGE)
        except K3optError as exc:
            _fail(state, str(exc), exc.exit_code)
        except (_Stopped, KeyboardInterrupt, click.exceptions.Abort) as exc:
            _fail(state, _interrupted(state, exc), EXIT_USAGE)
        except MemoryError:
            _fail(state, f"out of memory{_during(state)}", EXIT_USAGE)
        except Exception as exc:  # a bug: say where, keep the traceback for --debug
            if out_of_memory(exc):  # a library loaded on first use (numpy.random, onnxruntime) under ulimit -v
                _fail(state, f"out of memory{_during(state)} ({type(exc).__name__}: {first_line(exc)})", EXIT_USAGE)
            _fail(state, f"internal error{_during(state)} ({type(exc).__name__}: {exc}); rerun with --debug",
                  EXIT_USAGE)
        finally:
            if state.progress is not None:
                state.progress.close()
            restore_signal_handlers(previous)
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as exc:  # past click, which would print a blank line and lose the signal
            raise _Stopped(exc) from None


class _Stopped(Exception):
    """A KeyboardInterrupt (SIGINT, or SIGTERM/SIGHUP as :class:`Interrupted`) carried past click."""

    def __init__(self, interrupt: KeyboardInterrupt):
        super().__init__(str(interrupt))
        self.interrupt = interrupt


def _during(state: RunState) -> str:
    step = state.progress.current if state.progress is not None else None
    return f" while {step}" if step else ""


def _interrupted(state: RunState, exc: BaseException) -> str:
    """The line for a stopped run: which signal, and whether an output was already in place."""
    if isinstance(exc, _Stopped):
        exc = exc.interrupt
    name = exc.name if isinstance(exc, Interrupted) else "SIGINT"
    written = state.changed()
    if written:
        return f"interrupted ({name}) after writing {', '.join(written)}; the run did not finish"
    return f"interrupted ({name}); nothing was written"


def _fail(state: RunState, message: str, code: int) -> None:
    if state.debug:
        traceback.print_exc()
    try:  # one line whatever the model names hold: a newline in a tensor name is written as \n
        message = "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)
        click.echo(f"k3opt: error: {message}", err=True)
    except MemoryError:  # out of memory (ulimit -v) even for the line: a constant one, not a traceback
        os.write(2, b"k3opt: error: out of memory\n")
    sys.exit(code)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="k3opt")
def main() -> None:
    """k3opt: optimize ONNX transformer models (for Ascend NPUs or any ONNX runtime)."""


@main.command("optimize")
@click.argument("model", type=click.Path())
@click.argument("positional_output", metavar="[OUT]", required=False, type=click.Path())
@output_options
@pipeline_options
@verify_options
@run_options
def optimize_cmd(model: str, positional_output: Optional[str], output: Optional[str], external_data: Optional[bool],
                 fsync: bool, overwrite: bool, report_path: Optional[str], quiet: bool, debug: bool,
                 **params: Any) -> None:
    """Optimize MODEL (an .onnx file) and write OUT (default MODEL.k3opt.onnx); OUT or -o OUT, as onnxsim does."""
    out = _output_of(model, positional_output, output)
    check_outputs([out], [report_path], [model], overwrite=overwrite)
    report = Report()
    try:
        optimize_file(model, out, overwrite=overwrite,
                      external_data=external_data, fsync=fsync, report=report,
                      progress=progress_for({"quiet": quiet}), **optimize_kwargs(params))
    except VerificationError:
        if report_path:
            write_report(report, report_path)
        if not quiet:
            click.echo(report.table(), err=True)
        raise
    if report_path:
        report.check = get_target(report.target).check_record(report.output)  # what ATC will make of it
        write_report(report, report_path)
    if not quiet:
        for warning in report.warnings:
            click.echo(f"k3opt: warning: {warning}", err=True)
        click.echo(report.table())


def _output_of(model: str, positional: Optional[str], option: Optional[str]) -> Union[str, Path]:
    """The output path: ``OUT`` or ``-o OUT`` (not both), else ``MODEL.k3opt.onnx`` next to a model file."""
    if positional and option:
        raise UsageError(f"two outputs given ({positional} and -o {option}): give OUT or -o OUT, not both")
    if positional or option:
        return positional or option  # as spelled: a trailing / is refused (check_outputs), never dropped
    if Path(model).is_dir():  # default_output would name a file after the folder
        raise InputError(f"{model}: is a directory, not an ONNX model file")
    return default_output(model)


@main.command("passes")
@click.option("--plugin", "plugins", multiple=True, metavar="MODULE|FILE.py", help="Also list a plugin's passes.")
@run_options
def passes_cmd(plugins: tuple[str, ...], quiet: bool, debug: bool) -> None:
    """List every pass (built-in and plugin) in pipeline order with its description."""
    from .plugins import run_plugins

    with run_plugins(list(plugins)) as registry:  # this command's plugins only
        passes = registry.ordered()
    for name, cls in passes.items():
        tags = [t for t in ("" if cls.default else "not default", f"plugin {cls.plugin}" if cls.plugin else "") if t]
        suffix = f" [{', '.join(tags)}]" if tags else ""
        click.echo(f"{name:34} {cls.description}{suffix}")
        for key, text in cls.options.items():
            click.echo(f"{'':36}--pass-option {key}=...: {text}")
