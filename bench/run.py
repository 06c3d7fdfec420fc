"""Entry point: ``python -m bench.run [--quick] [--big] [--models GLOB,...] [--optimizers NAME,...]``.

For each model: build (cached), make seeded inputs, evaluate the original in a child process (its
outputs are the reference), then for each optimizer optimize in a fresh child (timed, peak RSS,
timeout) and evaluate the result in another child (structure, checker, outputs). Then the latency of
the original and of every result is measured in interleaved rounds, one fresh child per round
(bench/latency_rounds.py). Failures, crashes and timeouts are recorded as results. Writes
``results.json`` and ``results.md`` into ``--out``.
"""
from __future__ import annotations

import argparse
import compileall
import datetime
import json
import os
import platform
import shutil
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Optional

import numpy as np
import onnx

from .latency_rounds import rounds
from .models import CACHE, ModelSpec, depth_of, ensure_built, model_set, select, series_depth, zoo_feeds
from .optimizers import OPTIMIZERS, SUBJECT, model_bytes
from .procs import python_module, ram_gib, run_measured
from .report import render

ROUNDS = 5  # latency rounds per model (bench/latency_rounds.py): the noise is their IQR, robust to one stray round
#: Optimize runs per optimizer on the depth series (the time goals' models), interleaved: one run's time swings
#: +-20 % on a VM; the goals then read medians.
TIME_RUNS = 5
#: Rounds of k3opt over the whole depth series for the scaling goal (:func:`series_runs`); ~6 s a round.
SERIES_ROUNDS = 9
#: The optimizers the time goals compare.
TIMED = ("k3opt", "onnxsim", "onnxslim")
PACKAGES = ("k3opt", "onnx", "onnxruntime", "onnx-graphsurgeon", "onnx-ir", "onnxscript", "onnxsim", "onnxslim",
            "onnxoptimizer", "torch", "transformers", "numpy")


def make_feeds(path: Path, seed: int = 0, batch: int = 1, seq: int = 16) -> dict[str, np.ndarray]:
    """Seeded inputs: masks of ones, token ids within the embedding table, floats standard normal.

    Symbolic dims: the first is ``batch``, others ``seq``.
    """
    graph = onnx.load(str(path), load_external_data=False).graph
    rows = {i.name: i.dims[0] for i in graph.initializer if i.dims}
    vocab: dict[str, int] = {}
    for node in graph.node:
        if node.op_type == "Gather" and len(node.input) > 1 and node.input[0] in rows:
            vocab[node.input[1]] = min(vocab.get(node.input[1], rows[node.input[0]]), rows[node.input[0]])
    rng = np.random.default_rng(seed)
    inits = {i.name for i in graph.initializer}
    feeds = {}
    for vi in graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else (batch if k == 0 else seq)
                 for k, d in enumerate(tt.shape.dim)]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
        if "mask" in vi.name.lower():
            feeds[vi.name] = np.ones(shape, dtype)
        elif np.issubdtype(dtype, np.floating):
            feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype == np.bool_:
            feeds[vi.name] = rng.integers(0, 2, shape).astype(bool)
        elif "position" in vi.name.lower():
            feeds[vi.name] = np.broadcast_to(np.arange(shape[-1], dtype=dtype), shape).copy()
        else:
            feeds[vi.name] = rng.integers(0, vocab.get(vi.name, 2), shape).astype(dtype)
    return feeds


def _evaluate(model: Path, feeds: Path, limits: dict, ref: Optional[Path] = None,
              save: Optional[Path] = None) -> dict:
    """Structure, checker and outputs of ``model`` in a child process (latency comes from the rounds)."""
    args = [str(model), str(feeds), "--no-latency"]
    args += ["--ref", str(ref)] if ref else []
    args += ["--save-outputs", str(save)] if save else []
    res = run_measured(python_module("bench.evaluate", *args), **limits)
    if res.status != "ok":
        return {"error": f"evaluation {res.status}: {res.error}"}
    return res.payload


