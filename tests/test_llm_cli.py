"""``k3opt llm`` and ``k3opt generate`` on the command line: what they write and print, and their one-line errors."""
from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from k3opt.cli import main
from k3opt.llm import left_pad, original_greedy
from tests.llm_models import llm_decode_model
from tests.zoo import needs_torch, zoo_model

pytestmark = needs_torch


def invoke(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def test_llm_then_generate_prints_the_original_tokens(tmp_path: Path) -> None:
    step = llm_decode_model("qwen2")
    code, out, err = invoke("llm", step, "--max-seq", 40, "--max-batch", 2, "-o", tmp_path / "pair")
    assert code == 0, err
    assert "wrote" in out and "tokens verified" in out
    manifest = json.loads((tmp_path / "pair" / "manifest.json").read_text())
    assert manifest["max_batch"] == 2
    # reported as optimize reports its verification: per graph, and the token check, printed and in the manifest
    checked = manifest["verification"]
    assert checked["status"] == "passed" and sorted(checked["graphs"]) == ["decode_b1.onnx", "decode_b2.onnx",
                                                                          "prefill.onnx"]
    assert all(line.startswith("passed (") for line in checked["graphs"].values())
    assert "at batch 1 and batch 2 left-padded" in checked["tokens"]
    assert f"verification: tokens: {checked['tokens']}" in out
    assert f"verification: prefill.onnx: {checked['graphs']['prefill.onnx']}" in out
    code, out, err = invoke("generate", tmp_path / "pair", "--prompt", "5,17,23,4", "--prompt", "9,2", "--steps", 12)
    assert code == 0, err
    rows = [[int(t) for t in line.split(",")] for line in out.split()]
    ids, mask = left_pad([[5, 17, 23, 4], [9, 2]])
    assert rows == original_greedy(step, ids, mask, 12).tolist()
    assert "ms/step" in err and "prefill" in err


def test_generate_with_top_k_is_seeded(tmp_path: Path) -> None:
    code, out, _ = invoke("llm", llm_decode_model("llama"), "--max-seq", 24, "-o", tmp_path / "pair", "--no-verify")
    assert code == 0 and "not verified" in out and "verification:" not in out
    assert json.loads((tmp_path / "pair" / "manifest.json").read_text())["verification"] == {
        "status": "skipped", "reason": "--no-verify"}
    args = ("generate", tmp_path / "pair", "--prompt", "3,4,5", "--steps", 10, "--top-k", 5, "-q")
    first, again = invoke(*args, "--seed", 1), invoke(*args, "--seed", 1)
    assert first[0] == 0 and first[1] == again[1] and first[2] == ""
    assert len(first[1].split(",")) == 10


def test_one_line_errors(tmp_path: Path) -> None:
    invoke("llm", llm_decode_model("gpt2"), "--max-seq", 16, "-o", tmp_path / "pair")
    odd = onnx.load(str(llm_decode_model("llama")))
    for node in odd.graph.node:  # the cache grown on the head axis: no sequence-axis KV cache
        if node.op_type == "Concat" and "past_key_values.0.value" in node.input:
            node.attribute[0].i = 1
    onnx.save(odd, str(tmp_path / "odd.onnx"))
    cases = [
        (("generate", tmp_path / "pair", "--prompt", "1,2,3", "--steps", 15), "--max-seq 16"),
        (("generate", tmp_path / "pair", "--prompt", "1,2", "--prompt", "3", "--steps", 2), "--max-batch 1"),
        (("generate", tmp_path / "pair", "--prompt", "1,x"), "token ids separated by commas"),
        (("generate", tmp_path / "pair", "--prompt", "1,100"), "token ids must be in [0, 100)"),
        (("generate", tmp_path, "--prompt", "1"), "not a k3opt llm pair"),
        (("llm", llm_decode_model("gpt2"), "--max-seq", 100, "-o", tmp_path / "big"), "position table (64 positions)"),
        (("llm", zoo_model("bert"), "--max-seq", 16, "-o", tmp_path / "enc"), "no past key/value inputs"),
        (("llm", zoo_model("llama"), "--max-seq", 16, "-o", tmp_path / "nc"), "no past key/value inputs"),
        (("llm", tmp_path / "odd.onnx", "--max-seq", 16, "-o", tmp_path / "odd"), "cache layout not recognised"),
        (("llm", tmp_path / "missing.onnx", "--max-seq", 16, "-o", tmp_path / "m"), "no such file"),
        (("llm", llm_decode_model("gpt2"), "--max-seq", 16, "-o", tmp_path / "pair"), "--overwrite"),
    ]
    for args, message in cases:
        code, out, err = invoke(*args)
        assert code == 2, (args, out, err)
        assert message in err and len(err.strip().splitlines()) == 1, (args, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["odd.onnx", "pair"]


def test_a_cann_pair_checks_clean_and_compiles_with_the_manifest_gears(tmp_path: Path) -> None:
    """`k3opt check` passes every graph; `k3opt compile PAIR` runs the stand-in ATC once per graph."""
    from tests.fake_atc import recorded_argv, write_fake_atc

    atc = write_fake_atc(tmp_path / "bin")
    pair = tmp_path / "pair"
    code, out, err = invoke("llm", llm_decode_model("llama"), "--max-seq", 32, "--max-batch", 2, "--target", "cann",
                            "-o", pair)
    assert code == 0, err
    code, out, err = invoke("check", pair)
    assert code == 0 and "ATC can parse every node" in out, out + err
    code, out, err = invoke("generate", pair, "--prompt", "5,17,23,4", "--prompt", "9,2", "--steps", 6)
    assert code == 0, err  # through the reference NPU ops: the original's tokens
    ids, mask = left_pad([[5, 17, 23, 4], [9, 2]])
    assert [[int(x) for x in line.split(",")] for line in out.split()] == \
        original_greedy(llm_decode_model("llama"), ids, mask, 6).tolist()
    code, out, err = invoke("compile", pair, "--soc-version", "Ascend910B3", "-o", tmp_path / "om", "--atc", atc)
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "om").glob("*.om")) == ["decode_b1.om", "decode_b2.om", "prefill.om"]
    runs = {Path(next(a for a in argv if a.startswith("--model="))[8:]).name: argv for argv in recorded_argv(atc)}
    prefill = runs["prefill.onnx"]
    assert "--input_shape=input_ids:-1,-1;attention_mask:-1,-1" in prefill
    assert "--dynamic_dims=1,16,1,16;1,32,1,32;2,16,2,16;2,32,2,32" in prefill
    decode = runs["decode_b2.onnx"]
    assert not [a for a in decode if a.startswith("--dynamic")]
    shapes = next(a for a in decode if a.startswith("--input_shape="))
    assert "input_ids:2,1" in shapes and "position:1" in shapes and "past_key_values.1.value:2,2,32,8" in shapes


