"""bench/llm_pair.py runs tiny: both figures per model, the pair's outputs checked against the Concat step's."""
from __future__ import annotations

import json

from tests.zoo import needs_torch


@needs_torch
def test_llm_pair_benchmark_runs_tiny(tmp_path, monkeypatch):
    from bench import llm_pair

    monkeypatch.setattr(llm_pair, "CACHE", tmp_path / "cache")
    rows = llm_pair.main(["--models", "llama", "--max-seq", "24", "--position", "20", "--prompt", "12",
                          "--hidden", "32", "--vocab", "64", "--rounds", "1", "--runs", "2", "--out", str(tmp_path / "out")])
    (row,) = rows
    assert row["model"] == "llama" and row["lm_head_rows"] == {"pair": 1, "concat": 12}
    assert row["decode_ratio"] > 0 and row["prefill_ratio"] > 0
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["rows"][0]["decode_ms"].keys() == {"pair", "concat", "concat-k3opt"}
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["results.json"]
