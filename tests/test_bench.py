"""The benchmark harness end to end on one tiny model with one cheap optimizer, so it does not rot."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from bench import run as bench_run
from bench.latency_rounds import rounds
from bench.procs import run_measured
from bench.report import _spread, derive, goals
from tests.helpers import make_model


def _tiny_model() -> onnx.ModelProto:
    """x @ W + b, then an Identity: something every optimizer can shrink."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["a"]),
             helper.make_node("Identity", ["a"], ["y"])]
    rng = np.random.default_rng(0)
    inits = {"w": rng.standard_normal((8, 4)).astype(np.float32), "b": rng.standard_normal(4).astype(np.float32)}
    return make_model(nodes, [("x", TensorProto.FLOAT, ["batch", 8])], [("y", TensorProto.FLOAT, ["batch", 4])], inits)


def test_harness_runs_one_model_with_one_optimizer(tmp_path):
    path = tmp_path / "tiny.onnx"
    onnx.save(_tiny_model(), str(path))
    out = tmp_path / "out"
    bench_run.main(["--model-file", str(path), "--optimizers", "ort-basic", "--budget", "0.05", "--rounds", "2",
                    "--out", str(out)])
    run = json.loads((out / "results.json").read_text())
    (model,) = run["models"]
    assert model["original"]["nodes"] == 3 and model["original"]["checker"] == "ok"
    (row,) = model["results"]
    assert row["optimizer"] == "ort-basic" and row["status"] == "ok", row
    assert row["eval"]["nodes"] < 3 and row["equal"] is True
    assert row["eval"]["diff"]["max_abs"] < 1e-5
    assert row["peak_rss_mb"] > 10 and row["payload"]["time_s"] > 0
    assert set(row["eval"]["latency"]) == {"disabled", "basic"}
    for ev in (model["original"], row["eval"]):  # both measured in each of the two rounds
        assert len(ev["latency"]["disabled"]["rounds_ms"]) == 2 and ev["latency"]["basic"]["runs"] >= 10
    assert row["ratio"]["disabled"]["to_best_peer"] == 1.0  # the only peer is the best peer
    assert goals(model)["equal"] == (None, "not run")  # no k3opt row: no verdict, not a pass
    table = (out / "results.md").read_text()
    assert "| ort-basic | ok |" in table and "tiny" in table


def test_latency_rounds_interleave_files_and_keep_a_bad_one_to_itself(tmp_path):
    good, bad = tmp_path / "good.onnx", tmp_path / "bad.onnx"
    onnx.save(_tiny_model(), str(good))
    bad.write_bytes(b"not a model")
    np.savez(tmp_path / "feeds.npz", x=np.ones((2, 8), np.float32))
    got = rounds([good, bad, good], tmp_path / "feeds.npz", {"timeout_s": 60}, 0.02, count=3)
    assert "error" in got[1] and "error" not in got[0]
    for merged in (got[0], got[2]):
        lat = merged["disabled"]
        assert len(lat["rounds_ms"]) == 3 and lat["median_ms"] == sorted(lat["rounds_ms"])[1]
        assert lat["p25_ms"] <= lat["median_ms"] <= lat["p75_ms"]


def test_latency_ab_compares_files_and_profiles_op_types(tmp_path):
    from bench import latency_ab

    onnx.save(_tiny_model(), str(tmp_path / "a.onnx"))
    np.savez(tmp_path / "feeds.npz", x=np.ones((2, 8), np.float32))
    latency_ab.main([str(tmp_path / "a.onnx"), str(tmp_path / "a.onnx"), "--feeds", str(tmp_path / "feeds.npz"),
                     "--rounds", "2", "--budget", "0.02", "--profile", str(tmp_path / "prof"),
                     "--json", str(tmp_path / "ab.json")])
    got = json.loads((tmp_path / "ab.json").read_text())
    assert len(got[str(tmp_path / "a.onnx")]["rounds_ms"]) == 2
    assert [set(t) for t in got["op_totals_ms"]] == [{"MatMul", "Add", "Identity"}] * 2


