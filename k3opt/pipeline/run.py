"""One optimization run: :class:`Run`, its stages read top to bottom in :meth:`Run.optimize`.

load -> fix inputs -> reference (the original kept for verification) -> opset up -> import + passes + export ->
opset down -> verify -> lower (the target's lowering passes, form and reference check) -> write
(:meth:`Run.write`). The api builds what the run is given (the target, the pass instances, the options) and
calls it; the run imports nothing above the pipeline but what the target and the passes hand it.
"""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Callable, Collection, Iterator, NamedTuple, Optional, Sequence, Union

import onnx
from onnx.external_data_helper import uses_external_data

from .. import modelio
from ..errors import (InputError, InvalidOutputError, K3optError, OutputError, UnverifiableError, UsageError,
                      VerificationError)
from ..graph.lifetime import graph_scope, return_freed_memory
from ..graph import ir
from ..modelio import opset as opsets
from ..modelio.opset23_down import decompose_opset23
from ..modelio.traced_experts import traced_experts_warnings
from ..report import ModelSummary, Report
from . import shapes, static_faults, verify as verifier, verify_dims
from .random_outputs import random_outputs
from .manager import PassManager
from .pass_base import Pass, PassContext

ModelLike = Union[onnx.ModelProto, str, os.PathLike]
ProgressSink = Optional[Callable[[str], None]]

#: Bounds for verifying a lowered model with a reference evaluator (onnx's: pure Python per node, and it
#: keeps every intermediate value): larger models are skipped with a warning.
REFERENCE_MAX_NODES = 20_000
REFERENCE_MAX_BYTES = 512 << 20