def bench_model(spec: ModelSpec, optimizers: list[str], work: Path, limits: dict, budget: float,
                latency_rounds: int = ROUNDS, time_runs: int = TIME_RUNS) -> dict:
    """Every optimizer on one model, then the latency of the original and every result in rounds.

    ``limits``: ``timeout_s`` and ``max_rss_mb`` for every child process. The optimized files are
    kept until the latency rounds are done (the 3.3 GB model: ~20 GB of disk), then deleted. On the
    depth series, :data:`TIMED` optimizers run ``time_runs`` times in all (:func:`time_samples`).
    """
    path, err = ensure_built(spec)
    if path is None:
        return {"model": spec.name, "error": err}
    work.mkdir(parents=True, exist_ok=True)
    feeds, ref = work / "feeds.npz", work / "reference.npz"
    np.savez(feeds, **(zoo_feeds(spec) if spec.own_feeds else make_feeds(path)))
    original = _evaluate(path, feeds, limits, save=ref)
    entry = {"model": spec.name, "family": spec.family, "path": str(path), "mbytes": model_bytes(path) / 1e6,
             "original": original, "results": []}
    if "error" in original:
        entry["error"] = original["error"]
        return entry
    timed = [(original, path)]
    for name in optimizers:
        out_dir = work / name
        out_dir.mkdir()
        dst = out_dir / "model.onnx"
        cmd = python_module("bench.optimizers", name, str(path), str(dst), spec.ort_model_type)
        res = run_measured(cmd, **limits)
        row = {"optimizer": name, **res.to_dict()}
        if res.status == "ok":
            row["eval"] = _evaluate(dst, feeds, limits, ref=ref)
            if "error" in row["eval"]:
                row["status"], row["error"] = "eval-error", row.pop("eval")["error"]
            else:
                timed.append((row["eval"], dst))
        entry["results"].append(row)
        if "eval" not in row:
            shutil.rmtree(out_dir, ignore_errors=True)
        print(f"  {spec.name} {name}: {row['status']} {res.wall_s:.1f} s {res.peak_rss_mb:.0f} MB", flush=True)
    if series_depth(spec.name) is not None:
        time_samples(entry["results"], path, work / "again", spec.ort_model_type, limits, time_runs)
    for ev, merged in zip((e for e, _ in timed), rounds([p for _, p in timed], feeds, limits, budget, latency_rounds)):
        if "error" in merged:
            ev["latency_error"] = merged["error"]
        else:
            ev["latency"] = merged
    for name in optimizers:
        shutil.rmtree(work / name, ignore_errors=True)
    return entry


def time_samples(rows: list[dict], src: Path, scratch: Path, model_type: str, limits: dict, runs: int) -> None:
    """Optimize ``src`` again with each :data:`TIMED` optimizer that succeeded, interleaved (one fresh
    process per run, outputs discarded), until each has ``runs`` times; ``row["time_samples"]`` holds them
    all (the first run's included), ``row["time_median_s"]`` their median, and ``row["wall_samples"]``,
    ``row["wall_median_s"]`` the same for the whole process's wall time (interpreter start and imports
    included). A failed rerun is left out.

    Each round rotates the order one further and every other round reverses it: a process runs slower
    right after one that used much memory (on this VM, k3opt's 64-layer run +17 % right after
    onnxslim's), so no optimizer may always follow the same one (a rotation alone keeps each one's
    predecessor; a few seeded shuffles can repeat one order)."""
    rows = [r for r in rows if r["optimizer"] in TIMED and r["status"] == "ok"]
    for row in rows:
        row["time_samples"], row["wall_samples"] = [row["payload"]["time_s"]], [row["wall_s"]]
    scratch.mkdir(parents=True, exist_ok=True)
    for r in range(1, runs):
        order = rows[r % len(rows):] + rows[:r % len(rows)] if rows else []
        for row in order[::-1] if r % 2 else order:
            t = _timed_run(row["optimizer"], src, scratch, model_type, limits)
            if t is not None:
                row["time_samples"].append(t[0])
                row["wall_samples"].append(t[1])
    for row in rows:
        row["time_median_s"] = float(np.median(row["time_samples"]))
        row["wall_median_s"] = float(np.median(row["wall_samples"]))
        print(f"  {row['optimizer']}: median {row['time_median_s']:.2f} s of {len(row['time_samples'])} runs",
              flush=True)
    scratch.rmdir()


def series_runs(series: list[tuple[int, Path, str]], scratch: Path, limits: dict, rounds: int) -> dict[str, list[float]]:
    """k3opt's optimize times over the depth series ``(depth, model, ort model type)``, ``rounds`` times
    interleaved: each round optimizes every depth once (one fresh process each, output discarded), the
    next round starting one depth further on. The scaling goal compares depths measured in the same
    minutes: the per-model runs are minutes apart, and this VM's speed drifts by more than the goal's
    margin over that time. Keys are the depths as strings (JSON); a failed run is left out."""
    samples: dict[str, list[float]] = {str(depth): [] for depth, _, _ in series}
    scratch.mkdir(parents=True, exist_ok=True)
    for r in range(rounds):
        for depth, src, model_type in series[r % len(series):] + series[:r % len(series)]:
            t = _timed_run(SUBJECT, src, scratch, model_type, limits)
            if t is not None:
                samples[str(depth)].append(t[0])
    scratch.rmdir()
    print("  series: " + ", ".join(f"{d} layers {np.median(t):.2f} s" for d, t in samples.items() if t), flush=True)
    return samples


def _timed_run(optimizer: str, src: Path, scratch: Path, model_type: str,
               limits: dict) -> Optional[tuple[float, float]]:
    """One more optimize run of ``src`` in a fresh process, for its times only: (optimize time, the
    process's wall time), None when it failed; its output in ``scratch`` is deleted."""
    res = run_measured(python_module("bench.optimizers", optimizer, str(src), str(scratch / "model.onnx"),
                                     model_type), **limits)
    for f in scratch.iterdir():
        f.unlink()
    return (res.payload["time_s"], res.wall_s) if res.status == "ok" else None


