"""Running ATC: streaming its output, judging success, surfacing its error codes with hints.

ATC's exit status alone is not trusted (public wrappers grep its output):
a run succeeded only when the status is 0 AND the success line was printed.
"""
from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from pathlib import Path
from typing import Callable, Optional, Sequence

from ..errors import CompileError

START_LINE = "ATC start working now"
SUCCESS_LINE = "ATC run success"
FAILURE_LINE = "ATC run failed"
_CODE_RE = re.compile(r"\b(E[0-9A-Z]\d{4}|W\d{5})\b")

#: What to do about the common ATC error codes.
HINTS = {
    "E10001": "a parameter value is invalid: check the flag ATC names (k3opt validates the ones it sets)",
    "E10007": "--framework is missing (k3opt always passes --framework=5)",
    "E10054": "a required parameter is empty",
    "E16005": "the model has more than one opset import: re-run with `k3opt optimize --target cann`",
    "E19010": "an op has no ATC parser: run `k3opt check --target cann MODEL` to list every such node",
    "EZ3003": "an op has no kernel for this SoC/dtype: try another --precision-mode, or check the op on this SoC",
    "E19999": "ATC inner error: rerun with --log debug and ASCEND_SLOG_PRINT_TO_STDOUT=1 for the detail",
}
_LIB_HINT = ("ATC cannot load the NPU driver libraries (libascend_hal.so): source set_env.sh, or add the "
             "driver's lib64 folder to LD_LIBRARY_PATH")


@dataclasses.dataclass
class AtcResult:
    """What one ATC run printed and returned."""

    returncode: int
    lines: list[str]

    @property
    def succeeded(self) -> bool:
        return self.returncode == 0 and any(SUCCESS_LINE in line for line in self.lines)

    def errors(self) -> list[tuple[str, str]]:
        """Each (error code, line) ATC printed, in order, first occurrence of a line only."""
        seen, found = set(), []
        for line in self.lines:
            for code in _CODE_RE.findall(line):
                if code.startswith("E") and (code, line) not in seen:
                    seen.add((code, line))
                    found.append((code, line.strip()))
        return found


def run_atc(cmd: Sequence[str], *, cwd: Optional[Path] = None,
            echo: Optional[Callable[[str], None]] = None) -> AtcResult:
    """Run ATC, passing each output line to ``echo`` as it comes; never raises for ATC's own failure."""
    try:
        proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", cwd=cwd, bufsize=1)
    except OSError as exc:
        raise CompileError(f"cannot run {cmd[0]}: {exc.strerror or exc}") from exc
    lines = []
    assert proc.stdout is not None
    with proc.stdout:
        for line in proc.stdout:
            line = line.rstrip("\n")
            lines.append(line)
            if echo:
                echo(line)
    return AtcResult(proc.wait(), lines)


def failure_message(result: AtcResult) -> str:
    """k3opt's error for a failed run: why it counts as failed, ATC's error lines and a hint per code."""
    if result.returncode == 0:
        why = "ATC exited 0 but never printed its success line"
    elif any(SUCCESS_LINE in line for line in result.lines):
        why = f"ATC printed its success line but exited with status {result.returncode}"
    else:
        why = f"ATC failed (exit status {result.returncode})"
    parts = [why]
    errors = result.errors()
    parts += [f"  {line}" for _, line in errors]
    for code in dict.fromkeys(code for code, _ in errors):
        if code in HINTS:
            parts.append(f"  hint {code}: {HINTS[code]}")
    if any("libascend_hal.so" in line for line in result.lines):
        parts.append(f"  hint: {_LIB_HINT}")
    if not errors and len(parts) == 1:
        parts += [f"  {line}" for line in result.lines[-5:]]
    return "\n".join(parts)


def raise_for_result(result: AtcResult) -> None:
    """CompileError (exit status 1) unless the run succeeded."""
    if not result.succeeded:
        raise CompileError(failure_message(result))


def _times(value: object) -> int:
    try:
        return int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0


def summarize_fusion_result(path: Path) -> list[str]:
    """One line per fusion pass ATC applied, from its ``fusion_result.json`` (``match``/``effect`` times).

    The file maps each graph to ``graph_fusion`` / ``ub_fusion`` sections of
    ``{pass: {"match_times": n, "effect_times": n}}``; counts are summed over graphs.
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return [f"fusion_result.json unreadable: {exc}"]
    totals: dict[tuple[str, str], list[int]] = {}
    for graph in data.values() if isinstance(data, dict) else ():
        for kind in ("graph_fusion", "ub_fusion"):
            for name, times in (graph.get(kind) or {}).items() if isinstance(graph, dict) else ():
                t = totals.setdefault((kind, name), [0, 0])
                t[0] += _times(times.get("match_times"))
                t[1] += _times(times.get("effect_times"))
    effective = sorted((k, v) for k, v in totals.items() if v[1])
    lines = [f"ATC fusions: {len(effective)} of {len(totals)} passes took effect"]
    lines += [f"  {kind:12} {name}: matched {m}, applied {e}" for (kind, name), (m, e) in effective]
    return lines