class Run:
    """One optimization run: the target, the passes, the report, progress sink and verification settings; the
    model's state between the stages lives on the run (``self.model``, ``self.out``...)."""

    #: The stages, in the order :meth:`optimize` runs them (``write`` is :meth:`write`, for a file).
    STAGES = ("load", "fix_inputs", "reference", "opset_up", "run_passes", "opset_down", "verify", "lower")

    def __init__(
        self, target: Any, passes: Sequence[Pass], report: Report, *, opset: Optional[int] = None,
        input_shapes: Optional[shapes.InputShapes] = None, verify: bool = False, progress: ProgressSink = None,
        rtol: Optional[float] = None, atol: Optional[float] = None, input_data: Any = None, seed: int = 0,
        verify_memory: Optional[int] = None, pass_options: Optional[dict[str, Any]] = None,
        blockwise: Optional[Callable[["Run", onnx.ModelProto, Optional[int]], Any]] = None,
        after_lowering: Collection[type] = (),
    ):
        self.target = target
        self.report = report
        report.target = target.name
        self.opset, self.input_shapes, self.verify_wanted = opset, input_shapes, verify
        self.progress = progress
        self.rtol, self.atol, self.input_data, self.seed = rtol, atol, input_data, seed
        self.verify_memory = verify_memory  # bytes; over it, verification goes block by block (k3opt.blocks)
        #: ``(run, model, budget) -> block verifier or None`` (k3opt.blocks.run_hook.start, handed in by the api).
        self.start_blockwise = blockwise
        self.pass_options = dict(pass_options or {})
        # Target lowerings run after the verified passes; one for another target stays, to be skipped with a note.
        self.lowering = [p for p in passes if p.lowering and (p.targets is None or target in p.targets)]
        self.pipeline = [p for p in passes if p not in self.lowering]
        # The pipeline's passes of ``after_lowering`` (k3opt.passes.reruns_after_lowering: the clean-ups and
        # fold-constants) run again after a lowering: what lowering several layers repeats (one mask per layer...)
        # is merged there, so a second run finds nothing to do.
        if self.lowering:
            self.lowering += [type(p)() for p in self.pipeline if type(p) in after_lowering]
        #: The graph inputs' dims before --input-shape fixed some (verification sizes the rest to agree).
        self.declared_dims: Optional[dict[str, list]] = None
        #: Absolute paths of the input's external-data files (the output must not clobber them).
        self.source_files: set[str] = set()
        #: Size the optimized proto for the report (optimize_file takes the saved files' sizes).
        self.measure_output = True
        #: (feeds, onnxruntime's outputs of the original, output names), once verification ran them.
        self._expected: Optional[tuple[dict, list, list[str]]] = None
        #: What ran the original (onnxruntime, or the target's reference evaluator): it runs the optimized model.
        self._runner: Optional[_Runner] = None
        #: Why the original did not run, raised once the static checks found nothing more precise.
        self._deferred: Optional[K3optError] = None
        #: The feeds (and the original's outputs) at a second size of the symbolic dims, when there is one.
        self._again: Optional[verify_dims.Feeds] = None
        #: Outputs of the original whose values change on every run: compared by type and shape only.
        self._random: dict[str, str] = {}
        # The model between the stages.
        self.model: Optional[onnx.ModelProto] = None
        self.out: Optional[onnx.ModelProto] = None
        self.external: list = []
        self.bodies = True
        self.opset_before = 0
        #: The model as the run was given it (a path or a proto never mutated): bisection prepares it again.
        self._source: Optional[ModelLike] = None
        #: Whether the opset conversion (or the opset-23 decomposition) changed the model before the passes.
        self._converted = False
        self.blockwise: Any = None
        self.down = False
        self.decomposed = 0
        #: Types of the decomposed opset-23 nodes' outputs, as the ops define them (every shape refresh gets them).
        self.shape_facts: shapes.ShapeFacts = {}
        self.before_down: Optional[onnx.ModelProto] = None
        self.ctx: Optional[PassContext] = None
        self.manager: Optional[PassManager] = None

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

    def optimize(self, model: ModelLike) -> onnx.ModelProto:
        """Run the stages on ``model`` (a proto, never mutated, or a path); the optimized proto."""
        self._source = model
        try:
            self.load(model)
            self.fix_inputs()
            self.reference()
            self.opset_up()
            self.run_passes()
            self.opset_down()
            self.verify()
            self.lower()
        except K3optError:
            raise
        except UnicodeDecodeError as exc:  # protobuf decodes a string field when read: one of the input's is no UTF-8
            raise InputError(f"{self._input_name()}: a name or text field is not UTF-8 ({exc.reason} at byte "
                             f"{exc.start}); nothing was written") from None
        except Exception:  # a pass (or conversion) failed: on an input onnxruntime or onnx's checker refuses, that
            fault = self._input_fault()  # is the input's fault
            if fault is not None:
                raise InputError(f"the input {self._input_name()} does not load in onnxruntime: {fault}; nothing "
                                 "was written") from None
            fault = modelio.input_checker_fault(self.report.input or None)
            if fault is not None:
                raise InputError(f"the input fails onnx's checker: {fault}; nothing was written") from None
            raise
        assert self.out is not None
        # optimize_file measures the files it writes instead (sizing the proto costs a pass over it)
        size = modelio.proto_size(self.out) if self.measure_output else 0
        self.report.after = ModelSummary.of(self.out, size, opsets.model_opset(self.out))
        return self.out

    def load(self, model: ModelLike) -> None:
        """Read and check the model (external weights stay on disk), repair what can be, let the target adopt it."""
        report = self.report
        with self.step("loading", "load"):
            on_disk = None if isinstance(model, onnx.ModelProto) else model
            self.model, self.external, self.bodies = _load(model, report)
            report.notes.extend(modelio.repair(self.model, self.bodies))
            report.warnings.extend(traced_experts_warnings(self.model))
            self.target.adopt_input(self.model, report)
            self.source_files = {modelio.external_info(t)["location"] for t in self.external}
            self.opset_before = opsets.model_opset(self.model)
            size = modelio.proto_size(self.model, None if on_disk is None else os.path.getsize(on_disk),
                                      self.external)
            report.before = ModelSummary.of(self.model, size, self.opset_before)

    def fix_inputs(self) -> None:
        """--input-shape, after noting the declared dims (verification sizes the others to agree)."""
        self.declared_dims = verify_dims.declared_dims(self.model) if self.verify_wanted else None
        shapes.fix_inputs(self.model, self.input_shapes)

    def reference(self) -> None:
        """Run the model as given now, before the passes, and keep only its inputs and outputs (or start a
        block-wise verifier for a big one): the original's session and weights are gone before the passes
        make the optimized model, so verification never holds two models' weights at once."""
        if not self.verify_wanted:
            return
        if self.start_blockwise is not None:
            self.blockwise = self.start_blockwise(self, self.model, self.verify_memory)
        if self.blockwise is None:
            with self.step("running the original", "verify"):
                self._run_original(self.model)
            return_freed_memory()  # the original's session and weight copies

    def opset_up(self) -> None:
        """Up before the passes (fusions may need the newer opset); down comes after them (opset.converts_down)."""
        model, opset, target, report = self.model, self.opset, self.target, self.report
        self.down = opsets.converts_down(model, opset, target=target)
        self.decomposed = self._decompose_opset23(model, opsets.wanted_opset(model, opset, target=target)
                                                  ) if self.down else 0
        if not self.down:
            with self.step("converting opset", "opset"):
                model, notes = opsets.convert(
                    model, opset, target=target, bodies=self.bodies,
                    needs_newer=lambda ops, v: any(p.min_opset > v and p.could_apply(ops) for p in self.pipeline))
                report.notes.extend(notes)
        # Verification compares with the model as given; bisection restarts from the converted one.
        self._converted = opsets.model_opset(model) != self.opset_before or bool(self.decomposed)
        self.model = model  # the conversion touches no external tensor: self.external still holds

    def run_passes(self) -> None:
        """Import the graph, run the passes to a fixed point, export; the report gets their statistics."""
        model, report = self.model, self.report
        ctx = self.ctx = PassContext(
            opset=opsets.model_opset(model), target=self.target, options=dict(self.pass_options),
            output_opset=opsets.wanted_opset(model, self.opset, target=self.target) if self.down else None)
        refresher = shapes.ShapeRefresher(self.shape_facts)
        manager = self.manager = PassManager(self.pipeline, shape_inference=refresher, progress=self._pass_progress())
        with self.step("running passes", "passes"), graph_scope():
            # fold-constants' first step, done on the proto: the lifted literals are never inferred or imported
            lifted = modelio.lift_constant_nodes(model) if not self.bodies and manager.lifts_constants_first(ctx) else []
            graph = modelio.import_graph(model, self.external)
            tensors = ir.tensor_map(graph)  # one walk for the run's fresh names and the seed's shapes
            graphs = None if self.bodies else [graph]  # validation saw no body: none to walk for
            ctx.names = ir.NameScope(graph, tensors, graphs)
            ctx.names.reserve(lifted)
            if any(p.needs_shapes for p in self.pipeline):  # the manager then skips a first refresh
                ctx.shapes_available = refresher.seed(graph, model, tensors)
            static_faults.check(graph, self._input_name())  # before a pass folds or moves the faulty node
            if self._deferred is not None:  # the original did not run, and no static check says why better
                raise self._deferred
            manager.run(graph, ctx, graphs=graphs, lifted=len(lifted))
            self.out = modelio.export_graph(graph, model)
        ctx.forget_graph()
        self.model = None  # the input's proto: what the passes kept of it is in self.out (bisection reads it again)
        return_freed_memory()
        report.passes = [manager.stats[p.name].as_dict() for p in self.pipeline]
        report.rounds = manager.rounds
        report.counters = {k: v for k, v in sorted(ctx.counters.items()) if v}
        report.sites = ctx.site_records()
        self._refresher_notes = refresher.notes

    def opset_down(self) -> None:
        """Down to a lower wanted opset after the passes (they often make the constants it needs)."""
        if self.down:
            with self.step("converting opset", "opset"):
                self.before_down = self.out
                if self._expected is not None:  # the conversion works in place; verification needs the passes' output
                    self.before_down = onnx.ModelProto()
                    self.before_down.CopyFrom(self.out)
                self.out, notes = opsets.convert(self.out, self.opset, target=self.target)
                self.report.notes.extend(notes)
        assert self.ctx is not None
        self.report.notes.extend(self._refresher_notes + [n for n in self.ctx.notes if n not in self.report.notes])

    def verify(self) -> None:
        """Compare with the model as given in onnxruntime (whole, or block by block); raise on divergence."""
        if self._expected is not None:
            with self.step("verifying", "verify"):
                self._verify(self.out, self.manager, self.pipeline, self.ctx, self.before_down)
        elif self.blockwise is not None:
            with self.step("verifying block by block", "verify"):
                self.blockwise.finish(self.before_down or self.out, self.manager, self.pipeline, self.ctx)

    def lower(self) -> None:
        """The target's lowering passes on the verified model, its form, and the reference evaluator's check."""
        if self.lowering or self.target.lowers:
            with self.step(f"lowering for {self.target}", "lower"):
                self.out, lowered_by = self._lower(self.out, self.lowering, self.target)
            if self._expected is not None and self.lowering:
                with self.step("verifying the lowering", "verify_lowering"):
                    self._verify_lowering(self.out, *lowered_by)
            elif self.blockwise is not None and self.lowering:
                with self.step("verifying the lowering block by block", "verify_lowering"):
                    _, manager, lowering, ctx = lowered_by
                    rtol, atol = self._lowering_tolerances(manager, lowering)
                    self.blockwise.finish_lowering(self.out, ctx.target.reference_evaluator(), ctx.target, rtol, atol)

    def write(self, src: Union[str, os.PathLike], out: Path, *, overwrite: bool, external_data: Optional[bool],
              fsync: bool) -> list[Path]:
        """Save the optimized model to ``out`` atomically, checked as the target wants; the files written.

        The run hands the model over (``self.out`` is None after): once written, nothing holds it while the
        check reads the file back."""
        report = self.report
        if not overwrite:
            for path in (out, modelio.data_path(out)):
                if os.path.abspath(path) in self.source_files:
                    raise OutputError(f"{path}: is an external-data file of the input; pass --overwrite to replace it")
        with self.step("saving", "save"):
            # merged weights are written straight into the output's data file, never spilled first
            try:
                return modelio.save(self._hand_over(), out, external_data=external_data, fsync=fsync,
                                    check=self.target.written_check(report))
            except InvalidOutputError:
                fault = modelio.input_checker_fault(src)  # a fault k3opt could not repair is the input's
                if fault is not None:
                    raise InputError(f"the input fails onnx's checker: {fault}; nothing was written") from None
                fault = verifier.load_fault(Path(src))  # nor is one onnxruntime finds in the input too
                if fault is not None:
                    raise InputError(f"the input {src} does not load in onnxruntime: {fault}; nothing was written"
                                     ) from None
                raise

    def _hand_over(self) -> onnx.ModelProto:
        """The optimized model, which the run (and the proto of its last opset conversion) no longer holds."""
        out, self.out, self.before_down = self.out, None, None
        assert out is not None
        return out

    def _decompose_opset23(self, model: onnx.ModelProto, wanted: int) -> int:
        """Below opset 23, write its Attention/RMSNormalization/RotaryEmbedding nodes decomposed (in place), for
        the passes to lower or re-fuse; returns how many."""
        if wanted >= 23:
            return 0
        done, kept, self.shape_facts = decompose_opset23(model)
        if done:
            self.report.notes.append(f"{done} opset-23 node(s) (Attention, RMSNormalization, RotaryEmbedding) "
                                     f"written in their decomposed form for opset {wanted}")
        self.report.notes.extend(kept)
        return done

    def _lower(self, model: onnx.ModelProto, lowering: list, target: Any) -> tuple[onnx.ModelProto, tuple]:
        """Run the target's lowering passes on the verified ``model`` (its notes are the report's lowering
        lines), export, and put the result in the target's form (:meth:`Target.finish`).

        Returns the lowered model and what :meth:`_verify_lowering` needs to bisect a divergence.
        """
        ctx = PassContext(opset=opsets.model_opset(model), target=target, options=dict(self.pass_options))
        refresher = shapes.ShapeRefresher(self.shape_facts)
        manager = PassManager(lowering, shape_inference=refresher, progress=self._pass_progress())
        with graph_scope():
            graph = modelio.import_graph(model)
            manager.run(graph, ctx)
            out = target.finish(modelio.export_graph(graph, model))
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
        rtol, atol = self._lowering_tolerances(manager, lowering)

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
            return verifier.compare(expected, actual, names, rtol=rtol, atol=atol, random=self._random)

        result = report.lowering_verification = result_of(out)
        if result["status"] == "passed":
            return
        start = verifier.runnable_bytes(before)  # the lowering's input, its weights inlined for fresh imports
        culprit = self._bisect(lambda: onnx.load_from_string(start), False, manager, lowering, ctx,
                               lambda candidate: result_of(ctx.target.finish(candidate)), result)
        detail = verifier.failure_detail(result)
        raise VerificationError(f"the lowered model differs from the original under the {ctx.target} reference "
                                f"evaluator ({detail}){culprit}")

    def _lowering_tolerances(self, manager: PassManager, lowering: list) -> tuple[Optional[float], Optional[float]]:
        """The given tolerances; unless one is given, a lowering through float16 is verified at fp16's."""
        loosest = max((p.tolerance for p in lowering if getattr(p, "tolerance", None) and manager.stats[p.name].rewrites),
                      default=None)
        if loosest is not None and self.rtol is None and self.atol is None:
            return loosest
        return self.rtol, self.atol

    def _pass_progress(self) -> ProgressSink:
        if self.progress is None:
            return None
        progress = self.progress

        def announce(msg: str) -> None:  # the manager says "round N: pass-name"
            round_, _, name = msg.partition(": ")
            progress(f"running pass {name} ({round_})" if name else msg)

        return announce

    def _target_runner(self, proto: onnx.ModelProto, why: str) -> "tuple[_Runner, Any] | str":
        """The target's reference evaluator and its session of the original, when onnxruntime cannot run the
        original because it holds the target's own ops (a cann output read back in); else why verification is
        skipped."""
        skip = f"original model: {why}"
        ops = self.target.own_ops(proto)
        evaluate = self.target.reference_evaluator()
        if not ops or evaluate is None:
            return skip
        if len(proto.graph.node) > REFERENCE_MAX_NODES or modelio.proto_size(proto) > REFERENCE_MAX_BYTES:
            return (f"{skip}; the input's {self.target.ops_kind} ({', '.join(ops)}) run only under the {self.target} "
                    f"reference evaluator, and the model is over its bound ({REFERENCE_MAX_NODES} nodes, "
                    f"{REFERENCE_MAX_BYTES >> 20} MB)")
        runner = _Runner(f"the {self.target} reference evaluator", lambda model: evaluate(_inlined(model)),
                         lambda s, feeds: s.run(None, dict(feeds)))
        self.report.notes.append(f"verified under the {self.target} reference evaluator: onnxruntime cannot run the "
                                 f"input's {self.target.ops_kind} ({', '.join(ops)})")
        return runner, runner.load(proto)

    def _input_fault(self) -> Optional[str]:
        """Why onnxruntime does not load the input as given (None: it loads, or cannot be asked)."""
        if self.report.input:
            return verifier.load_fault(Path(self.report.input))
        if isinstance(self._source, onnx.ModelProto):  # a failing run only: the copy costs nothing otherwise
            return verifier.load_fault(self._source.SerializeToString())
        return None

    def _input_name(self) -> str:
        return self.report.input or "model"

    def _skip_verification(self, reason: str) -> None:
        self.report.verification = verifier.skipped(reason)
        self.report.warnings.append(f"verification skipped: {reason}")

    def _run_original(self, proto: onnx.ModelProto) -> None:
        """Run the model as given (``proto``, its inputs fixed) and keep its inputs and outputs for :meth:`_verify`;
        a model nothing can run is skipped with a warning, an input onnxruntime refuses is the input's fault."""
        names = [o.name for o in proto.graph.output]
        random = self._random = random_outputs(proto)
        if random and set(random) >= set(names):
            first = next(iter(random.values()))
            raise UnverifiableError(f"verification cannot run: every output depends on the unseeded random node "
                                    f"{first}, whose values differ on every run; nothing was written (--no-verify "
                                    "writes the model unverified; a seed attribute makes it comparable)")
        if random:
            self.report.warnings.append(f"output(s) {', '.join(repr(n) for n in random)} compared by type and shape "
                                        f"only: they depend on the unseeded random node {next(iter(random.values()))}")
        runner = _ORT
        try:
            reference = verifier.reference_session(proto)
        except verifier.Unrunnable as exc:  # an op onnxruntime lacks: the target's own, or nothing can run it
            found = self._target_runner(proto, str(exc))
            if isinstance(found, str):
                return self._skip_verification(found)
            runner, reference = found
        except (K3optError, UnicodeDecodeError):
            raise
        except Exception as exc:  # noqa: BLE001 -- ORT's own error types: the input is at fault, not k3opt
            if verifier.out_of_memory(exc) or isinstance(exc, ImportError):
                raise _no_memory("loading the original", exc) from None
            # said after the static checks (run_passes), which name the node at fault where they find it
            self._deferred = InputError(f"the input {self._input_name()} does not load in onnxruntime: "
                                        f"{verifier.first_line(exc)}; nothing was written")
            return
        try:
            feeds = verifier.make_feeds(proto, seed=self.seed, input_data=self.input_data,
                                        declared=self.declared_dims, run=lambda f: runner.run(reference, f))
        except verifier.Unrunnable as exc:
            return self._skip_verification(f"original model: {exc}")
        except verify_dims.NoConsistentSizes as exc:  # the original runs at no size tried: nothing to compare
            if self.input_data is not None:
                raise UsageError(f"--input-data: {runner.name} cannot run the input on these arrays: "
                                 f"{verifier.first_line(exc.error)}") from None
            self._deferred = UnverifiableError(f"verification cannot run: {exc.describe()}; nothing was written "
                                               "(--no-verify writes the model unverified)")
            return
        sized = verify_dims.shapes_note(feeds)
        if sized:
            self.report.notes.append(sized)
        self._expected = (feeds, feeds.outputs, names)
        self._runner = runner
        # the second size (issue #34) is run now too: the original's session is gone once the passes start
        self._again = self._second_size(runner, reference, feeds)

    def _verify(self, out: onnx.ModelProto, manager: PassManager, pipeline: list, ctx: PassContext,
                before_down: Optional[onnx.ModelProto] = None) -> None:
        """Compare the optimized model with the original's outputs (:meth:`_run_original`), at the second size
        too; on divergence bisect and raise VerificationError. ``before_down``: the passes' output when the
        opset was then converted down."""
        assert self._expected is not None and self._runner is not None
        feeds, _, names = self._expected
        runner = self._runner
        loaded: dict = {}  # the optimized model's session, loaded once for both sizes
        result_of = self._comparer(runner, feeds, names, out, loaded)
        try:
            result = result_of(out)
        except verifier.Unrunnable as exc:  # onnxruntime ran the original: what it lacks, k3opt brought in
            opset = opsets.model_opset(out)
            at = f" at opset {opset}" if opset != self.opset_before else ""
            raise UnverifiableError(f"verification cannot run: onnxruntime runs the input but not the optimized "
                                    f"model{at} ({exc}); nothing was written (--no-verify writes the model "
                                    "unverified)") from None
        self.report.verification = result
        if runner is not _ORT:
            result["evaluator"] = runner.name
        if feeds.sizes:
            result["sizes"] = dict(feeds.sizes)
        at = ""
        if result["status"] == "passed":
            again = self._again
            if again is None:
                return None
            result_of = self._comparer(runner, again, names, out, loaded)
            second = result_of(out)
            if second["status"] == "passed":
                result["second_sizes"] = dict(again.sizes)
                self.report.notes.append(f"verified again at a second size: {verify_dims.format_sizes(again.sizes)}")
                return None
            second["sizes"], second["equal_at"] = dict(again.sizes), dict(feeds.sizes)
            if runner is not _ORT:
                second["evaluator"] = runner.name
            self.report.verification = result = second
            at = (f" at {verify_dims.format_sizes(again.sizes)}, though equal at "
                  f"{verify_dims.format_sizes(feeds.sizes)}")
        if before_down is not None and result_of(before_down)["status"] == "passed":
            self.report.verification["first_diverging_pass"] = "opset conversion"
            culprit = f"; the opset conversion to {opsets.model_opset(out)} after the passes diverges"
        else:
            if self.progress is not None:
                self.progress("finding the first diverging pass")
            culprit = self._bisect(self._fresh_start, self._converted, manager, pipeline, ctx, result_of)
        detail = verifier.failure_detail(result)
        raise VerificationError(f"optimized model differs from the original{at} ({detail}){culprit}")

    def _comparer(self, runner: "_Runner", feeds: verify_dims.Feeds, names: list[str], out: onnx.ModelProto,
                  loaded: dict) -> Callable[[onnx.ModelProto], dict[str, Any]]:
        """``result_of(candidate)``: the candidate run on ``feeds`` and compared with the original's outputs. The
        session of ``out`` (the optimized model) is kept in ``loaded`` for the next comparer of the run."""
        expected, random = feeds.outputs, self._random

        def result_of(candidate: onnx.ModelProto) -> dict[str, Any]:
            try:
                if candidate is out and "out" not in loaded:
                    loaded["out"] = runner.load(out)
                actual = runner.run(loaded["out"] if candidate is out else runner.load(candidate), feeds)
            except verifier.Unrunnable:
                raise
            except Exception as exc:  # the optimized model does not run: that is a failure
                if verifier.out_of_memory(exc):  # ... unless the machine ran out of memory (or threads)
                    raise _no_memory("running the optimized model") from None
                return verifier.failed(f"{runner.name} cannot run the optimized model: {verifier.first_line(exc)}",
                                       self.rtol, self.atol)
            if [o.name for o in candidate.graph.output] != names:
                return verifier.failed("the optimized model's outputs are not the original's", self.rtol, self.atol)
            return verifier.compare(expected, actual, names, rtol=self.rtol, atol=self.atol, random=random)

        return result_of

    def _second_size(self, runner: "_Runner", reference: Any, first: verify_dims.Feeds
                     ) -> Optional[verify_dims.Feeds]:
        """Feeds at other sizes of the symbolic dims than ``first``'s (free symbols at 3, then 4), on which the
        original runs; None when every symbol is pinned (or there is none), or when the original runs at no
        other size tried (a note says so).

        One size is not enough (issue #34): a rewrite can be exact at the sizes verification chose and wrong
        at others, as a Reshape target made constant from the batch size it saw."""
        if not first.sizes:
            return None
        try:
            return first.again(3, run=lambda f: runner.run(reference, f))
        except verify_dims.NoConsistentSizes as exc:
            if exc.tried:  # else every symbol is pinned (--input-shape, --input-data): there is no other size
                self.report.notes.append(f"verified at one size only: {runner.name} ran the original at none of the "
                                         f"{len(exc.tried)} other sizes tried (first: "
                                         f"{verify_dims.format_sizes(exc.tried[0])})")
            return None

    def _fresh_start(self) -> onnx.ModelProto:
        """The model the passes started from, prepared again from the source: bisection restarts from it, and
        keeping a copy through the whole run would hold the model's weights twice."""
        again = Run(self.target, self.pipeline, Report(), opset=self.opset, input_shapes=self.input_shapes,
                    pass_options=self.pass_options)
        again.load(self._source)
        again.fix_inputs()
        again.opset_up()
        assert again.model is not None
        return again.model

    def _bisect(self, start: Callable[[], onnx.ModelProto], converted: bool, manager: PassManager, pipeline: list,
                ctx: PassContext, result_of: Callable[[onnx.ModelProto], dict], record: Optional[dict] = None) -> str:
        """Re-run the passes on fresh imports of ``start()``, stopping after k steps, to find the first bad step.

        Step 0 (no pass) is a candidate when the opset was converted: the converter may be the culprit.
        The culprit is written into ``record`` (default: the report's verification).
        """
        record = self.report.verification if record is None else record
        candidates = ([0] if converted else []) + [i + 1 for i, s in enumerate(manager.steps) if s.rewrites]

        def diverges(k: int) -> bool:
            model = start()
            with graph_scope():
                graph = modelio.import_graph(model)
                fresh = PassContext(opset=ctx.opset, target=ctx.target, options=dict(ctx.options),
                                    output_opset=ctx.output_opset)
                PassManager([type(p)() for p in pipeline], shape_inference=shapes.ShapeRefresher(self.shape_facts)).run(
                    graph, fresh, max_steps=k)
                candidate = modelio.export_graph(graph, model)
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


class _Runner(NamedTuple):
    """What verification runs models with: onnxruntime, or a target's reference evaluator."""

    name: str
    #: A model (proto or bytes) -> what ``run`` takes.
    load: Callable[[Any], Any]
    #: (loaded model, feeds) -> the outputs in graph order.
    run: Callable[[Any, Any], list]


def _inlined(model: "bytes | onnx.ModelProto") -> onnx.ModelProto:
    """``model`` with its external data inlined (the reference evaluator reads no external data)."""
    return onnx.load_from_string(model if isinstance(model, bytes) else verifier.runnable_bytes(model))


_ORT = _Runner("onnxruntime", lambda model: verifier.session(model), lambda s, feeds: verifier.run(s, feeds))


def _no_memory(step: str, exc: Optional[BaseException] = None) -> UnverifiableError:
    """Verification stopped by the machine (memory, threads, onnxruntime's library not mapped), not the model."""
    why = f" ({verifier.first_line(exc)})" if isinstance(exc, ImportError) else ""
    return UnverifiableError(f"verification cannot run: onnxruntime ran out of memory {step}{why}; nothing was "
                             "written (--no-verify writes the model unverified)")


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
