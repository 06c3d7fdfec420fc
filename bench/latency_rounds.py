"""Latency of one model's files (original and every result) measured in interleaved rounds.

Why: on this machine a file's latency moves more from one process to the next (memory placement; on
the benchmark VM, memory is backed on first touch) than within one process. Re-measuring the same file
in new processes moved its median by 10 % on the 3.3 GB Llama and by 35 % on a 0.3 ms export, while the
spread within each process was a few percent; measured once per file, that drift passed for a difference
between optimizers. So every round is one fresh process that measures all the files in turn, the order
rotating from round to round; a file's figure is the median of its round medians, and the spread of its
round medians is its noise (:func:`bench.report.goals` compares within it).

Child: ``python -m bench.latency_rounds [--levels=disabled,all] FEEDS.npz BUDGET MODEL...`` writes one result
per model (levels: those of :data:`bench.evaluate.SESSION_LEVELS`; default :data:`bench.evaluate.LEVELS`).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from .evaluate import LEVELS, latency, session
from .procs import python_module, run_measured, write_result


def measure(paths: list[Path], feeds: dict, budget_s: float, levels: Sequence[str] = tuple(LEVELS)) -> list[dict]:
    """Each file's latency at every level, one session at a time (big models: one in memory at once)."""
    results = []
    for path in paths:
        try:
            results.append({level: latency(session(path, level), feeds, budget_s) for level in levels})
        except Exception as exc:  # a file onnxruntime cannot run is a result for that file only
            results.append({"error": f"{type(exc).__name__}: {str(exc).strip()[:200]}"})
    return results


def rounds(paths: list[Path], feeds: Path, limits: dict, budget_s: float, count: int,
           levels: Sequence[str] = tuple(LEVELS)) -> list[dict]:
    """``count`` rounds over ``paths`` (order rotated each round); per file ``{level: merged}`` or ``{"error"}``."""
    per_file: list[list[dict]] = [[] for _ in paths]
    errors: list[str] = []
    n = len(paths)
    for r in range(count):
        order = [(r + k) % n for k in range(n)]
        cmd = python_module("bench.latency_rounds", f"--levels={','.join(levels)}", str(feeds), str(budget_s),
                            *(str(paths[i]) for i in order))
        res = run_measured(cmd, limits["timeout_s"] * n, limits.get("max_rss_mb"))
        if res.status != "ok":
            errors.append(f"round {r + 1} {res.status}: {res.error}")
            continue
        for i, got in zip(order, res.payload["latency"]):
            per_file[i].append(got)
    return [_merged(runs, errors, levels) for runs in per_file]


def _merged(runs: list[dict], errors: list[str], levels: Sequence[str]) -> dict:
    """One figure per level from a file's rounds: the median of the round medians, with those medians kept."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": next((r["error"] for r in runs if "error" in r), "; ".join(errors) or "not measured")}
    merged = {}
    for level in levels:
        medians = [r[level]["median_ms"] for r in ok]
        p25, p75 = np.percentile(medians, [25, 75])
        merged[level] = {"median_ms": float(np.median(medians)), "p25_ms": float(p25), "p75_ms": float(p75),
                         "rounds_ms": medians, "runs": sum(r[level]["runs"] for r in ok),
                         "wall_median_ms": float(np.median([r[level]["wall_median_ms"] for r in ok])),
                         "wall_min_ms": min(r[level]["wall_min_ms"] for r in ok)}
    return merged


def main(argv: Optional[list[str]] = None) -> None:
    """Child entry point (see module docstring)."""
    args = sys.argv[1:] if argv is None else argv
    levels: Sequence[str] = tuple(LEVELS)
    if args and args[0].startswith("--levels="):
        levels, args = tuple(args[0].split("=", 1)[1].split(",")), args[1:]
    feeds, budget, models = dict(np.load(args[0])), float(args[1]), [Path(p) for p in args[2:]]
    write_result({"latency": measure(models, feeds, budget, levels)})


if __name__ == "__main__":
    main()
