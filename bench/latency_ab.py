"""Interleaved A/B latency of N model files on the same inputs, for looking into one verdict.

``python -m bench.latency_ab A.onnx B.onnx [...] --feeds F.npz [--rounds 5] [--budget 2] [--level disabled|basic]
[--profile DIR] [--json OUT.json]``

Timing is the harness's own (:func:`bench.latency_rounds.rounds`: every round one fresh process
measuring all the files in turn, order rotating): per file the median of its round medians, their
range, and the ratio to the first file. ``--profile DIR`` then runs one profiled session per file
(onnxruntime's ``enable_profiling``) and prints per-op-type kernel time, to see which ops differ.
How it settled llama-3gb's "x1.12 of onnxslim" (noise: 11 rounds, k3opt/onnxslim 0.99, each file's
round medians 15-17 % apart) is in docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Optional

import numpy as np

from .evaluate import session
from .latency_rounds import rounds
from .procs import python_module, run_measured, write_result


def op_totals(profile_file: str, warmup: int) -> dict[str, float]:
    """Per-op-type kernel time (ms per run, median over the runs after ``warmup``) from a profile."""
    with open(profile_file) as f:
        events = json.load(f)
    runs = sorted((ev["ts"], ev["ts"] + ev["dur"]) for ev in events  # kernels lie inside their model_run
                  if ev.get("cat") == "Session" and ev.get("name") == "model_run")
    per_run = [defaultdict(float) for _ in runs]
    for ev in events:
        if ev.get("cat") != "Node" or not ev.get("name", "").endswith("_kernel_time"):
            continue
        op = ev.get("args", {}).get("op_name", "?")
        for k, (a, b) in enumerate(runs):
            if a <= ev["ts"] <= b:
                per_run[k][op] += ev["dur"] / 1e3
                break
    per_run = per_run[warmup:] or per_run
    ops = sorted({op for r in per_run for op in r})
    return {op: float(np.median([r.get(op, 0.0) for r in per_run])) for op in ops}


def profile_child(model: Path, feeds: Path, level: str, prefix: str, runs: int = 10, warmup: int = 3) -> None:
    """Child: profiled runs of one model; writes its per-op-type totals."""
    sess = session(model, level, profile_prefix=prefix)
    inputs = dict(np.load(feeds))
    for _ in range(warmup + runs):
        sess.run(None, inputs)
    write_result({"ops": op_totals(sess.end_profiling(), warmup)})


def main(argv: Optional[list[str]] = None) -> None:
    """Parent entry point (see the module docstring); ``--profile-child`` is the profiling worker."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--feeds", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget", type=float, default=2.0, help="seconds of timed runs per file and round")
    ap.add_argument("--level", choices=("disabled", "basic"), default="disabled")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per file and round")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--profile", type=Path, help="folder for one profiled process per model: op-type totals")
    ap.add_argument("--profile-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.profile_child:
        return profile_child(args.models[0], args.feeds, args.level, args.profile_child)
    merged = rounds(args.models, args.feeds, {"timeout_s": args.timeout}, args.budget, args.rounds)
    summary: dict = {}
    base = None
    print(f"{'model':40s} {'median ms':>10s} {'round medians':>21s} {'ratio':>6s}")
    for model, m in zip(args.models, merged):
        if "error" in m:
            print(f"{str(model):40s} {m['error']}")
            continue
        lat = m[args.level]
        base = base or lat["median_ms"]
        summary[str(model)] = {**lat, "ratio": lat["median_ms"] / base}
        print(f"{str(model)[-40:]:40s} {lat['median_ms']:10.2f} {min(lat['rounds_ms']):10.2f}-"
              f"{max(lat['rounds_ms']):10.2f} {lat['median_ms'] / base:6.3f}")
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
        totals = []
        for i, model in enumerate(args.models):
            cmd = python_module("bench.latency_ab", str(model), "--feeds", str(args.feeds), "--level", args.level,
                                "--profile-child", str(args.profile / f"{i}-{model.stem}"))
            res = run_measured(cmd, args.timeout)
            totals.append(res.payload["ops"] if res.status == "ok" else {})
        summary["op_totals_ms"] = totals  # in the order of the models
        ops = sorted({op for t in totals for op in t}, key=lambda o: -max(t.get(o, 0) for t in totals))
        print("\nper-op-type kernel time, ms per run (median of profiled runs), one column per model")
        for op in ops:
            print(f"{op:24s}" + "".join(f" {t.get(op, 0.0):10.2f}" for t in totals))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
