"""Attention latency: ``k3opt --opset 23`` against the standard-ONNX peers where the attention blocks dominate.

``python -m bench.attention_latency [--hidden 256] [--layers 2] [--prefill 512] [--past 511] [--rounds 5]
[--budget 1] [--optimizers onnxsim,onnxslim,onnxscript,onnxoptimizer] [--out DIR]``

One run measures, side by side, a Llama-like model with a vocabulary of 128 (so the embedding and the
LM head cost next to nothing and the blocks dominate) in two exports: a prefill of ``--prefill`` tokens
(no cache) and a decode step (one token after a KV cache of ``--past``, ``present`` outputs included),
both TorchScript exports of ``k3opt.export.from_transformers`` (seeded random weights). Each is optimized
by k3opt at opset 23 (where fuse-rotary and, once present, fuse-attention emit RotaryEmbedding and
Attention) and by every peer, each in a fresh child; outputs are compared with the original's; then
onnxruntime CPU latency, one thread, with ORT_ENABLE_ALL (``all``) and with optimizations off
(``disabled``) is measured in interleaved rounds (bench/latency_rounds.py: every round one fresh process,
the order rotating). The figure is k3opt's median over the best peer's (the peer with the lowest median
at that level), per export and level. Models are cached in ``$K3OPT_BENCH_CACHE/attention``.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import inspect
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np
import onnx

from .latency_rounds import rounds
from .models import CACHE
from .procs import python_module, run_measured, write_result
from .run import _evaluate

#: The model: Llama's blocks (GQA 2 KV heads for 4, head dim 64, RMSNorm, SwiGLU, RoPE), a vocabulary of 128.
CONFIG = dict(vocab_size=128, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=2, max_position_embeddings=2048)
PEERS = ("onnxsim", "onnxslim", "onnxscript", "onnxoptimizer")
LEVELS = ("all", "disabled")
PHASES = ("prefill", "decode")
SUBJECT = "k3opt-opset23"
OPSET = 23
#: Tokens of the export's example (the exported graph has dynamic batch, sequence and past axes).
EXAMPLE = 8


def build(phase: str, dst: Path, config: dict) -> None:
    """Child: export ``phase`` (prefill: no cache; decode: one step with the KV cache) of the Llama ``config``."""
    from transformers import LlamaConfig

    from k3opt.export import from_transformers

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.stem + ".tmp.onnx")
    cfg = LlamaConfig(**config, tie_word_embeddings=False)
    from_transformers(cfg, tmp, exporter="torchscript", use_cache=phase == "decode", seq_len=EXAMPLE, optimize=False)
    tmp.replace(dst)


def model_path(phase: str, config: dict) -> Path:
    """Where the export of ``phase`` for ``config`` is cached (keyed by the builder, config and versions)."""
    import torch
    import transformers

    key = hashlib.sha256("\0".join([phase, json.dumps(config, sort_keys=True), inspect.getsource(build),
                                    torch.__version__, transformers.__version__]).encode()).hexdigest()[:12]
    return CACHE / "attention" / f"llama-{phase}-{key}.onnx"


def ensure_model(phase: str, config: dict, timeout_s: float) -> Path:
    path = model_path(phase, config)
    if not path.exists():
        res = run_measured(python_module("bench.attention_latency", "--build", phase, str(path),
                                         json.dumps(config)), timeout_s)
        if res.status != "ok":
            raise RuntimeError(f"building the {phase} export: {res.status}: {res.error}")
    return path


def feeds_for(path: Path, phase: str, config: dict, prefill: int, past: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Batch 1: ``prefill`` token ids and a mask of ones; or one new token, a mask over ``past + 1`` and a random
    cache of ``past`` positions per layer."""
    rng = np.random.default_rng(seed)
    new = prefill if phase == "prefill" else 1
    total = new if phase == "prefill" else past + 1
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    feeds = {"input_ids": rng.integers(0, config["vocab_size"], (1, new)).astype(np.int64),
             "attention_mask": np.ones((1, total), np.int64)}
    for vi in onnx.load(str(path), load_external_data=False).graph.input:
        if vi.name.startswith("past_key_values."):
            shape = (1, config["num_key_value_heads"], past, head_dim)
            feeds[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def optimize_k3opt(src: Path, dst: Path) -> None:
    """Child: k3opt's default pipeline at the output opset :data:`OPSET` (its own verification off: the
    benchmark compares the outputs itself)."""
    import k3opt

    report = k3opt.optimize_file(str(src), str(dst), opset=OPSET, verify=False)
    data = report.as_dict()
    write_result({"passes": data.get("passes")})


def _optimize(name: str, src: Path, dst: Path, limits: dict) -> dict:
    cmd = (python_module("bench.attention_latency", "--optimize-k3opt", str(src), str(dst)) if name == SUBJECT
           else python_module("bench.optimizers", name, str(src), str(dst), "gpt2"))
    res = run_measured(cmd, **limits)
    return {"optimizer": name, "status": res.status, "error": res.error, "wall_s": res.wall_s}


def bench_phase(phase: str, config: dict, args: argparse.Namespace, optimizers: list[str], work: Path,
                limits: dict) -> dict:
    """Optimize one export with every optimizer, compare outputs, then time all files in rounds."""
    src = ensure_model(phase, config, limits["timeout_s"])
    work.mkdir(parents=True, exist_ok=True)
    feeds, ref = work / "feeds.npz", work / "reference.npz"
    np.savez(feeds, **feeds_for(src, phase, config, args.prefill, args.past))
    original = _evaluate(src, feeds, limits, save=ref)
    if "error" in original:
        raise RuntimeError(f"{phase} original: {original['error']}")
    rows, files = [{"optimizer": "original", "status": "ok", "eval": original}], [src]
    for name in optimizers:
        dst = work / name / "model.onnx"
        dst.parent.mkdir()
        row = _optimize(name, src, dst, limits)
        if row["status"] == "ok":
            row["eval"] = _evaluate(dst, feeds, limits, ref=ref)
            if "error" not in row["eval"]:
                files.append(dst)
        rows.append(row)
    timed = [r for r in rows if r["status"] == "ok" and "error" not in r["eval"]]
    for row, lat in zip(timed, rounds(files, feeds, limits, args.budget, args.rounds, LEVELS)):
        row["latency"] = lat
    return {"phase": phase, "rows": rows, "ratios": ratios(rows)}


def _median(row: dict, level: str) -> Optional[float]:
    lat = (row.get("latency") or {}).get(level)
    return None if not lat or "median_ms" not in lat else lat["median_ms"]


def equal(row: dict, rtol: float = 1e-4, atol: float = 1e-4) -> Optional[bool]:
    """Outputs equal to the original's: max abs diff within ``atol`` or within ``rtol`` of the output's scale."""
    diff = (row.get("eval") or {}).get("diff")
    if not diff or diff.get("max_abs") is None:
        return None
    return diff["max_abs"] <= atol or diff["max_rel"] <= rtol


def ratios(rows: list[dict]) -> dict:
    """Per level: k3opt's median over the best peer's (the peer with equal outputs and the lowest median), and
    the same ratio round by round (both files were measured in each round's process: a paired figure, which the
    machine's drift between rounds moves less), as median and range."""
    subject = next((r for r in rows if r["optimizer"] == SUBJECT), None)
    out = {}
    for level in LEVELS:
        peers = [(m, r["optimizer"], r) for r in rows if r["optimizer"] in PEERS and equal(r)
                 for m in [_median(r, level)] if m is not None]
        mine = None if subject is None or not equal(subject) else _median(subject, level)
        best = min(peers, key=lambda p: p[0]) if peers else None
        entry = {"k3opt_ms": mine, "best_peer": best and best[1], "best_peer_ms": best and best[0],
                 "ratio": None if mine is None or best is None else mine / best[0], "round_ratios": None}
        if entry["ratio"] is not None:
            a, b = subject["latency"][level]["rounds_ms"], best[2]["latency"][level]["rounds_ms"]
            entry["round_ratios"] = [x / y for x, y in zip(a, b)] if len(a) == len(b) else None
        out[level] = entry
    return out


def render(run: dict) -> str:
    """The markdown of a run: per export, every optimizer's median at both levels, then the ratios."""
    lines = [f"# Attention latency ({run['date']})", "", f"config: {run['config']}; prefill {run['prefill']} "
             f"tokens, decode 1 token after {run['past']}; onnxruntime CPU, one thread; ms of thread CPU time, "
             f"median of {run['rounds']} round medians (interquartile range)", ""]
    for phase in run["phases"]:
        lines += [f"## {phase['phase']}", "", "| optimizer | status | nodes | equal | ORT_ENABLE_ALL ms | "
                  "optimizations off ms | ops |",
                  "|---|---|---|---|---|---|---|"]
        for row in phase["rows"]:
            ev = row.get("eval") or {}
            ops = ", ".join(f"{k} {v}" for k, v in sorted((ev.get("ops") or {}).items())
                            if k in ("Attention", "RotaryEmbedding", "RMSNormalization", "Softmax", "Neg"))
            status = row["status"] if row["status"] == "ok" else f"{row['status']}: {row['error'][:60]}"
            cells = [row["optimizer"], status, str(ev.get("nodes", "")), "" if row["optimizer"] == "original" else str(equal(row)),
                     *(_lat_cell(row, level) for level in LEVELS), ops]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        for level in LEVELS:
            r = phase["ratios"][level]
            paired = r.get("round_ratios")
            rounds_text = "" if not paired else (f"; round by round {_fmt(float(np.median(paired)), '{:.3f}')} "
                                                 f"({_fmt(min(paired), '{:.3f}')}-{_fmt(max(paired), '{:.3f}')})")
            lines.append(f"- {level}: k3opt --opset 23 {_fmt(r['k3opt_ms'])} ms, best peer {r['best_peer']} "
                         f"{_fmt(r['best_peer_ms'])} ms, ratio **{_fmt(r['ratio'], '{:.3f}')}**{rounds_text}")
        lines.append("")
    return "\n".join(lines)


def _lat_cell(row: dict, level: str) -> str:
    """Median of the round medians, with their interquartile range."""
    lat = (row.get("latency") or {}).get(level)
    if not lat or "median_ms" not in lat:
        return "-"
    return f"{lat['median_ms']:.2f} ({lat['p25_ms']:.2f}-{lat['p75_ms']:.2f})"


def _fmt(value: Optional[float], fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def main(argv: Optional[list[str]] = None) -> dict:
    """Parent entry point (see the module docstring); ``--build`` and ``--optimize-k3opt`` are its workers."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--build"]:
        build(argv[1], Path(argv[2]), json.loads(argv[3]))
        write_result({"path": argv[2]})
        return {}
    if argv[:1] == ["--optimize-k3opt"]:
        optimize_k3opt(Path(argv[1]), Path(argv[2]))
        return {}
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=CONFIG["hidden_size"])
    ap.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"])
    ap.add_argument("--intermediate", type=int, default=CONFIG["intermediate_size"])
    ap.add_argument("--prefill", type=int, default=512, help="prefill tokens")
    ap.add_argument("--past", type=int, default=511, help="KV cache length before the decoded token")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget", type=float, default=1.0, help="seconds of timed runs per file, level and round")
    ap.add_argument("--optimizers", default=",".join(PEERS), help=f"peers, comma-separated (of {','.join(PEERS)})")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per child process")
    ap.add_argument("--out", type=Path, help="folder for results.json and results.md")
    args = ap.parse_args(argv)
    peers = [p for p in args.optimizers.split(",") if p]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        ap.error(f"unknown peers {unknown}; known: {', '.join(PEERS)}")
    config = {**CONFIG, "hidden_size": args.hidden, "num_hidden_layers": args.layers,
              "intermediate_size": args.intermediate}
    limits = {"timeout_s": args.timeout}
    out = args.out or CACHE / "results" / f"attention-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    run = {"date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", "config": config,
           "prefill": args.prefill, "past": args.past, "rounds": args.rounds, "phases": []}
    CACHE.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="attention-", dir=CACHE))
    try:
        for phase in PHASES:
            run["phases"].append(bench_phase(phase, config, args, [SUBJECT, *peers], work / phase, limits))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    (out / "results.json").write_text(json.dumps(run, indent=1))
    (out / "results.md").write_text(render(run))
    print(render(run))
    print(f"\nresults: {out}")
    return run


if __name__ == "__main__":
    main()
