"""Interleaved A/B latency comparison of N model files on the same inputs.

``python -m bench.latency_ab A.onnx B.onnx [C.onnx ...] --feeds F.npz [--rounds 3] [--runs 15]
[--warmup 3] [--level disabled|basic] [--json OUT.json] [--profile DIR]``

The harness's single evaluation per model (``bench.evaluate`` with a time budget: only 5 runs of a
350 ms model) cannot separate a few percent from the drift of a shared machine: load from the other
user, page cache, frequency. This tool measures every model in a FRESH process (one at a time, so they
never compete for the cores), in interleaved order ``A B C A B C ...`` over ``--rounds`` rounds, each
process doing ``--warmup`` warm-ups and ``--runs`` timed runs on a single-threaded CPU session (as
``bench.evaluate.session``). Any drift then hits every model alike.

Reported per model: the median of the per-process medians (thread CPU time and wall time), their
min-max spread across rounds, and the ratio to the first model. ``--profile DIR`` additionally runs
one profiled session per model (onnxruntime's ``enable_profiling``) and prints per-op-type kernel
time totals (median over the profiled runs), to see WHICH ops differ.

The child entry point is ``python -m bench.latency_ab --child MODEL FEEDS ...``: it prints one JSON
line with the per-run times.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional

import numpy as np

_ROOT = Path(__file__).resolve().parent.parent


def _session(path: Path, level: str, profile_prefix: Optional[str] = None):
    """Single-threaded sequential CPU session (same settings as bench.evaluate.session)."""
    import onnxruntime as ort
    levels = {"disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
              "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC}
    so = ort.SessionOptions()
    so.graph_optimization_level = levels[level]
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    if profile_prefix:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def child(model: Path, feeds_path: Path, level: str, warmup: int, runs: int,
          profile_prefix: Optional[str]) -> dict:
    """Measure one model in this process: per-run thread CPU ms and wall ms after warm-up."""
    feeds = dict(np.load(feeds_path))
    t0 = time.perf_counter()
    sess = _session(model, level, profile_prefix)
    load_s = time.perf_counter() - t0
    for _ in range(warmup):
        sess.run(None, feeds)
    cpu: list[float] = []
    wall: list[float] = []
    for _ in range(runs):
        w0, c0 = time.perf_counter(), time.thread_time()
        sess.run(None, feeds)
        cpu.append((time.thread_time() - c0) * 1e3)
        wall.append((time.perf_counter() - w0) * 1e3)
    out = {"model": str(model), "load_s": load_s, "cpu_ms": cpu, "wall_ms": wall}
    if profile_prefix:
        out["profile"] = sess.end_profiling()
    return out


def op_totals(profile_file: str, warmup: int) -> dict[str, float]:
    """Per-op-type kernel time (ms per run, median over the runs after ``warmup``) from a profile."""
    events = json.load(open(profile_file))
    # kernel events lie inside their run's model_run event: bucket them by timestamp
    runs = sorted((ev["ts"], ev["ts"] + ev["dur"]) for ev in events
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


def _run_child(model: Path, args: argparse.Namespace, profile_prefix: Optional[str] = None) -> dict:
    cmd = [sys.executable, "-m", "bench.latency_ab", "--child", str(model), "--feeds", str(args.feeds),
           "--level", args.level, "--warmup", str(args.warmup), "--runs", str(args.runs)]
    if profile_prefix:
        cmd += ["--profile-prefix", profile_prefix]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: Optional[list[str]] = None) -> None:
    """Parent (interleaved rounds) or ``--child`` entry point; see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--feeds", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--level", choices=("disabled", "basic"), default="disabled")
    ap.add_argument("--json", type=Path, help="write every per-run time here")
    ap.add_argument("--profile", type=Path, help="directory: one profiled process per model, op-type totals")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--profile-prefix", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.models[0], args.feeds, args.level, args.warmup, args.runs,
                               args.profile_prefix)))
        return

    names = [m.name if [x.name for x in args.models].count(m.name) == 1 else str(m) for m in args.models]
    results: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name, model in zip(names, args.models):
            res = _run_child(model, args)
            results[name].append(res)
            print(f"round {r + 1} {name:30s} cpu median {np.median(res['cpu_ms']):8.2f} ms"
                  f"  wall median {np.median(res['wall_ms']):8.2f} ms  (load {res['load_s']:.1f} s)", flush=True)

    print(f"\n{'model':30s} {'cpu med':>8s} {'spread':>17s} {'wall med':>9s} {'spread':>17s} "
          f"{'pooled p25-p75 cpu':>19s} {'ratio':>6s}")
    base = None
    summary = {}
    for name in names:
        meds = [float(np.median(x["cpu_ms"])) for x in results[name]]
        wmeds = [float(np.median(x["wall_ms"])) for x in results[name]]
        pooled = np.concatenate([x["cpu_ms"] for x in results[name]])
        med = float(np.median(meds))
        base = base or med
        summary[name] = {"cpu_median_ms": med, "cpu_round_medians": meds, "wall_median_ms": float(np.median(wmeds)),
                         "wall_round_medians": wmeds, "pooled_cpu_p25_ms": float(np.percentile(pooled, 25)),
                         "pooled_cpu_p75_ms": float(np.percentile(pooled, 75)), "ratio": med / base}
        print(f"{name:30s} {med:8.2f} {min(meds):8.2f}-{max(meds):8.2f} {np.median(wmeds):9.2f} "
              f"{min(wmeds):8.2f}-{max(wmeds):8.2f} {np.percentile(pooled, 25):9.2f}-{np.percentile(pooled, 75):9.2f}"
              f" {med / base:6.3f}")

    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
        totals = {}
        for name, model in zip(names, args.models):
            res = _run_child(model, args, profile_prefix=str(args.profile / Path(name).stem))
            totals[name] = op_totals(res["profile"], args.warmup)
        summary["op_totals_ms"] = totals
        ops = sorted({op for t in totals.values() for op in t}, key=lambda o: -max(t.get(o, 0) for t in totals.values()))
        print(f"\nper-op-type kernel time, ms per run (median of profiled runs)\n{'op':24s}"
              + "".join(f" {n[:14]:>14s}" for n in names))
        for op in ops:
            print(f"{op:24s}" + "".join(f" {totals[n].get(op, 0.0):14.2f}" for n in names))
        print(f"{'total':24s}" + "".join(f" {sum(totals[n].values()):14.2f}" for n in names))

    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
