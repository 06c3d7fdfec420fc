"""What a target is: the hooks the run and the tools call, with standard ONNX's answers (the traits the passes
read are :class:`~k3opt.pipeline.target_traits.TargetTraits`, below the passes).

A target is one module or package of :mod:`k3opt.targets` holding a ``TARGET`` instance of a :class:`Target`
subclass; :func:`get_target` finds it by name (:func:`all_targets` walks the package's modules). The passes never import a target: they read the
traits of the one the run hands them in ``PassContext.target``.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import pkgutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional

import onnx

from ..errors import UsageError
from ..pipeline.target_traits import TargetTraits

if TYPE_CHECKING:
    from ..report import Report


class Target(TargetTraits):
    """A target of the run: the traits the passes read (:class:`~k3opt.pipeline.target_traits.TargetTraits`) and
    what the run and the tools ask of it. Compares equal to its name, so ``ctx.target == "cann"`` in a plugin keeps
    working; k3opt's own code asks the traits and hooks instead."""

    #: One line for ``--target``'s help.
    summary: ClassVar[str] = ""
    #: The target of a run that names none (exactly one target has it).
    default: ClassVar[bool] = False
    #: The output opset, when the target fixes it (``--opset`` must then agree); None: ``--opset`` or the
    #: model's, raised to at least 17.
    fixed_opset: ClassVar[Optional[int]] = None
    #: The run has a lowering stage (the target's form and invariants) even when no lowering pass is selected.
    lowers: ClassVar[bool] = False
    #: The ahead-of-time compiler the target's files are made for (cann: ``"atc"``, driven by
    #: :mod:`k3opt.cann_bridge`); None: they run as written.
    compiler: ClassVar[Optional[str]] = None
    #: Why ``k3opt quantize --quantize-embedding`` cannot serve the target (no lowering of a quantized Gather),
    #: or None.
    quantized_gather_refusal: ClassVar[Optional[str]] = None

    def own_passes(self) -> list[type]:
        """The target's own passes (its lowerings): the pass classes of its ``passes/`` package, if it has one."""
        from ..pipeline.pass_base import discover_passes

        module = type(self).__module__
        if importlib.util.find_spec(module).submodule_search_locations is None:  # a module: no passes/ in it
            return []
        return discover_passes(f"{module}.passes") if importlib.util.find_spec(f"{module}.passes") else []

    def own_ops(self, model: onnx.ModelProto) -> list[str]:
        """The op types in ``model`` (bodies included) that only this target runs: a file it wrote."""
        return []

    def adopt_input(self, model: onnx.ModelProto, report: "Report") -> None:
        """Take in an input that holds another target's ops: refuse it (a target that can keep its own ops
        read back in overrides this)."""
        for other in all_targets():
            ops = other.own_ops(model) if other != self else []
            if ops:
                raise UsageError(f"the model holds {other.ops_kind} ({', '.join(ops)}): it is a --target "
                                 f"{other.name} output; optimize it again with --target {other.name}")

    #: What :meth:`own_ops` finds, for messages ("NPU ops").
    ops_kind: ClassVar[str] = "ops"

    def check_record(self, path: "str | Path") -> Optional[dict]:
        """The report's ``check`` entry for a written file: what the target's toolchain will make of it (cann:
        ``k3opt check``'s findings), or None when there is nothing to check."""
        return None

    def quant_group_refusal(self, group: int) -> Optional[str]:
        """Why the target's weight-quantized matmul cannot take ``group`` rows of k per scale, or None."""
        return None

    def quant_weight_refusal(self, k: int, n: int, bits: int) -> Optional[str]:
        """Why the target's weight-quantized matmul cannot take a (k, n) weight of ``bits`` bits, or None."""
        return None

    def lower_quantized(self, model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
        """``k3opt quantize``'s model, at an opset above the target's (blocked DequantizeLinear is opset 21), with
        what the target's run could not take down lowered first; and the lowering's report lines. Only called
        for a target that :attr:`lowers`."""
        return model, []

    def verify_quantized(self, quantized: Path, lowered: Path) -> Optional[str]:
        """Check the written file ``lowered`` (the run of :meth:`lower_quantized`'s model, not verified by it)
        against the quantized model file it came from; the report line, or None when there is nothing to check.
        Raises VerificationError."""
        return None

    def bound_cache_reads(self, decode: onnx.ModelProto, position: str) -> int:
        """Let the attentions of a static-cache decode step (``k3opt llm``'s serving pair; ``position`` the graph
        input holding the step's slot) skip the cache slots past it, in place; returns how many it bounded.
        Changes no number: the step's mask hides those slots."""
        return 0

    def finish(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """The exported, lowered model in the target's form; raises CompileError when it breaks the target's
        invariants."""
        return model

    def reference_evaluator(self) -> Optional[Callable[[onnx.ModelProto], Any]]:
        """``model -> evaluator`` (with ``.run(None, feeds)``) that runs the lowered ops, or None (onnxruntime
        runs the target's files)."""
        return None

    def written_check(self, report: "Report") -> Callable[[Path], None]:
        """The check a written output must pass before it is renamed into place (``modelio.save``'s ``check``):
        it loads in onnxruntime (read back under onnx's checker when the verification already ran this graph
        there)."""
        from ..pipeline import verify as verifier

        def loads(path: Path) -> None:
            warning = verifier.check_loads(path, ran=(report.verification or {}).get("status") == "passed")
            if warning:
                report.warnings.append(warning)

        return loads


@functools.lru_cache(maxsize=None)  # the modules of the targets package: fixed for the process
def all_targets() -> tuple[Target, ...]:
    """Every target (the ``TARGET`` of each module or package beside this one), the default first, then by name."""
    package = __name__.rsplit(".", 1)[0]
    found = [importlib.import_module(f"{package}.{info.name}").TARGET
             for info in pkgutil.iter_modules([str(Path(__file__).parent)])
             if not info.name.startswith("_") and info.name != "base"]
    return tuple(sorted(found, key=lambda t: (not t.default, t.name)))


def names() -> tuple[str, ...]:
    """The targets' names, the default first (``--target``'s choices)."""
    return tuple(t.name for t in all_targets())


def get_target(target: "str | Target") -> Target:
    """The target named ``target`` (a Target is returned as it is); UsageError for an unknown name."""
    if isinstance(target, Target):
        return target
    for t in all_targets():
        if t.name == target:
            return t
    raise UsageError(f"unknown target '{target}'; choose one of {', '.join(names())}")
