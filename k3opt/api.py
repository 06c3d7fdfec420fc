"""The library entry points: ``optimize`` (proto or path in, proto out) and ``optimize_file``.

Both run the pipeline of docs/design.md: load (weights stay on disk) ->
--input-shape -> opset conversion -> gs import -> passes to a fixed point
-> cleanup/toposort -> export -> verification against the model as given
-> [target lowering passes -> export -> the target's form and invariants] -> save.
"""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import onnx
from . import graph as gs
from .graph import G_LOGGER

from . import modelio
from .modelio import opset as opsets
from .modelio.opset23_down import decompose_opset23
from .modelio.traced_experts import traced_experts_warnings
from .blocks import run_hook as block_hook
from .pipeline import shapes
from .pipeline import verify as verifier, verify_dims
from .graph import gs_roundtrip, ir
from .graph.lifetime import graph_scope
from .errors import InputError, UnverifiableError, InvalidOutputError, OutputError, UsageError, VerificationError
from .pipeline.pass_base import PassContext, build_pipeline, check_pass_options
from .pipeline.manager import PassManager
from .report import ModelSummary, Report
from .targets import Target, get_target

ModelLike = Union[onnx.ModelProto, str, os.PathLike]
ProgressSink = Optional[Callable[[str], None]]


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

    ``options`` also takes ``rtol``, ``atol``, ``input_data``, ``seed``
    (verification), ``progress`` (a callable receiving step messages) and
    ``report`` (a Report to fill in); anything else is handed to the passes
    in ``PassContext.options``. Raises a :class:`k3opt.K3optError` subclass.
    """
    report = options.pop("report", None) or Report()
    with _gs_quiet():
        out = _Run(report, **options).optimize(
            model, passes=passes, skip=skip, target=target, opset=opset, input_shapes=input_shapes,
            plugins=plugins, verify=verify,
        )
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
    pipeline_args = _pipeline_args(kwargs)
    run = _Run(report, **kwargs)
    run.measure_output = False
    deferred = modelio.deferred_regions()
    with _gs_quiet():
        model = run.optimize(src, **pipeline_args)
    if not overwrite:
        for path in (out, modelio.data_path(out)):
            if os.path.abspath(path) in run.source_files:
                raise OutputError(f"{path}: is an external-data file of the input; pass --overwrite to replace it")
    with run.step("saving", "save"):
        # merged weights are written straight into the output's data file, never spilled first
        try:
            written = modelio.save(model, out, external_data=external_data, fsync=fsync,
                                   check=get_target(report.target).written_check(report))
        except InvalidOutputError:
            fault = modelio.input_checker_fault(src)  # a fault k3opt could not repair is the input's, not the output's
            if fault is not None:
                raise InputError(f"the input fails onnx's checker: {fault}; nothing was written") from None
            fault = verifier.load_fault(Path(src))  # nor is one onnxruntime finds in the input too
            if fault is not None:
                raise InputError(f"the input {src} does not load in onnxruntime: {fault}; nothing was written"
                                 ) from None
            raise
    modelio.forget_deferred(modelio.deferred_regions() - deferred)  # this run's graph and protos are gone
    report.output = str(out)
    report.files = [str(p) for p in written]
    report.after.size_bytes = sum(p.stat().st_size for p in written)
    return report


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


_PIPELINE_KEYS = ("passes", "skip", "target", "opset", "input_shapes", "plugins", "verify")


def _pipeline_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: kwargs.pop(k) for k in _PIPELINE_KEYS if k in kwargs}


def _after_lowering(p: Any) -> bool:
    """Passes of the pipeline that run again after a target's lowering (cleanups and fold-constants): what the
    lowering of many layers repeats or leaves foldable is done there, so a second run finds nothing to do."""
    return type(p).__module__.startswith("k3opt.passes.cleanup.") or p.name == "fold-constants"


class _Run:
    """One optimization run: its report, progress sink and verification settings."""

    def __init__(
        self, report: Report, *, progress: ProgressSink = None, rtol: Optional[float] = None,
        atol: Optional[float] = None, input_data: Any = None, seed: int = 0, verify_memory: Optional[int] = None,
        **pass_options: Any,
    ):
        self.report = report
        self.progress = progress
        self.rtol, self.atol, self.input_data, self.seed = rtol, atol, input_data, seed
        self.verify_memory = verify_memory  # bytes; over it, verification goes block by block (k3opt.blocks)
        self.pass_options = pass_options
        #: The graph inputs' dims before --input-shape fixed some (verification sizes the rest to agree).
        self.declared_dims: Optional[dict[str, list]] = None
        #: Absolute paths of the input's external-data files (the output must not clobber them).
        self.source_files: set[str] = set()
        #: Size the optimized proto for the report (optimize_file takes the saved files' sizes).
        self.measure_output = True
        #: (feeds, onnxruntime's outputs of the original, output names), once verification ran them.
        self._expected: Optional[tuple[dict, list, list[str]]] = None

    @contextlib.contextmanager
    def step(self, message: str, key: str) -> Iterator[None]:
        """Time a step into the report and announce it to the progress sink."""
        if self.progress is not None:
            self.progress(message)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.report.timings[key] = self.report.timings.get(key, 0.0) + time.perf_counter() - t0

    def optimize(
        self, model: ModelLike, *, passes: Optional[Sequence[str]] = None, skip: Sequence[str] = (),
        target: str = "onnx", opset: Optional[int] = None, input_shapes: Optional[shapes.InputShapes] = None,
        plugins: Sequence[Any] = (), verify: bool = False,
    ) -> onnx.ModelProto:
        report = self.report
        target = get_target(target)
        report.target = target.name
        from .plugins import run_plugins

        with run_plugins(list(plugins)):  # this run's plugins only: the registry is as it was afterwards
            pipeline = build_pipeline(list(passes) if passes is not None else None, tuple(skip), target)
            self.pass_options = check_pass_options(self.pass_options)
        # Target lowerings run after the verified passes; one for another target stays, to be skipped with a note.
        lowering = [p for p in pipeline if p.lowering and (p.targets is None or target in p.targets)]
        pipeline = [p for p in pipeline if p not in lowering]
        if lowering:  # what lowering several layers repeats (one mask per layer...) is merged in the verified lowering
            lowering += [type(p)() for p in pipeline if _after_lowering(p)]
        with self.step("loading", "load"):
            on_disk = None if isinstance(model, onnx.ModelProto) else model
            model, external, bodies = _load(model, report)
            report.notes.extend(modelio.repair(model, bodies))
            report.warnings.extend(traced_experts_warnings(model))
            target.adopt_input(model, report)
            self.source_files = {modelio.external_info(t)["location"] for t in external}
            opset_before = opsets.model_opset(model)
            size = modelio.proto_size(model, None if on_disk is None else os.path.getsize(on_disk), external)
            report.before = ModelSummary.of(model, size, opset_before)
        self.declared_dims = verify_dims.declared_dims(model) if verify else None
        shapes.fix_inputs(model, input_shapes)
        original = None
        blockwise = block_hook.start(self, model, self.verify_memory) if verify else None
        if verify and blockwise is None:
            with self.step("preparing verification", "verify"):  # serializing a big model takes seconds
                original = self._runnable_original(model)
        # Up before the passes (fusions may need the newer opset), down after them (see opset.converts_down).
        down = opsets.converts_down(model, opset, target=target)
        decomposed = self._decompose_opset23(model, opsets.wanted_opset(model, opset, target=target)) if down else 0
        if not down:
            with self.step("converting opset", "opset"):
                converted, notes = opsets.convert(
                    model, opset, target=target, bodies=bodies,
                    needs_newer=lambda ops, v: any(p.min_opset > v and p.could_apply(ops) for p in pipeline))
                report.notes.extend(notes)
        else:
            converted = model
        # Verification compares with the model as given; bisection restarts from the converted one.
        start = original
        if original is not None and (opsets.model_opset(converted) != opset_before or decomposed):  # in place
            start = verifier.runnable_bytes(converted)
        known_external = external  # the conversion touches no external tensor
        model = converted

        ctx = PassContext(opset=opsets.model_opset(model), target=target, options=dict(self.pass_options),
                          output_opset=opsets.wanted_opset(model, opset, target=target) if down else None)
        refresher = shapes.ShapeRefresher()
        manager = PassManager(pipeline, shape_inference=refresher, progress=self._pass_progress())
        with self.step("running passes", "passes"), graph_scope():
            # fold-constants' first step, done on the proto: the lifted literals are never inferred or imported
            lifted = modelio.lift_constant_nodes(model) if not bodies and manager.lifts_constants_first(ctx) else []
            graph = modelio.import_graph(model, known_external)
            tensors = ir.tensor_map(graph)  # one walk for the run's fresh names and the seed's shapes
            graphs = None if bodies else [graph]  # validation saw no body: none to walk for
            ctx.names = ir.NameScope(graph, tensors, graphs)
            ctx.names.reserve(lifted)
            if any(p.needs_shapes for p in pipeline):  # the manager then skips a first refresh
                ctx.shapes_available = refresher.seed(graph, model, tensors)
            manager.run(graph, ctx, graphs=graphs, lifted=len(lifted))
            out = export(graph, model)
        before_down = None
        if down:
            with self.step("converting opset", "opset"):
                before_down = out
                if original is not None:  # the conversion works in place; verification needs the passes' output
                    before_down = onnx.ModelProto()
                    before_down.CopyFrom(out)
                out, notes = opsets.convert(out, opset, target=target)
                report.notes.extend(notes)
        report.passes = [manager.stats[p.name].as_dict() for p in pipeline]
        report.rounds = manager.rounds
        report.counters = {k: v for k, v in sorted(ctx.counters.items()) if v}
        report.sites = ctx.site_records()
        report.notes.extend(refresher.notes + [n for n in ctx.notes if n not in report.notes])
        if original is not None:
            with self.step("verifying", "verify"):
                self._verify(original, start, out, manager, pipeline, ctx, before_down)
        elif blockwise is not None:
            with self.step("verifying block by block", "verify"):
                blockwise.finish(before_down or out, manager, pipeline, ctx)
        if lowering or target.lowers:
            with self.step(f"lowering for {target}", "lower"):
                out, lowered_by = self._lower(out, lowering, target)
            if original is not None and lowering:
                with self.step("verifying the lowering", "verify_lowering"):
                    self._verify_lowering(out, *lowered_by)
        # optimize_file measures the files it writes instead (sizing the proto costs a pass over it)
        size = modelio.proto_size(out) if self.measure_output else 0
        report.after = ModelSummary.of(out, size, opsets.model_opset(out))
        return out

    def _decompose_opset23(self, model: onnx.ModelProto, wanted: int) -> int:
        """Below opset 23, write its Attention/RMSNormalization/RotaryEmbedding nodes decomposed (in place), for
        the passes to lower or re-fuse; returns how many."""
        if wanted >= 23:
            return 0
        done, kept = decompose_opset23(model)
        if done:
            self.report.notes.append(f"{done} opset-23 node(s) (Attention, RMSNormalization, RotaryEmbedding) "
                                     f"written in their decomposed form for opset {wanted}")
        self.report.notes.extend(kept)
        return done

    def _lower(self, model: onnx.ModelProto, lowering: list, target: Target) -> tuple[onnx.ModelProto, tuple]:
        """Run the target's lowering passes on the verified ``model`` (its notes are the report's lowering
        lines), export, and put the result in the target's form (:meth:`Target.finish`).

        Returns the lowered model and what :meth:`_verify_lowering` needs to bisect a divergence.
        """
        ctx = PassContext(opset=opsets.model_opset(model), target=target, options=dict(self.pass_options))
        refresher = shapes.ShapeRefresher()
        manager = PassManager(lowering, shape_inference=refresher, progress=self._pass_progress())
        with graph_scope():
            graph = modelio.import_graph(model)
            manager.run(graph, ctx)
            out = target.finish(export(graph, model))
        self.report.passes += [manager.stats[p.name].as_dict() for p in lowering]
        self.report.lowering = list(ctx.notes)
        self.report.notes.extend(n for n in refresher.notes if n not in self.report.notes)
        for key, value in ctx.counters.items():
            if value:
                self.report.counters[key] = self.report.counters.get(key, 0) + value
        return out, (model, manager, lowering, ctx)

    def _verify_lowering(self, out: onnx.ModelProto, before: onnx.ModelProto, manager: PassManager, lowering: list,
                         ctx: PassContext) -> None:
        """Compare the lowered model, run by the target's reference evaluator, with onnxruntime's outputs of
        the original (same inputs); on divergence bisect the lowering steps and raise VerificationError."""
        report = self.report
        evaluate = ctx.target.reference_evaluator()
        why = "onnxruntime did not run the original" if self._expected is None else None
        if why is None and evaluate is None:
            why = f"no reference evaluator for target {ctx.target}"
        if why is None and (len(out.graph.node) > REFERENCE_MAX_NODES or modelio.proto_size(out) > REFERENCE_MAX_BYTES):
            why = (f"the lowered model is over the reference evaluator's bound ({REFERENCE_MAX_NODES} nodes, "
                   f"{REFERENCE_MAX_BYTES >> 20} MB): onnx's reference evaluator is slow and keeps every value")
        if why is not None:
            report.lowering_verification = verifier.skipped(why)
            report.warnings.append(f"verification of the lowering skipped: {why}")
            return
        assert self._expected is not None and evaluate is not None
        feeds, expected, names = self._expected
        rtol, atol = self.rtol, self.atol
        loosest = max((p.tolerance for p in lowering if getattr(p, "tolerance", None) and manager.stats[p.name].rewrites),
                      default=None)  # a lowering through float16 is verified at fp16's tolerance, unless one is given
        if loosest is not None and rtol is None and atol is None:
            rtol, atol = loosest

        def result_of(candidate: onnx.ModelProto) -> dict[str, Any]:
            try:
                model = onnx.load_from_string(verifier.runnable_bytes(candidate))
                actual = evaluate(model).run(None, dict(feeds))
            except Exception as exc:  # an op the reference refuses (outside its documented contract) fails too
                why = verifier.first_line(exc)
                return verifier.failed(f"the reference evaluator cannot run the lowered model: {why}",
                                       rtol, atol)
            if [o.name for o in candidate.graph.output] != names:
                return verifier.failed("the lowered model's outputs are not the original's", rtol, atol)
            return verifier.compare(expected, actual, names, rtol=rtol, atol=atol)

        result = report.lowering_verification = result_of(out)
        if result["status"] == "passed":
            return
        start = verifier.runnable_bytes(before)  # the lowering's input, its weights inlined for fresh imports
        culprit = self._bisect(start, False, manager, lowering, ctx,
                               lambda candidate: result_of(ctx.target.finish(candidate)), result)
        detail = verifier.failure_detail(result)
        raise VerificationError(f"the lowered model differs from the original under the {ctx.target} reference "
                                f"evaluator ({detail}){culprit}")

    def _pass_progress(self) -> ProgressSink:
        if self.progress is None:
            return None
        progress = self.progress

        def announce(msg: str) -> None:  # the manager says "round N: pass-name"
            round_, _, name = msg.partition(": ")
            progress(f"running pass {name} ({round_})" if name else msg)

        return announce

    def _runnable_original(self, model: onnx.ModelProto) -> Optional[bytes]:
        try:
            return verifier.runnable_bytes(model)
        except verifier.Unrunnable as exc:
            self._skip_verification(str(exc))
            return None

    def _input_name(self) -> str:
        return self.report.input or "model"

    def _skip_verification(self, reason: str) -> None:
        self.report.verification = verifier.skipped(reason)
        self.report.warnings.append(f"verification skipped: {reason}")

    def _verify(self, original: bytes, start: bytes, out: onnx.ModelProto, manager: PassManager,
                pipeline: list, ctx: PassContext, before_down: Optional[onnx.ModelProto] = None) -> None:
        """Compare original and optimized; on divergence bisect and raise VerificationError.

        ``start`` is the model the passes started from (``original`` after an upward opset
        conversion); ``before_down`` the passes' output when the opset was then converted down.
        """
        proto = onnx.load_from_string(original)
        names = [o.name for o in proto.graph.output]
        try:
            reference = verifier.reference_session(original)
        except verifier.Unrunnable as exc:  # an op onnxruntime lacks: nothing can run it
            return self._skip_verification(f"original model: {exc}")
        except Exception as exc:  # noqa: BLE001 -- ORT's own error types: the input is at fault, not k3opt
            if verifier.out_of_memory(exc) or isinstance(exc, ImportError):
                raise _no_memory("loading the original", exc) from None
            raise InputError(f"the input {self._input_name()} does not load in onnxruntime: "
                             f"{verifier.first_line(exc)}; nothing was written") from None
        try:
            feeds = verifier.make_feeds(proto, seed=self.seed, input_data=self.input_data,
                                        declared=self.declared_dims, run=lambda f: verifier.run(reference, f))
        except verifier.Unrunnable as exc:
            return self._skip_verification(f"original model: {exc}")
        except verify_dims.NoConsistentSizes as exc:  # ORT runs the original at no size tried: nothing to compare
            if self.input_data is not None:
                raise UsageError(f"--input-data: onnxruntime cannot run the input on these arrays: "
                                 f"{verifier.first_line(exc.error)}") from None
            raise UnverifiableError(f"verification cannot run: {exc.describe()}; nothing was written "
                                    "(--no-verify writes the model unverified)") from None
        expected = feeds.outputs
        sized = verify_dims.shapes_note(feeds)
        if sized:
            self.report.notes.append(sized)
        self._expected = (feeds, expected, names)

        def result_of(candidate: onnx.ModelProto) -> dict[str, Any]:
            try:
                actual = verifier.run(verifier.session(candidate), feeds)
            except verifier.Unrunnable:
                raise
            except Exception as exc:  # the optimized model does not run: that is a failure
                if verifier.out_of_memory(exc):  # ... unless the machine ran out of memory (or threads)
                    raise _no_memory("running the optimized model") from None
                return verifier.failed(f"onnxruntime cannot run the optimized model: {verifier.first_line(exc)}",
                                       self.rtol, self.atol)
            if [o.name for o in candidate.graph.output] != names:
                return verifier.failed("the optimized model's outputs are not the original's", self.rtol, self.atol)
            return verifier.compare(expected, actual, names, rtol=self.rtol, atol=self.atol)

        try:
            result = result_of(out)
        except verifier.Unrunnable as exc:
            return self._skip_verification(f"optimized model: {exc}")
        self.report.verification = result
        if feeds.sizes:
            result["sizes"] = dict(feeds.sizes)
        if result["status"] == "passed":
            return None
        if before_down is not None and result_of(before_down)["status"] == "passed":
            self.report.verification["first_diverging_pass"] = "opset conversion"
            culprit = f"; the opset conversion to {opsets.model_opset(out)} after the passes diverges"
        else:
            if self.progress is not None:
                self.progress("finding the first diverging pass")
            culprit = self._bisect(start, start is not original, manager, pipeline, ctx, result_of)
        detail = verifier.failure_detail(result)
        raise VerificationError(f"optimized model differs from the original ({detail}){culprit}")

    def _bisect(self, start: bytes, converted: bool, manager: PassManager, pipeline: list, ctx: PassContext,
                result_of: Callable[[onnx.ModelProto], dict], record: Optional[dict] = None) -> str:
        """Re-run the passes on fresh imports, stopping after k steps, to find the first bad step.

        Step 0 (no pass) is a candidate when the opset was converted: the converter may be the culprit.
        The culprit is written into ``record`` (default: the report's verification).
        """
        record = self.report.verification if record is None else record
        candidates = ([0] if converted else []) + [i + 1 for i, s in enumerate(manager.steps) if s.rewrites]

        def diverges(k: int) -> bool:
            model = onnx.load_from_string(start)
            with graph_scope():
                graph = modelio.import_graph(model)
                fresh = PassContext(opset=ctx.opset, target=ctx.target, options=dict(ctx.options),
                                    output_opset=ctx.output_opset)
                PassManager([type(p)() for p in pipeline], shape_inference=shapes.ShapeRefresher()).run(
                    graph, fresh, max_steps=k)
                candidate = export(graph, model)
            try:
                return result_of(candidate)["status"] != "passed"
            except verifier.Unrunnable:
                return True

        step = verifier.first_diverging_step(candidates, diverges)
        if step is None:
            return ""
        if step == 0:
            record["first_diverging_pass"] = "opset conversion"
            return f"; the opset conversion to {ctx.opset} already diverges"
        bad = manager.steps[step - 1]
        record["first_diverging_pass"] = bad.name
        return f"; first diverging pass: {bad.name} (round {bad.round})"


def _no_memory(step: str, exc: Optional[BaseException] = None) -> UnverifiableError:
    """Verification stopped by the machine (memory, threads, onnxruntime's library not mapped), not the model."""
    why = f" ({verifier.first_line(exc)})" if isinstance(exc, ImportError) else ""
    return UnverifiableError(f"verification cannot run: onnxruntime ran out of memory {step}{why}; nothing was "
                             "written (--no-verify writes the model unverified)")


def export(graph: gs.Graph, model: onnx.ModelProto) -> onnx.ModelProto:
    """Clean up, sort and export ``graph`` with ``model``'s metadata and opset imports."""
    ir.toposort(ir.cleanup(graph))
    out = gs_roundtrip.export_onnx(graph)
    out.ir_version = model.ir_version
    for field in ("producer_name", "producer_version", "domain", "model_version", "doc_string"):
        setattr(out, field, getattr(model, field))
    del out.metadata_props[:]
    out.metadata_props.extend(model.metadata_props)
    imports = list(model.opset_import)
    known = {o.domain for o in imports} | {"ai.onnx"}
    imports += [o for o in out.opset_import if o.domain not in known and o.domain]
    del out.opset_import[:]
    out.opset_import.extend(imports)
    return out


#: Bounds for verifying a lowered model with a reference evaluator (onnx's: pure Python per node, and it
#: keeps every intermediate value): larger models are skipped with a warning.
REFERENCE_MAX_NODES = 20_000
REFERENCE_MAX_BYTES = 512 << 20


def reference_evaluator(target: str) -> Optional[Callable[[onnx.ModelProto], Any]]:
    """``model -> evaluator`` (with ``.run(None, feeds)``) that runs the target's lowered ops, or None."""
    return get_target(target).reference_evaluator()


def _load(model: ModelLike, report: Report) -> modelio.Loaded:
    """A checked copy of a model proto, or the model file read (external data left on disk)."""
    if isinstance(model, onnx.ModelProto):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        found = modelio.validate(copy, os.getcwd())
        return modelio.Loaded(copy, found.external, found.bodies)
    if isinstance(model, (str, os.PathLike)):
        report.input = str(model)
        return modelio.read_model(model)
    raise UsageError(f"model must be an onnx.ModelProto or a path, not {type(model).__name__}")