def test_compiling_an_onnx_pair_is_refused(tmp_path: Path) -> None:
    invoke("llm", llm_decode_model("llama"), "--max-seq", 16, "-o", tmp_path / "pair")
    code, out, err = invoke("compile", tmp_path / "pair", "--soc-version", "Ascend910B3", "-o", tmp_path / "om",
                            "--dry-run")
    assert code == 2 and "--target cann" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_llm_from_a_config_json_exports_the_step_first(tmp_path: Path) -> None:
    """A transformers config JSON (random weights): exported, rewritten, verified; its position limit is kept."""
    source = tmp_path / "tiny.json"
    source.write_text(json.dumps({"model_type": "qwen2", "hidden_size": 32, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
                                  "vocab_size": 100, "max_position_embeddings": 40}))
    code, out, err = invoke("llm", source, "--max-seq", 40, "--max-batch", 2, "-o", tmp_path / "pair")
    assert code == 0 and "tokens verified" in out, err
    code, out, err = invoke("generate", tmp_path / "pair", "--prompt", "1,2,3", "--steps", 5, "-q")
    assert code == 0 and len(out.strip().split(",")) == 5
    code, out, err = invoke("llm", source, "--max-seq", 41, "-o", tmp_path / "long")
    assert code == 2 and "max_position_embeddings (40)" in err
