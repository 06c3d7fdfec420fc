"""The library entry points: ``optimize`` (proto or path in, proto out) and ``optimize_file``.

A facade: it checks the arguments, finds the target, builds the run's passes (with its plugins) and hands
them to :class:`k3opt.pipeline.run.Run`, whose stages are the pipeline of docs/design.md.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import onnx

from . import modelio
from .graph import G_LOGGER
from .pipeline import shapes
from .pipeline.run import ModelLike, Run
from .report import Report
from .targets import get_target

__all__ = ["default_output", "optimize", "optimize_file", "reference_evaluator"]

#: The run's own settings among ``optimize``'s keyword options; every other one is a pass option.
_RUN_KEYS = ("progress", "rtol", "atol", "input_data", "seed", "verify_memory")


def optimize(
    model: ModelLike,
    *,
    passes: Optional[Sequence[str]] = None,
    skip: Sequence[str] = (),
    target: str = "onnx",
    opset: Optional[int] = None,
    input_shapes: Optional[shapes.InputShapes] = None,
    plugins: Sequence[Any] = (),
    verify: bool = False,
    **options: Any,
) -> onnx.ModelProto:
    """Optimize ``model`` (a ModelProto, never mutated, or a path) and return the new ModelProto.

    ``options`` also takes ``rtol``, ``atol``, ``input_data``, ``seed``, ``verify_memory``
    (verification), ``progress`` (a callable receiving step messages) and
    ``report`` (a Report to fill in); anything else is handed to the passes
    in ``PassContext.options``. Raises a :class:`k3opt.K3optError` subclass.
    """
    report = options.pop("report", None) or Report()
    run = _run(report, passes, skip, target, opset, input_shapes, plugins, verify, options)
    with _gs_quiet():
        out = run.optimize(model)
    modelio.materialize_all()  # the returned proto may point into the spill file: its bytes must be there
    return out


def optimize_file(
    src: Union[str, os.PathLike],
    dst: Optional[Union[str, os.PathLike]] = None,
    *,
    overwrite: bool = False,
    external_data: Optional[bool] = None,
    fsync: bool = False,
    **kwargs: Any,
) -> Report:
    """Optimize the model file ``src`` into ``dst`` (default ``SRC.k3opt.onnx``); returns the Report.

    Weights stay on disk and are streamed into ``DST.data`` when external
    data is used (see :func:`k3opt.modelio.save`, also for ``fsync``). Takes the
    keyword arguments of :func:`optimize`. Nothing is written when
    verification fails.
    """
    out = Path(dst) if dst is not None else default_output(src)
    modelio.check_output_path(out, src, overwrite)
    report = kwargs.pop("report", None) or Report()
    args = {k: kwargs.pop(k) for k in ("passes", "skip", "target", "opset", "input_shapes", "plugins", "verify")
            if k in kwargs}
    run = _run(report, options=kwargs, **args)
    run.measure_output = False
    deferred = modelio.deferred_regions()
    with _gs_quiet():
        run.optimize(src)  # the run keeps the model and hands it to its write, which lets it go once written
    written = run.write(src, out, overwrite=overwrite, external_data=external_data, fsync=fsync)
    modelio.forget_deferred(modelio.deferred_regions() - deferred)  # this run's graph and protos are gone
    report.output = str(out)
    report.files = [str(p) for p in written]
    report.after.size_bytes = sum(p.stat().st_size for p in written)
    return report


def _run(report: Report, passes: Optional[Sequence[str]] = None, skip: Sequence[str] = (), target: str = "onnx",
         opset: Optional[int] = None, input_shapes: Optional[shapes.InputShapes] = None, plugins: Sequence[Any] = (),
         verify: bool = False, options: Optional[dict[str, Any]] = None) -> Run:
    """The run for these arguments: its target, its passes (with its own plugins), its options checked."""
    options = dict(options or {})
    settings = {k: options.pop(k) for k in _RUN_KEYS if k in options}
    found = get_target(target)
    report.target = found.name
    from .plugins import run_plugins

    with run_plugins(list(plugins)) as registry:  # a copy of the process's registry, with this run's plugins
        pipeline = registry.build_pipeline(list(passes) if passes is not None else None, tuple(skip), found)
        pass_options = registry.check_options(options)
    from .blocks import run_hook
    from .passes import reruns_after_lowering

    return Run(found, pipeline, report, opset=opset, input_shapes=input_shapes, verify=verify,
               pass_options=pass_options, blockwise=run_hook.start,
               after_lowering=frozenset(reruns_after_lowering()), **settings)


@contextlib.contextmanager
def _gs_quiet() -> Iterator[None]:
    """Silence onnx-graphsurgeon's warnings (e.g. duplicate node names) for the run: k3opt reports, not gs."""
    old = G_LOGGER.severity
    G_LOGGER.severity = max(old, G_LOGGER.ERROR)
    try:
        yield
    finally:
        G_LOGGER.severity = old


def default_output(src: Union[str, os.PathLike]) -> Path:
    """``model.onnx`` -> ``model.k3opt.onnx`` next to it."""
    p = Path(src)
    stem = p.name[: -len(".onnx")] if p.name.endswith(".onnx") else p.name
    return p.with_name(stem + ".k3opt.onnx")


def reference_evaluator(target: str) -> Optional[Callable[[onnx.ModelProto], Any]]:
    """``model -> evaluator`` (with ``.run(None, feeds)``) that runs the target's lowered ops, or None."""
    return get_target(target).reference_evaluator()