def test_latency_noise_is_the_spread_of_the_round_medians():
    # five rounds, one stray (a hiccup of the machine): the interquartile range ignores it
    assert _spread({"median_ms": 10.0, "p25_ms": 9.9, "p75_ms": 10.1, "rounds_ms": [10.2, 20.0, 9.8, 10.0, 10.1]}) \
        == pytest.approx(0.02)  # 10.0 to 10.2
    assert _spread({"median_ms": 10.0, "p25_ms": 9.9, "p75_ms": 10.1, "rounds_ms": [9.0, 10.0, 12.0]}) == 0.3  # range
    assert _spread({"median_ms": 10.0, "p25_ms": 9.5, "p75_ms": 10.5}) == 0.1  # a run saved before the rounds


def test_crashes_and_timeouts_are_results():
    crash = run_measured([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGABRT)"], 30)
    assert crash.status == "crash" and "SIGABRT" in crash.error
    hang = run_measured([sys.executable, "-c", "import time; time.sleep(30)"], 0.5)
    assert hang.status == "timeout" and hang.wall_s < 10
    litter = ("import json, os, tempfile; d = tempfile.mkdtemp()\n"
              "json.dump({'d': d}, open(os.environ['BENCH_RESULT'], 'w'))")
    left = run_measured([sys.executable, "-c", litter], 30)
    assert left.status == "ok" and not os.path.exists(left.payload["d"])  # its temporary files went with it
    fail = run_measured([sys.executable, "-c", "raise SystemExit('boom')"], 30)
    assert fail.status == "error" and "boom" in fail.error
    grow = "import time\nblocks = []\nwhile True:\n    blocks.append(bytearray(50_000_000))\n    time.sleep(0.05)"
    hog = run_measured([sys.executable, "-c", grow], 30, max_rss_mb=300)
    assert hog.status == "memory-limit" and 250 < hog.peak_rss_mb < 600


def test_structure_counts_the_nodes_of_bodies_too(tmp_path):
    """An If's branches hold nodes of the model: one optimizer inlining a constant If (its nodes moved to the
    main graph) has not grown it against one that kept the If."""
    from bench.evaluate import structure

    def branch(name: str) -> onnx.GraphProto:
        return helper.make_graph([helper.make_node("Neg", ["x"], [f"{name}_n"]),
                                  helper.make_node("Relu", [f"{name}_n"], [f"{name}_y"])], name, [],
                                 [helper.make_tensor_value_info(f"{name}_y", TensorProto.FLOAT, [2])])

    nodes = [helper.make_node("If", ["c"], ["y"], then_branch=branch("t"), else_branch=branch("e"))]
    path = tmp_path / "if.onnx"
    onnx.save(make_model(nodes, [("x", TensorProto.FLOAT, [2]), ("c", TensorProto.BOOL, [])],
                         [("y", TensorProto.FLOAT, [2])]), str(path))
    assert structure(path) == {"nodes": 5, "ops": {"If": 1, "Neg": 2, "Relu": 2}}


def test_wall_time_is_the_childs_not_the_next_poll():
    """A child ending at 0.17 s (after polls at 0.005, 0.015, 0.035, 0.075, 0.155 s, the next one 0.1 s
    later) measures about 0.17 s: the wait wakes when the child exits, not at the next poll."""
    walls = sorted(run_measured(["sleep", "0.17"], 30).wall_s for _ in range(3))
    assert 0.17 <= walls[1] < 0.23, walls


def _row(optimizer: str, nodes: int, median_ms: float, checker: str = "ok", max_abs: float = 0.0) -> dict:
    lat = {"median_ms": median_ms, "p25_ms": median_ms, "p75_ms": median_ms}
    return {"optimizer": optimizer, "status": "ok",
            "eval": {"nodes": nodes, "checker": checker, "ops": {}, "diff": {"max_abs": max_abs, "max_rel": max_abs},
                     "latency": {"disabled": lat, "basic": lat}}}


def test_goals_compare_with_valid_peers_only_and_name_the_invalid_ones():
    lat = {"median_ms": 1.0, "p25_ms": 1.0, "p75_ms": 1.0}
    model = {"original": {"nodes": 50, "ops": {}, "latency": {"disabled": lat, "basic": lat}}, "results": [
        _row("k3opt", 20, 1.0),
        _row("onnxslim", 25, 1.0),
        _row("ort-transformers", 12, 0.5, checker="ValidationError: No Op registered for LayerNormalization"),
        _row("broken", 5, 0.1, max_abs=1.0),  # fewer nodes, faster, but wrong outputs: never a peer
    ]}
    derive(model)
    assert model["best_peer"] == {"disabled": "onnxslim", "basic": "onnxslim"}
    verdict = goals(model)
    assert verdict["fewest_nodes"] == (True, "20 vs 25 (onnxslim); ort-transformers has 12, not valid ONNX")
    assert verdict["latency"][0] is True
    model["results"][1]["eval"]["nodes"] = 19  # a valid peer with fewer nodes is a miss
    assert goals(model)["fewest_nodes"][0] is False


def test_time_samples_rerun_the_timed_optimizers_interleaved(tmp_path):
    path = tmp_path / "tiny.onnx"
    onnx.save(_tiny_model(), str(path))
    rows = [{"optimizer": "k3opt", "status": "ok", "payload": {"time_s": 9.0}, "wall_s": 10.0},
            {"optimizer": "ort-basic", "status": "ok", "payload": {"time_s": 1.0}},  # not a timed optimizer
            {"optimizer": "onnxsim", "status": "crash", "payload": None}]  # failed: not rerun
    bench_run.time_samples(rows, path, tmp_path / "again", "gpt2", {"timeout_s": 120}, runs=3)
    assert len(rows[0]["time_samples"]) == 3 and rows[0]["time_samples"][0] == 9.0
    assert rows[0]["time_median_s"] == sorted(rows[0]["time_samples"])[1] < 9.0
    assert len(rows[0]["wall_samples"]) == 3 and rows[0]["wall_median_s"] == sorted(rows[0]["wall_samples"])[1] < 10
    assert "time_samples" not in rows[1] and "time_samples" not in rows[2]
    assert not (tmp_path / "again").exists()



def test_time_samples_vary_which_optimizer_runs_before_which(tmp_path, monkeypatch):
    """Each round runs every timed optimizer once, in its own order: k3opt must not always follow onnxslim
    (a process right after a memory-hungry one runs slower on this VM)."""
    from bench.procs import ProcResult

    calls = []

    def fake(cmd, timeout_s, max_rss_mb=None):
        calls.append(cmd[cmd.index("bench.optimizers") + 1])
        return ProcResult("ok", 0, 0.1, 1.0, {"time_s": 1.0}, "")

    monkeypatch.setattr(bench_run, "run_measured", fake)
    rows = [{"optimizer": o, "status": "ok", "payload": {"time_s": 1.0}, "wall_s": 1.5}
            for o in ("k3opt", "onnxsim", "onnxslim")]
    bench_run.time_samples(rows, tmp_path / "m.onnx", tmp_path / "again", "gpt2", {"timeout_s": 5}, runs=7)
    rounds = [calls[i:i + 3] for i in range(0, len(calls), 3)]
    assert len(rounds) == 6 and all(sorted(r) == ["k3opt", "onnxsim", "onnxslim"] for r in rounds)
    before_k3opt = {calls[i - 1] for i, name in enumerate(calls) if name == "k3opt" and i}
    assert before_k3opt == {"onnxsim", "onnxslim"}
    assert all(len(row["time_samples"]) == 7 for row in rows)

def test_time_goals_read_the_medians():
    from bench.report import scaling

    def model(name: str, k3: list, sim: list) -> dict:
        rows = [{"optimizer": o, "status": "ok", "payload": {"time_s": t[0]}, "time_samples": t,
                 "time_median_s": float(np.median(t)), "peak_rss_mb": 100} for o, t in (("k3opt", k3), ("onnxsim", sim))]
        return {"model": name, "results": rows}

    run = {"models": [model("llama-depth8", [0.5, 0.4, 0.6], [1, 1, 1]),
                      model("llama-depth64", [1.9, 3.0, 2.0], [4.0, 4.2, 9.0])]}
    goals = scaling(run)["goals"]
    assert goals["64 layers: faster than fastest of onnxsim/onnxslim"][0] is True
    verdict, figures = goals["64 layers (aim): at most half of that"]
    assert verdict is True and "2.00 s vs 2.10 s" in figures and "medians of 3" in figures
    assert goals["linear 8->64 layers (time ratio <= 9)"] == (True, "x4.0")


def test_series_runs_interleave_the_depths_and_rotate_the_start(tmp_path, monkeypatch):
    from bench.procs import ProcResult

    calls = []

    def fake(cmd, timeout_s, max_rss_mb=None):
        src = cmd[cmd.index("k3opt") + 1]
        calls.append(src)
        (tmp_path / "series" / "model.onnx").write_bytes(b"out")
        ok = len(calls) != 4  # the second 16-layer run fails: left out
        return ProcResult("ok" if ok else "crash", 0, 0.1, 1.0, {"time_s": float(src[1:-5])} if ok else None, "")

    monkeypatch.setattr(bench_run, "run_measured", fake)
    series = [(8, "d8.onnx", "gpt2"), (16, "d16.onnx", "gpt2"), (64, "d64.onnx", "gpt2")]
    samples = bench_run.series_runs(series, tmp_path / "series", {"timeout_s": 5}, rounds=3)
    assert calls == ["d8.onnx", "d16.onnx", "d64.onnx", "d16.onnx", "d64.onnx", "d8.onnx",
                     "d64.onnx", "d8.onnx", "d16.onnx"]
    assert samples == {"8": [8.0] * 3, "16": [16.0, 16.0], "64": [64.0] * 3}
    assert not (tmp_path / "series").exists()


def test_scaling_goal_reads_the_series_rounds_when_there_are_some():
    from bench.report import render, scaling

    rows = [{"optimizer": "k3opt", "status": "ok", "payload": {"time_s": t}, "peak_rss_mb": 100} for t in (0.2, 2.6)]
    run = {"models": [{"model": "llama-depth8", "results": [rows[0]]}, {"model": "llama-depth64", "results": [rows[1]]}]}
    assert scaling(run)["goals"]["linear 8->64 layers (time ratio <= 9)"] == (False, "x13.0")  # per-model runs
    run["series_runs"] = {"8": [0.25, 0.2, 0.3], "64": [1.8, 2.0, 5.0]}
    sc = scaling(run)
    assert sc["goals"]["linear 8->64 layers (time ratio <= 9)"] == (
        True, "x8.0 (0.25 s -> 2.00 s: medians of 3 interleaved rounds over the series)")
    assert sc["depth"][64]["k3opt (series rounds)"] == {"time_s": 2.0, "peak_rss_mb": None}
    assert "| 64 | 2.60 / 100 | 2.00 / - |" in render({"date": "d", "machine": "m", "versions": "v", **run})


def test_the_opset14_goal_reads_whole_process_wall_medians():
    from bench.models import export_opset, model_set, series_depth
    from bench.report import LEGACY_WALL, scaling

    names = [s.name for s in model_set(quick=True)]
    assert {"llama-depth8-op14", "llama-depth16-op14"} <= set(names)
    assert series_depth("llama-depth64-op14") == 64 and export_opset("llama-depth64-op14") == 14
    assert export_opset("llama-depth64") == 17

    def row(optimizer: str, walls: list) -> dict:
        return {"optimizer": optimizer, "status": "ok", "payload": {"time_s": 1.0}, "wall_s": walls[0],
                "wall_samples": walls, "wall_median_s": float(np.median(walls))}

    run = {"models": [{"model": "llama-depth64-op14", "results": [row("k3opt", [2.0, 1.9, 9.0]),
                                                                  row("onnxsim", [4.0, 4.2, 3.9])]}]}
    assert scaling(run)["goals"][LEGACY_WALL] == (True, "2.00 s vs 4.00 s: ratio 0.50 (medians of 3 interleaved runs)")
    run["models"][0]["results"][0]["wall_median_s"] = 2.1
    assert scaling(run)["goals"][LEGACY_WALL][0] is False
