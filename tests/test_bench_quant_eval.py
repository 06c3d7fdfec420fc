"""bench/quant_eval.py runs tiny: every row of both tables, ratios against fp32 and onnxruntime's quantizer."""
from __future__ import annotations

import pytest

from tests.zoo import needs_torch


@needs_torch
@pytest.mark.slow
def test_quant_eval_runs_tiny(tmp_path, monkeypatch):
    from bench import quant_eval

    monkeypatch.setattr(quant_eval, "CACHE", tmp_path / "cache")
    monkeypatch.setattr(quant_eval, "TEXT_CONFIG", dict(quant_eval.TEXT_CONFIG, hidden_size=128, intermediate_size=256,
                                                        num_hidden_layers=1))
    monkeypatch.setattr(quant_eval, "DECODE_CONFIG", dict(vocab_size=128, hidden_size=128, intermediate_size=256,
                                                          num_hidden_layers=1, num_attention_heads=2,
                                                          num_key_value_heads=1, max_position_embeddings=64))
    monkeypatch.setattr(quant_eval, "PAST", 15)
    monkeypatch.setattr(quant_eval, "HELD_OUT_FILES", ("textwrap.py",))
    res = quant_eval.main(["--steps", "2", "--rounds", "1", "--out", str(tmp_path / "out")])
    rows = res["accuracy"]["rows"]
    assert set(rows) >= {"fp32", "k3opt int8", "k3opt int4 g128", "k3opt int8 GPTQ", "k3opt int4 g128 GPTQ",
                         "ort int8 g128", "ort int4 g128"}
    assert all(r["ppl"] > 1 for r in rows.values())
    vs = rows["k3opt int4 g128 GPTQ"]["vs_ort"]
    assert vs["low"] <= vs["ratio"] <= vs["high"] and "vs_ort" not in rows["ort int4 g128"]
    assert res["decode"]["size_ratio"]["k3opt int4 g128"] < res["decode"]["size_ratio"]["k3opt int8"] < 1
    assert (tmp_path / "out" / "results.md").exists()
