"""What an optimization run did: the Report object, its JSON form and the CLI table."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

import onnx

from .errors import OutputError
from .pipeline.verify import error_figures, summary_line


def op_counts(model: onnx.ModelProto) -> dict[str, int]:
    """Node count per op type in the main graph (``domain::Op`` for non-default domains)."""
    counts: dict[str, int] = {}
    for n in model.graph.node:
        key = n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


@dataclasses.dataclass
class ModelSummary:
    """Size and op mix of one model."""

    nodes: int
    ops: dict[str, int]
    size_bytes: int
    opset: int

    @classmethod
    def of(cls, model: onnx.ModelProto, size_bytes: int, opset: int) -> "ModelSummary":
        return cls(len(model.graph.node), op_counts(model), size_bytes, opset)


@dataclasses.dataclass
class Report:
    """Everything a run produced besides the model; ``as_dict`` is the --report JSON."""

    input: Optional[str] = None
    output: Optional[str] = None
    target: str = "onnx"
    before: Optional[ModelSummary] = None
    after: Optional[ModelSummary] = None
    passes: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    rounds: int = 0
    #: The passes' own counters (``PassContext.counters``, e.g. rmsnorm_found) over the run;
    #: each entry of ``passes`` has the part that pass counted.
    counters: dict[str, int] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    #: Each fusion candidate's outcome and each pass's notes: dicts with pass, rule, site, status
    #: ("applied", "declined", "note") and reason (see ``PassContext.site``).
    sites: list[dict[str, str]] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    verification: Optional[dict[str, Any]] = None
    lowering: list[str] = dataclasses.field(default_factory=list)
    #: ``k3opt check`` of the output for --target cann, when run: {"model", "findings": [str, ...]}.
    check: Optional[dict[str, Any]] = None
    #: The lowered model (target cann) run by the reference evaluator vs onnxruntime's original outputs.
    lowering_verification: Optional[dict[str, Any]] = None
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    files: list[str] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def write_json(self, path: str | Path) -> None:
        """Write ``as_dict`` as JSON (OutputError when the file cannot be written); ``--report F.html`` is
        :func:`k3opt.report_html.write_report`'s."""
        write_report_text(path, json.dumps(self.as_dict(), indent=2, sort_keys=True) + "\n")

    def table(self) -> str:
        """The compact before/after summary the CLI prints."""
        lines: list[str] = []
        if self.before and self.after:
            b, a = self.before, self.after
            lines.append(f"{'':24}{'before':>12}{'after':>12}")
            lines.append(f"{'nodes':24}{b.nodes:>12}{a.nodes:>12}")
            lines.append(f"{'size':24}{size_text(b.size_bytes):>12}{size_text(a.size_bytes):>12}")
            if b.opset != a.opset:
                lines.append(f"{'opset':24}{b.opset:>12}{a.opset:>12}")
            for op in sorted(set(b.ops) | set(a.ops)):
                if b.ops.get(op, 0) != a.ops.get(op, 0):
                    lines.append(f"{'  ' + op:24}{b.ops.get(op, 0):>12}{a.ops.get(op, 0):>12}")
        active = [p for p in self.passes if p["rewrites"] or p["skipped"] or p.get("counters")]
        if active:
            lines.append(f"{'pass':32}{'rewrites':>10}{'time':>10}")
            for p in active:
                label = p["name"] + (f" [{p['plugin']}]" if p.get("plugin") else "")
                if p["skipped"]:
                    lines.append(f"{label:32}{'skipped':>10}{'':>10}")
                else:
                    lines.append(f"{label:32}{p['rewrites']:>10}{p['time_s']:>9.2f}s")
                lines.extend(f"{'  ' + key:32}{value:>10}" for key, value in sorted(p.get("counters", {}).items()))
        if self.verification:
            under = self.verification.get("evaluator")
            lines.append(f"verification{f' ({under})' if under else ''}: " + summary_line(self.verification))
            outputs = self.verification["outputs"]
            if 1 < len(outputs) <= 8:
                lines.extend(f"  {o['name']}: {error_figures(o)}" + ("" if o["passed"] else "  FAILED")
                             for o in outputs)
        lines.extend(f"note: {n}" for n in self.notes)
        lines.extend(f"cann: {n}" for n in self.lowering)
        if self.lowering_verification:
            lines.append("lowering verification (reference evaluator): "
                         + summary_line(self.lowering_verification))
        if self.output:
            lines.append(f"wrote {self.output}")
        return "\n".join(lines)


def write_report_text(path: str | Path, text: str) -> None:
    """Write a report's text (OutputError when the file cannot be written)."""
    from .modelio.output_paths import write_text

    try:
        write_text(path, text)
    except OSError as exc:
        raise OutputError(f"{path}: cannot write report ({exc.strerror or exc})") from None


def size_text(n: int) -> str:
    value = float(n)
    for unit in ("B", "KB", "MB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GB"
