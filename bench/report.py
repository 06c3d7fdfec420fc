"""Derived figures (ratios, best peer, goals, scaling) and the markdown tables of a benchmark run.

Everything here is a pure function of the JSON result, so a table can be re-rendered from a saved run
(``python -m bench.report results.json``).
"""
from __future__ import annotations

import json
import sys
from typing import Optional

import numpy as np

from .models import BIG, DEPTH_PREFIX, LEGACY_OPSET, LEGACY_SUFFIX, depth_of
from .optimizers import SUBJECT

RTOL, ATOL = 1e-4, 1e-5  # "equal outputs": max abs diff within ATOL, or within RTOL of the output's max magnitude
NOISE_FLOOR = 0.03  # latency differences below 3 % are never called a difference
LINEAR_LIMIT = 9.0  # 8x the layers may take at most ~9x the time
LINEAR = "linear 8->64 layers (time ratio <= 9)"
#: Issue #18: on the opset-14 export, the whole k3opt process (interpreter start, opset conversion included)
#: within this share of onnxsim's.
LEGACY_WALL_LIMIT = 0.5
LEGACY_WALL = f"64 layers, opset-{LEGACY_OPSET} export: whole-process wall <= {LEGACY_WALL_LIMIT}x onnxsim's"
#: The depth table's column for k3opt's rounds over the whole series (bench.run.series_runs).
SERIES = f"{SUBJECT} (series rounds)"


def equal_outputs(row: dict) -> Optional[bool]:
    """Whether an optimized model's outputs match the original's (None when not measured)."""
    diff = (row.get("eval") or {}).get("diff")
    if not diff or diff.get("max_abs") is None:
        return None if not diff else False
    return diff["max_abs"] <= ATOL or diff["max_rel"] <= RTOL


def _lat(ev: Optional[dict], level: str) -> Optional[dict]:
    return ((ev or {}).get("latency") or {}).get(level)


def _spread(lat: dict) -> float:
    """Relative noise of a latency figure: the interquartile range of its round medians over their median.

    Robust to one stray round out of five (bench/latency_rounds.py); with fewer than four rounds the
    full range. Runs saved before the rounds existed have one process per file: its runs' IQR.
    """
    if not lat["median_ms"]:
        return 0.0
    rounds = sorted(lat.get("rounds_ms") or [])
    if len(rounds) >= 4:
        low, high = np.percentile(rounds, [25, 75])
    elif len(rounds) > 1:
        low, high = rounds[0], rounds[-1]
    else:
        low, high = lat["p25_ms"], lat["p75_ms"]
    return float(high - low) / lat["median_ms"]


def op_changes(before: dict, after: dict, limit: int = 8) -> str:
    """Op types whose count changed, largest change first: ``MatMul -48, Gemm +48``."""
    keys = set(before) | set(after)
    deltas = sorted(((after.get(k, 0) - before.get(k, 0), k) for k in keys), key=lambda d: (-abs(d[0]), d[1]))
    parts = [f"{k} {d:+d}" for d, k in deltas if d]
    return ", ".join(parts[:limit]) + (f", ... ({len(parts) - limit} more)" if len(parts) > limit else "")


def derive(model: dict) -> None:
    """Add ``equal``, latency ratios (to the original and to the best peer) and ``ops_changed`` to rows."""
    orig = model.get("original") or {}
    rows = model.get("results", [])
    for row in rows:
        row["equal"] = equal_outputs(row)
        ev = row.get("eval")
        if ev:
            row["ops_changed"] = op_changes(orig.get("ops", {}), ev.get("ops", {}))
    model["best_peer"] = {}
    for level in ("disabled", "basic"):
        peers = [r for r in rows if _counts_as_peer(r) and _lat(r.get("eval"), level)]
        best = min(peers, key=lambda r: _lat(r["eval"], level)["median_ms"], default=None)
        model["best_peer"][level] = best["optimizer"] if best else None
        base = _lat(orig, level)
        for row in rows:
            lat = _lat(row.get("eval"), level)
            if not lat:
                continue
            row.setdefault("ratio", {})[level] = {
                "to_original": lat["median_ms"] / base["median_ms"] if base else None,
                "to_best_peer": lat["median_ms"] / _lat(best["eval"], level)["median_ms"] if best else None,
            }


