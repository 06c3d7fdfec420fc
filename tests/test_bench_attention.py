"""The attention latency benchmark end to end, tiny (one layer, 16 tokens, one round): it runs, k3opt's results
are equal to the original and carry the fused ops; no timing is asserted."""
from __future__ import annotations

import json

from bench import attention_latency
from tests.zoo import needs_torch


@needs_torch
def test_attention_benchmark_runs_tiny(tmp_path):
    # onnxscript, the peer the test line installs (the export extra brings it for torch's dynamo exporter);
    # onnxsim/onnxslim/onnxoptimizer come with the bench extra only
    run = attention_latency.main(["--hidden", "64", "--layers", "1", "--intermediate", "64", "--prefill", "16",
                                  "--past", "15", "--rounds", "1", "--budget", "0.02", "--optimizers", "onnxscript",
                                  "--out", str(tmp_path)])
    assert [p["phase"] for p in run["phases"]] == ["prefill", "decode"]
    for phase in run["phases"]:
        rows = {r["optimizer"]: r for r in phase["rows"]}
        assert set(rows) == {"original", attention_latency.SUBJECT, "onnxscript"}
        mine = rows[attention_latency.SUBJECT]
        assert mine["status"] == "ok" and attention_latency.equal(mine), mine
        assert mine["eval"]["ops"].get("RotaryEmbedding") == 2  # q and k of the one layer
        assert "Neg" not in mine["eval"]["ops"]
        for level in attention_latency.LEVELS:
            assert mine["latency"][level]["median_ms"] > 0
            ratio = phase["ratios"][level]
            assert ratio["best_peer"] == "onnxscript" and ratio["ratio"] > 0 and len(ratio["round_ratios"]) == 1
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["phases"][1]["ratios"] == run["phases"][1]["ratios"]
    assert "## decode" in (tmp_path / "results.md").read_text()