def _load() -> str:
    """Load averages (1, 5, 15 min): timings on a busy machine are only comparable within one run."""
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def machine() -> str:
    """``nproc``, memory and CPU model of this machine."""
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()} CPUs, {ram_gib():.0f} GiB RAM, {cpu}, Python {platform.python_version()}"


def versions() -> str:
    """Installed versions of the tools measured."""
    found = []
    for pkg in PACKAGES:
        try:
            found.append(f"{pkg} {metadata.version(pkg)}")
        except metadata.PackageNotFoundError:
            found.append(f"{pkg} (not installed)")
    return ", ".join(found)


def compile_k3opt() -> None:
    """Write k3opt's bytecode next to its sources, as pip does for an installed package.

    The peers are imported from site-packages, compiled at install; k3opt runs
    from this checkout, and with PYTHONDONTWRITEBYTECODE set (this machine sets
    it) every timed k3opt run would compile its ~60 modules again (~60 ms).
    """
    compileall.compile_dir(str(Path(__file__).resolve().parent.parent / "k3opt"), quiet=1)


def main(argv: Optional[list[str]] = None) -> dict:
    """Parse options, run the benchmark, write ``results.json`` and ``results.md``; returns the run."""
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="TorchScript exports and depths 8/16 only, short latency runs")
    ap.add_argument("--big", action="store_true", help="also the 3.3 GB Llama (builds once: ~4 GB disk, minutes)")
    ap.add_argument("--models", help="comma-separated globs over model names, e.g. 'llama-depth*,bert-*'")
    ap.add_argument("--model-file", action="append", default=[], type=Path, help="benchmark this .onnx too")
    ap.add_argument("--optimizers", help=f"comma-separated subset of {','.join(OPTIMIZERS)}")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per optimize or evaluate process")
    ap.add_argument("--max-rss-gb", type=float, default=round(ram_gib() / 2, 1),
                    help="kill a child above this RSS (default: half the RAM; the machine may be shared)")
    ap.add_argument("--budget", type=float, help="seconds of timed runs per latency figure and round "
                                                 "(default 2, quick 0.5)")
    ap.add_argument("--rounds", type=int, default=ROUNDS, help=f"latency rounds (fresh processes) per model (default {ROUNDS})")
    ap.add_argument("--time-runs", type=int, default=TIME_RUNS,
                    help=f"optimize runs of {', '.join(TIMED)} per depth-series model, interleaved; the time goals "
                         f"read their medians (default {TIME_RUNS})")
    ap.add_argument("--series-rounds", type=int, default=SERIES_ROUNDS,
                    help=f"rounds of {SUBJECT} over the whole depth series, interleaved; the scaling goal reads their "
                         f"medians (default {SERIES_ROUNDS}; 0: read the per-model runs instead)")
    ap.add_argument("--out", type=Path, help="result folder (default ~/.cache/k3opt-bench/results/<time>)")
    args = ap.parse_args(argv)
    optimizers = args.optimizers.split(",") if args.optimizers else list(OPTIMIZERS)
    unknown = [o for o in optimizers if o not in OPTIMIZERS]
    if unknown:
        ap.error(f"unknown optimizers {unknown}; known: {', '.join(OPTIMIZERS)}")
    specs = [] if args.model_file and not args.models else model_set(args.quick, args.big)
    specs = select(specs, args.models.split(",") if args.models else None)
    specs += [ModelSpec(p.stem, "user", path=p.resolve()) for p in args.model_file]
    budget = args.budget if args.budget is not None else (0.5 if args.quick else 2.0)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or CACHE / "results" / stamp
    out.mkdir(parents=True, exist_ok=True)
    run = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(),
           "limits": f"timeout {args.timeout:.0f} s, RSS {args.max_rss_gb:.1f} GB per process",
           "load_start": _load(),
           "versions": versions(), "optimizers": optimizers, "models": []}
    compile_k3opt()
    limits = {"timeout_s": args.timeout, "max_rss_mb": args.max_rss_gb * 1024}
    CACHE.mkdir(parents=True, exist_ok=True)  # a fresh machine has no ~/.cache/k3opt-bench yet
    with tempfile.TemporaryDirectory(prefix="k3bench-work-", dir=CACHE) as work:
        for spec in specs:
            print(f"{spec.name}", flush=True)
            run["models"].append(bench_model(spec, optimizers, Path(work) / spec.name, limits, budget,
                                                  args.rounds, args.time_runs))
            (out / "results.json").write_text(json.dumps(run, indent=1))
        series = [(depth_of(spec.name), Path(m["path"]), spec.ort_model_type) for spec, m in zip(specs, run["models"])
                  if depth_of(spec.name) is not None and "error" not in m]
        if SUBJECT in optimizers and len(series) > 1 and args.series_rounds > 0:
            print("depth series", flush=True)
            run["series_runs"] = series_runs(sorted(series), Path(work) / "series", limits, args.series_rounds)
    run["load_end"] = _load()
    (out / "results.md").write_text(render(run))
    (out / "results.json").write_text(json.dumps(run, indent=1))
    print(f"wrote {out / 'results.json'} and {out / 'results.md'}")
    return run


if __name__ == "__main__":
    main()
