"""The shared frame of the cann lowerings that turn one recognised pattern into one NPU op: what each lowered and
kept (with the reason), reported once as the report's lowering lines."""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Optional

from ..soc_support import missing_kernel
from ....graph.ir import Graph
from ....patterns import Rule
from ....pipeline.analyses import Shapes
from ....pipeline.pass_base import Hints, Pass, PassContext


class NPULowering(Pass):
    """Base of a target-cann lowering to :attr:`npu_op`: the rules are :attr:`recogniser` called with the
    subclass's ``_rewrite``, which appends to :attr:`lowered` and :attr:`kept`."""

    targets = ("cann",)
    lowering = True
    needs_shapes = True
    #: The replaced value keeps its dtype and shape; re-inferring would lose shapes: onnx's inference does not
    #: know NPU ops.
    preserves = frozenset({Shapes})
    _hints = Hints(adds_bodies=False)
    #: The NPU op the lines name, e.g. ``NPURmsNorm``.
    npu_op: ClassVar[str] = ""
    #: What is lowered, singular (the count line adds "(s)").
    what: ClassVar[str] = ""
    #: The count line's closing remark, e.g. ``(mode 0)``.
    remark: ClassVar[str] = ""
    #: Whether "no <what> found" is a line of its own (off: a model without one gets no line at all).
    note_none: ClassVar[bool] = True
    #: ``rewrite -> rules``: the shared recogniser's entry point (a staticmethod).
    recogniser: ClassVar[Callable[[Callable[..., Any]], list[Rule]]]

    options = {"soc_version": "the Ascend SoC (e.g. Ascend910B3; `k3opt compile --soc-version` sets it): a lowering "
                              "to an NPU op with no kernel there does not run (default: any SoC)"}

    def skip_reason(self, ctx: PassContext) -> Optional[str]:
        return missing_kernel(self.npu_op, ctx.options.get("soc_version"))

    def __init__(self) -> None:
        self.lowered: list[str] = []
        #: where -> reason; several rules may offer the same pattern again.
        self.kept: dict[str, str] = {}
        self.rules = self.recogniser(self._rewrite)

    def _rewrite(self, op: Any, match: Any) -> Any:
        raise NotImplementedError

    def finish(self, graph: Graph, ctx: PassContext) -> None:
        """The lowering lines: how many became :attr:`npu_op`, each one, and why the others did not."""
        total = len(self.lowered) + len(self.kept)
        if not total:
            if self.note_none:
                ctx.note(f"{self.npu_op}: no {self.what} found")
            return
        ctx.note(f"{self.npu_op}: {len(self.lowered)} of {total} {self.what}(s) lowered {self.remark}")
        for line in [*self.lowered, *self.kept.values()]:
            ctx.note(line)
