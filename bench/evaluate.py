"""Evaluate one model file in its own process: structure, checker, outputs vs reference, ORT latency.

``python -m bench.evaluate MODEL FEEDS.npz [--ref REF.npz] [--save-outputs OUT.npz] [--budget S] [--no-latency]``.
Latency is onnxruntime on CPU with one thread (intra- and inter-op), sequential execution, measured
with all of onnxruntime's graph optimizations off (``disabled``) and at its basic level (``basic``):
a few warm-up runs, then repeated runs until ``budget`` seconds or ``max_runs``; see :func:`latency`.
"""
from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import onnx
import onnxruntime as ort

from .procs import write_result

LEVELS = {"disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
          "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC}
#: Every level a session may use: LEVELS, which the main run measures, and ``all`` (ORT_ENABLE_ALL), which
#: the attention benchmark (bench/attention_latency.py) measures too.
SESSION_LEVELS = {**LEVELS, "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}


def structure(path: Path) -> dict:
    """Node count and op-type histogram (``domain:op`` for non-default domains) of the main graph and every
    If/Loop/Scan body in it: a branch's nodes are the model's too (inlining a constant If moves them up,
    it adds none; counting the main graph alone read that as growth)."""
    nodes = list(_nodes(onnx.load(str(path), load_external_data=False).graph))
    ops = Counter(f"{n.domain}:{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type for n in nodes)
    return {"nodes": len(nodes), "ops": dict(sorted(ops.items()))}


def _nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """The graph's nodes, each followed by those of the bodies it holds."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for body in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from _nodes(body)


def check(path: Path) -> str:
    """``ok`` or the first line of onnx.checker's full check (by path: works beyond 2 GB)."""
    try:
        onnx.checker.check_model(str(path), full_check=True)
        return "ok"
    except Exception as exc:  # the checker raises several types; every one is a finding
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"


def session(path: Path, level: str, profile_prefix: Optional[str] = None) -> ort.InferenceSession:
    """A single-threaded CPU session at optimization ``level`` (profiling into ``profile_prefix*.json`` if given)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = SESSION_LEVELS[level]
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    if profile_prefix:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def latency(sess: ort.InferenceSession, feeds: dict, budget_s: float, warmup: int = 3,
            min_runs: int = 5, max_runs: int = 500) -> dict:
    """Per-run latency (ms) after warm-up: CPU time of this thread (median, quartiles) and wall time.

    With one intra-op thread onnxruntime computes in the calling thread, so the thread's CPU time is
    the run's cost without the time slices other processes take on a shared machine; on a busy machine
    the wall times are bimodal (a 2 ms run becomes 10 ms when it loses its core), so ratios and goals
    use the CPU-time median. The wall median and minimum are kept for reference.
    """
    for _ in range(warmup):
        sess.run(None, feeds)
    cpu: list[float] = []
    wall: list[float] = []
    start = time.perf_counter()
    while len(cpu) < min_runs or (len(cpu) < max_runs and time.perf_counter() - start < budget_s):
        t0, c0 = time.perf_counter(), time.thread_time()
        sess.run(None, feeds)
        cpu.append((time.thread_time() - c0) * 1e3)
        wall.append((time.perf_counter() - t0) * 1e3)
    p25, p50, p75 = np.percentile(cpu, [25, 50, 75])
    return {"median_ms": float(p50), "p25_ms": float(p25), "p75_ms": float(p75), "runs": len(cpu),
            "wall_median_ms": float(np.median(wall)), "wall_min_ms": float(min(wall))}


def compare(ref: dict, outputs: dict) -> dict:
    """Max absolute difference and max relative difference (to the reference output's max magnitude)."""
    if sorted(ref) != sorted(outputs):
        return {"max_abs": None, "max_rel": None, "error": f"outputs differ: {sorted(outputs)} vs {sorted(ref)}"}
    max_abs = max_rel = 0.0
    for name, want in ref.items():
        got = outputs[name]
        if got.shape != want.shape:
            return {"max_abs": None, "max_rel": None, "error": f"{name}: shape {got.shape} vs {want.shape}"}
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
        abs_ = float(diff.max()) if diff.size else 0.0
        scale = float(np.abs(want.astype(np.float64)).max()) if want.size else 0.0
        max_abs = max(max_abs, abs_)
        max_rel = max(max_rel, abs_ / scale if scale > 0 else abs_)
    return {"max_abs": max_abs, "max_rel": max_rel, "error": ""}


def evaluate(path: Path, feeds: dict, ref: Optional[dict], budget_s: float,
             with_latency: bool = True) -> tuple[dict, dict]:
    """All figures for ``path`` (latency only ``with_latency``); also returns its outputs (ORT optimizations off)."""
    result = {**structure(path), "checker": check(path)}
    sess = session(path, "disabled")
    names = [o.name for o in sess.get_outputs()]
    outputs = dict(zip(names, sess.run(None, feeds)))
    if ref is not None:
        result["diff"] = compare(ref, outputs)
    if with_latency:
        result["latency"] = {"disabled": latency(sess, feeds, budget_s)}
        del sess
        result["latency"]["basic"] = latency(session(path, "basic"), feeds, budget_s)
    return result, outputs


def main() -> None:
    """Child entry point (see module docstring)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("feeds", type=Path)
    ap.add_argument("--ref", type=Path)
    ap.add_argument("--save-outputs", type=Path)
    ap.add_argument("--budget", type=float, default=2.0)
    ap.add_argument("--no-latency", action="store_true", help="bench.run measures it in rounds (bench/latency_rounds.py)")
    args = ap.parse_args()
    feeds = dict(np.load(args.feeds))
    ref = dict(np.load(args.ref)) if args.ref else None
    result, outputs = evaluate(args.model, feeds, ref, args.budget, with_latency=not args.no_latency)
    if args.save_outputs:
        np.savez(args.save_outputs, **outputs)
    write_result(result)


if __name__ == "__main__":
    main()
