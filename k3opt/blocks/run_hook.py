"""Block-wise verification inside an optimize run: when the whole model is over the verification budget.

The run (``k3opt.api``'s) calls :func:`start` where it would prepare the whole-model verification: it
returns None when the whole model fits the budget (three times its bytes: the original, the optimized
and onnxruntime's copies), else a :class:`BlockRun` holding a copy of the model as given (structure only
for external data). After the passes, :meth:`BlockRun.finish` cuts and compares block by block, bisects a
divergence to the first pass with the diverging block alone, and raises VerificationError then.
"""
from __future__ import annotations

import re
from typing import Any, Optional

import onnx

from ..errors import UnverifiableError, UsageError, VerificationError
from ..report import size_text
from ..pipeline import verify as verifier, verify_dims
from . import plan
from .structure import NoLayers
from .verify import Cut, run_original, summary, verify

#: Default --verify-memory: the memory verification may use for weights (whole model, or one block group).
DEFAULT_BUDGET = 1 << 30
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "G": 1 << 30, "GB": 1 << 30,
          "T": 1 << 40, "TB": 1 << 40}


def parse_size(text: str, option: str = "--verify-memory") -> int:
    """``4GB``, ``512MB``, ``1.5G``, ``1000000`` -> bytes (binary units); raises UsageError naming ``option``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?B?)\s*", str(text).upper())
    if not m or float(m.group(1)) <= 0:
        raise UsageError(f"{option}: '{text}' is not a size such as 4GB or 512MB")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def start(run: Any, model: onnx.ModelProto, budget: Optional[int]) -> Optional["BlockRun"]:
    """A BlockRun when ``model`` (as given, before any conversion) is over the budget for a whole-model check."""
    budget = DEFAULT_BUDGET if budget is None else budget
    if 3 * run.report.before.size_bytes <= budget:
        return None
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return BlockRun(run, copy, budget)


class BlockRun:
    """The block-wise verification of one optimize run."""

    def __init__(self, run: Any, original: onnx.ModelProto, budget: int):
        self.run, self.original, self.budget = run, original, budget
        self.feeds: Any = None  # the verification's inputs, once chosen (the lowering is checked on them too)
        self.boundaries: Optional[list[str]] = None  # where that verification cut the original
        self.originals: list = []  # the original blocks' outputs on those inputs, for the lowering's check

    def finish(self, out: onnx.ModelProto, manager: Any, pipeline: list, ctx: Any) -> None:
        """Verify ``out`` block by block; record the result in the run's report, raise on divergence."""
        run, report = self.run, self.run.report
        size = size_text(report.before.size_bytes)
        try:
            cut = Cut(self.original, out, self.budget)
        except NoLayers as exc:
            return run._skip_verification(f"model is {size}, over what --verify-memory allows for a whole-model "
                                          f"check, and it cannot be cut into blocks ({exc})")
        except plan.TooLarge as exc:
            return run._skip_verification(f"{exc}: over --verify-memory ({size_text(self.budget)}) even "
                                          "block by block; raise --verify-memory to verify it")
        try:
            feeds = verifier.make_feeds(self.original, seed=run.seed, input_data=run.input_data,
                                        declared=run.declared_dims, run=lambda f: run_original(cut, f))
            result = verify(cut, dict(feeds), rtol=run.rtol, atol=run.atol, originals=self.originals)
            self.feeds, self.boundaries = feeds, cut.boundaries
        except verifier.Unrunnable as exc:
            return run._skip_verification(f"original model: {exc}")
        except verify_dims.NoConsistentSizes as exc:  # as the whole-model check: nothing compared, nothing written
            raise UnverifiableError(f"verification cannot run: {exc.describe()}; nothing was written "
                                    "(--no-verify writes the model unverified)") from None
        report.verification = result
        report.notes.append(summary(result))
        if result["status"] == "passed":
            return
        k = result["first_diverging_block"]
        if run.progress is not None:
            run.progress(f"finding the first diverging pass (block {k})")
        start = self._start(ctx)
        culprit = run._bisect(lambda: onnx.load_from_string(start), self._converted(ctx), manager, pipeline, ctx,
                              lambda candidate: _block_result(self.original, candidate, cut, feeds, k, run), result)
        raise VerificationError(f"optimized model differs from the original block by block: {result['reason']}"
                                f"{culprit}")

    def finish_lowering(self, lowered: onnx.ModelProto, evaluator: Any, target: Any, rtol: Optional[float],
                        atol: Optional[float]) -> None:
        """Verify the lowered model block by block, its blocks run by the target's reference ``evaluator``,
        against the original's on the inputs the optimization was verified on; raise on divergence."""
        report = self.run.report
        why = None
        if self.feeds is None:
            why = "the block-wise verification of the optimization did not run"
        elif evaluator is None:
            why = f"no reference evaluator for target {target}"
        if why is None:
            try:
                cut = Cut(self.original, lowered, self.budget)
            except (NoLayers, plan.TooLarge) as exc:
                why = f"the lowered model cannot be cut into blocks: {exc}"
        if why is not None:
            report.lowering_verification = verifier.skipped(why)
            report.warnings.append(f"verification of the lowering skipped: {why}")
            return
        same = cut.boundaries == self.boundaries  # the same original blocks: their outputs are known
        result = report.lowering_verification = verify(cut, dict(self.feeds), rtol=rtol, atol=atol,
                                                       evaluator=evaluator, originals=self.originals if same else None)
        report.notes.append(summary(result).replace("verified", "lowering verified (reference evaluator)", 1))
        if result["status"] != "passed":
            raise VerificationError(f"the lowered model differs from the original under the {target} reference "
                                    f"evaluator, block by block: {result['reason']}")

    def _converted(self, ctx: Any) -> bool:
        from ..modelio.opset import model_opset

        return model_opset(self.original) != ctx.opset

    def _start(self, ctx: Any) -> bytes:
        """The passes' starting point, structure only: the model as given, converted to the run's opset."""
        from ..modelio import opset as opsets

        model = onnx.ModelProto()
        model.CopyFrom(self.original)
        if self._converted(ctx):
            model, _ = opsets.convert(model, ctx.opset, target=ctx.target)
        return model.SerializeToString()


def _block_result(original: onnx.ModelProto, candidate: onnx.ModelProto, cut: Cut, feeds: Any, k: int,
                  run: Any) -> dict[str, Any]:
    """The candidate's verification up to block ``k`` (the one that diverged): what bisection decides on."""
    try:
        again = Cut(original, candidate, cut.budget)
    except (NoLayers, plan.TooLarge) as exc:
        return verifier.failed(f"cannot cut the candidate into blocks: {exc}", run.rtol, run.atol)
    return verify(again, dict(feeds), rtol=run.rtol, atol=run.atol,
                  stop_after=k)