def _counts_as_peer(row: dict) -> bool:
    """A peer result the goals compare with: outputs equal to the original's and a valid ONNX model.

    A result that fails onnx.checker's full check (ORT's transformer optimizer writes
    ``LayerNormalization`` into opset-14 models, and ``com.microsoft`` contrib ops) runs only on
    onnxruntime: ATC, k3opt's target, rejects it. Such rows stay in the tables, and the goals
    name what they would have been (:func:`_invalid_fewer`), but they do not set the bar.
    """
    ev = row.get("eval") or {}
    return row["optimizer"] != SUBJECT and bool(row.get("equal")) and ev.get("checker") == "ok"


def _invalid_fewer(rows: dict, nodes: int) -> str:
    """``"; <peer> has N but is not valid ONNX"`` for the equal-output peer with fewest nodes, if below ``nodes``."""
    invalid = [(r["eval"]["nodes"], n) for n, r in rows.items()
               if n != SUBJECT and r.get("eval") and r.get("equal") and not _counts_as_peer(r)]
    least = min(invalid, default=None)
    return f"; {least[1]} has {least[0]}, not valid ONNX" if least and least[0] < nodes else ""


def goals(model: dict) -> dict:
    """k3opt's per-model goals, each (verdict or None, figures): fewest nodes, latency with ORT
    optimizations off vs the best peer (within the noise), equal outputs. Peers: :func:`_counts_as_peer`."""
    rows = {r["optimizer"]: r for r in model.get("results", [])}
    subject = rows.get(SUBJECT)
    if not subject or not subject.get("eval"):
        reason = subject["status"] if subject else "not run"
        return {"fewest_nodes": (None, reason), "latency": (None, reason), "equal": (None, reason)}
    nodes = subject["eval"]["nodes"]
    peers = [(r["eval"]["nodes"], n) for n, r in rows.items() if _counts_as_peer(r)]
    fewest = (None, "no peer")
    if peers:
        least, who = min(peers)
        fewest = (nodes <= least, f"{nodes} vs {least} ({who}){_invalid_fewer(rows, nodes)}")
    latency: tuple = (None, "no peer")
    best = model["best_peer"].get("disabled")
    if best:
        mine, theirs = _lat(subject["eval"], "disabled"), _lat(rows[best]["eval"], "disabled")
        tolerance = max(_spread(mine), _spread(theirs), NOISE_FLOOR)
        ratio = mine["median_ms"] / theirs["median_ms"]
        latency = (ratio <= 1 + tolerance, f"x{ratio:.2f} of {best}, noise {tolerance:.0%}")
    diff = (subject["eval"].get("diff") or {})
    return {"fewest_nodes": fewest, "latency": latency,
            "equal": (subject["equal"], f"max rel {_num(diff.get('max_rel'), '{:.1e}')}")}


def _mark(flag: Optional[bool]) -> str:
    return {True: "met", False: "**NOT met**", None: "n/a"}[flag]


def _num(value: Optional[float], fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def _lat_cell(row: dict, level: str) -> str:
    lat = _lat(row.get("eval"), level)
    if not lat:
        return "-"
    ratio = row.get("ratio", {}).get(level, {})
    return (f"{lat['median_ms']:.2f} (x{_num(ratio.get('to_original'))} orig, "
            f"x{_num(ratio.get('to_best_peer'))} best)")


def model_table(model: dict) -> list[str]:
    """One markdown table: every optimizer on one model."""
    orig = model.get("original") or {}
    lines = [f"### {model['model']}", ""]
    if model.get("error"):
        return lines + [f"Not measured: {model['error']}", ""]
    lo, lb = _lat(orig, "disabled"), _lat(orig, "basic")
    lines += [f"Original: {orig.get('nodes', '-')} nodes, {model.get('mbytes', 0):.1f} MB, checker {orig.get('checker', '-')}, "
              f"latency {_num(lo and lo['median_ms'])} ms (ORT opts off) / {_num(lb and lb['median_ms'])} ms (basic). "
              f"Best peer: {model['best_peer'].get('disabled')} (off) / {model['best_peer'].get('basic')} (basic).", "",
              "| optimizer | status | time s | wall s | peak RSS MB | nodes | equal | max abs | max rel | checker "
              "| latency off ms | latency basic ms | op types changed |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in model["results"]:
        ev = row.get("eval") or {}
        diff = ev.get("diff") or {}
        last = (row.get("error") or "").strip().splitlines()[-1:] or [""]
        status = row["status"] if row["status"] == "ok" else f"{row['status']}: {last[0][:100]}"
        status = status.replace("|", "/").replace("\n", " ")
        lines.append(" | ".join([
            f"| {row['optimizer']}", status, _time_cell(row), _num(wall_time(row)),
            _num(row.get("peak_rss_mb"), "{:.0f}"), str(ev.get("nodes", "-")),
            {True: "yes", False: "**NO**", None: "-"}[row.get("equal")],
            _num(diff.get("max_abs"), "{:.1e}"), _num(diff.get("max_rel"), "{:.1e}"),
            (ev.get("checker") or "-")[:60].replace("|", "/"), _lat_cell(row, "disabled"), _lat_cell(row, "basic"),
            row.get("ops_changed", "-") or "none"]) + " |")
    return lines + [""]


def opt_time(row: dict) -> Optional[float]:
    """An optimizer row's optimize time: the median of its interleaved runs when it has several, else its run's."""
    return row.get("time_median_s", (row.get("payload") or {}).get("time_s"))


def wall_time(row: dict) -> Optional[float]:
    """An optimizer row's whole-process wall time: the median of its interleaved runs when it has several."""
    return row.get("wall_median_s", row.get("wall_s"))


def _time_cell(row: dict) -> str:
    runs = len(row.get("time_samples", ()))
    return _num(opt_time(row)) + (f" (median of {runs})" if runs > 1 else "")


def scaling(run: dict) -> dict:
    """k3opt's time and memory over the depth series and on the big model, with the goals' verdicts."""
    by_name = {m["model"]: m for m in run["models"]}

    def opt_row(model: str, name: str) -> Optional[dict]:
        rows = [r for r in by_name.get(model, {}).get("results", []) if r["optimizer"] == name and r["status"] == "ok"]
        return rows[0] if rows else None

    out: dict = {"depth": {}, "goals": {}}
    for name, model in by_name.items():
        if depth_of(name) is not None:
            out["depth"][depth_of(name)] = {
                r["optimizer"]: {"time_s": opt_time(r), "peak_rss_mb": r.get("peak_rss_mb")}
                for r in model.get("results", []) if r["status"] == "ok"}
    series = {int(d): float(np.median(t)) for d, t in (run.get("series_runs") or {}).items() if t}
    for depth, median in series.items():
        out["depth"].setdefault(depth, {})[SERIES] = {"time_s": median, "peak_rss_mb": None}
    deep = f"{DEPTH_PREFIX}64"
    t8, t64 = opt_row(f"{DEPTH_PREFIX}8", SUBJECT), opt_row(deep, SUBJECT)
    if 8 in series and 64 in series:
        ratio, rounds = series[64] / series[8], min(len(run["series_runs"][k]) for k in ("8", "64"))
        out["goals"][LINEAR] = (ratio <= LINEAR_LIMIT, f"x{ratio:.1f} ({series[8]:.2f} s -> {series[64]:.2f} s: "
                                                       f"medians of {rounds} interleaved rounds over the series)")
    elif t8 and t64:
        ratio = opt_time(t64) / opt_time(t8)
        out["goals"][LINEAR] = (ratio <= LINEAR_LIMIT, f"x{ratio:.1f}")
    if t64:
        fast = [(opt_time(r), p, r) for p in ("onnxsim", "onnxslim") if (r := opt_row(deep, p))]
        if fast:
            mine, (theirs, who, row) = opt_time(t64), min(fast, key=lambda f: f[0])
            runs = min(len(t64.get("time_samples", [0])), len(row.get("time_samples", [0])))
            how = f"medians of {runs} interleaved runs" if runs > 1 else "one run each"
            out["goals"]["64 layers: faster than fastest of onnxsim/onnxslim"] = (
                mine < theirs, f"{mine:.2f} s vs {theirs:.2f} s ({who}; {how})")
            out["goals"]["64 layers (aim): at most half of that"] = (
                mine <= theirs / 2, f"{mine:.2f} s vs {theirs / 2:.2f} s: ratio {mine / theirs:.2f} ({how})")
    legacy = f"{DEPTH_PREFIX}64{LEGACY_SUFFIX}"
    mine, sim = opt_row(legacy, SUBJECT), opt_row(legacy, "onnxsim")
    if mine and sim and wall_time(mine) and wall_time(sim):
        ratio = wall_time(mine) / wall_time(sim)
        runs = min(len(mine.get("wall_samples", [0])), len(sim.get("wall_samples", [0])))
        out["goals"][LEGACY_WALL] = (ratio <= LEGACY_WALL_LIMIT, f"{wall_time(mine):.2f} s vs {wall_time(sim):.2f} s: "
                                                                f"ratio {ratio:.2f} (medians of {runs} interleaved runs)")
    big = by_name.get(BIG)
    mine = opt_row(BIG, SUBJECT)
    if big and mine:
        peers = [(opt_time(r), r["optimizer"]) for r in big["results"]
                 if r["optimizer"] != SUBJECT and r["status"] == "ok"]
        t = opt_time(mine)
        fastest, who = min(peers) if peers else (None, "no peer")
        out["goals"][">2 GB: no slower than the fastest peer"] = (
            None if fastest is None else t <= fastest, f"{t:.1f} s vs {_num(fastest, '{:.1f}')} s ({who})")
        limit = big["mbytes"] / 10
        out["goals"][">2 GB: peak RSS <= model size / 10"] = (
            mine["peak_rss_mb"] <= limit, f"{mine['peak_rss_mb']:.0f} MB vs {limit:.0f} MB")
        mm = (big.get("original") or {}).get("ops", {}).get("MatMul")
        after = ((mine.get("eval") or {}).get("ops") or {}).get("MatMul")
        out["goals"][">2 GB: projections merged (fewer MatMuls)"] = (
            None if mm is None or after is None else after < mm, f"MatMul {mm} -> {after}")
    return out


def hot_paths(run: dict, top: int = 3) -> list[str]:
    """Where k3opt's time goes per model: its report's phase timings and its slowest passes."""
    lines = ["", "## Where k3opt's time goes", "", "| model | phases s | slowest passes s |", "|---|---|---|"]
    for model in run["models"]:
        for row in model.get("results", []):
            info = (row.get("payload") or {}).get(SUBJECT) if row["optimizer"] == SUBJECT else None
            if not info:
                continue
            phases = ", ".join(f"{k} {v:.2f}" for k, v in info.get("timings", {}).items() if v >= 0.005)
            slow = sorted(info.get("passes", []), key=lambda p: -p.get("time_s", 0))[:top]
            passes = ", ".join(f"{p['name']} {p['time_s']:.2f}" for p in slow)
            lines.append(f"| {model['model']} | {phases} | {passes} |")
    return lines if len(lines) > 5 else []


def render(run: dict) -> str:
    """The whole markdown report of a run (goal summary, scaling, then one table per model)."""
    for model in run["models"]:
        if not model.get("error"):
            derive(model)
    lines = [f"Run {run['date']} on {run['machine']}; load average {run.get('load_start')} at start, "
             f"{run.get('load_end')} at end; limits: {run.get('limits')}.", "", f"Versions: {run['versions']}.", "",
             "## Goals per model (k3opt)", "", "| model | fewest nodes | latency (ORT opts off) <= best peer | equal outputs |",
             "|---|---|---|---|"]
    for model in run["models"]:
        if model.get("error"):
            lines.append(f"| {model['model']} | n/a | n/a | n/a |")
            continue
        cells = [f"{_mark(flag)} ({figures})" for flag, figures in goals(model).values()]
        lines.append(f"| {model['model']} | " + " | ".join(cells) + " |")
    sc = scaling(run)
    lines += ["", "## Scaling", "", "| goal | verdict | figures |", "|---|---|---|"]
    lines += [f"| {k} | {_mark(v)} | {fig} |" for k, (v, fig) in sc["goals"].items()] or ["| (no depth series run) | n/a | |"]
    if sc["depth"]:
        names = sorted({n for d in sc["depth"].values() for n in d})
        lines += ["", "Optimize time s / peak RSS MB over the depth series:", "",
                  "| layers | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for depth in sorted(sc["depth"]):
            cells = [sc["depth"][depth].get(n) for n in names]
            lines.append(f"| {depth} | " + " | ".join(
                f"{c['time_s']:.2f} / {_num(c['peak_rss_mb'], '{:.0f}')}" if c else "-" for c in cells) + " |")
    lines += hot_paths(run)
    lines += ["", "## Per model", ""]
    for model in run["models"]:
        lines += model_table(model)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        sys.stdout.write(render(json.load(f)))
