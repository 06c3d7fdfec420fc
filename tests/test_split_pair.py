"""`k3opt split` of a serving pair (k3opt.llm.split_pair): every graph cut at the same places, a weights file per
stage, and the stages chained generate the unsplit pair's tokens (prefill logits bit for bit)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx.external_data_helper import uses_external_data

from k3opt.cli import main
from k3opt.errors import VerificationError
from k3opt.llm import PairRunner, build_pair, left_pad
from k3opt.llm.split_pair import split_pair, staged_runner

from .llm_models import llm_decode_model
from .split_models import split_model
from .zoo import needs_torch

pytestmark = needs_torch
STEPS = 16


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """``pairs(name, target)``: a pair folder built once per module (4-layer exports; DeepSeek-V3's has 2)."""
    built: dict = {}

    def get(name: str, target: str = "onnx") -> Path:
        if (name, target) not in built:
            source = llm_decode_model(name) if name == "deepseek_v3" else split_model(name, decode=True)
            folder = tmp_path_factory.mktemp("pair") / f"{name}-{target}"
            build_pair(source, folder, max_seq=32, max_batch=2, target=target)
            built[name, target] = folder
        return built[name, target]

    return get


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [rng.integers(1, 100, 6).tolist(), rng.integers(1, 100, 3).tolist()]


@pytest.mark.parametrize("name,target,stages", [("llama", "onnx", 2), ("llama", "onnx", 3), ("qwen2", "onnx", 3),
                                                ("gpt2", "onnx", 3), ("deepseek_v3", "onnx", 2),
                                                ("llama", "cann", 3)])
def test_stages_chained_generate_the_pair_tokens(pairs, name, target, stages, tmp_path):
    from k3opt.api import reference_evaluator

    pair = pairs(name, target)
    manifest = split_pair(pair, tmp_path / "s", stages)
    assert manifest["verification"]["status"] == "passed" and len(manifest["stages"]) == stages
    evaluator = reference_evaluator(target)
    whole, staged = PairRunner(pair, evaluator=evaluator), staged_runner(tmp_path / "s", evaluator=evaluator)
    for prompts in (_prompts()[:1], _prompts()):
        ids, mask = left_pad(prompts)
        np.testing.assert_array_equal(staged.generate(ids, mask, STEPS), whole.generate(ids, mask, STEPS))
        feeds = {"input_ids": ids, "attention_mask": mask}
        for a, b in zip(staged.prefill.run(None, feeds), whole.prefill.run(None, feeds)):
            np.testing.assert_array_equal(a, b)
    graphs = [whole.manifest.prefill] + list(whole.manifest.decode.values())
    owned = []
    for s in manifest["stages"]:
        folder = tmp_path / "s" / s["folder"]
        assert sorted(p.name for p in folder.iterdir()) == sorted(graphs + ["weights.bin"])
        for g in graphs:  # each graph's weights in its stage's file (or inline when small)
            model = onnx.load(str(folder / g), load_external_data=False)
            assert {e.value for t in model.graph.initializer if uses_external_data(t) for e in t.external_data
                    if e.key == "location"} == {"weights.bin"}
        first, last = s["layers"]
        mine = [c["past"] for c in s["cache"]]
        owned += mine
        assert all(first <= int(p.split(".")[1]) <= last for p in mine)
        for g in graphs[1:]:  # a decode graph takes and returns exactly its stage's caches
            entry = s["graphs"][g]
            assert sorted(t["name"] for t in entry["inputs"] if t["name"].startswith("past")) == sorted(mine)
            assert sorted(t["name"] for t in entry["outputs"] if t["name"].startswith("present")) == \
                sorted(c["present"] for c in s["cache"])
        prefill = s["graphs"][whole.manifest.prefill]  # the prefill graph returns the same layers' caches
        assert sorted(t["name"] for t in prefill["outputs"] if t["name"].startswith("present")) == \
            sorted(c["present"] for c in s["cache"])
    assert sorted(owned) == sorted(e.past for e in whole.manifest.entries)  # each layer's cache in one stage


def test_cli_split_of_a_pair_then_generate(pairs, tmp_path):
    pair = pairs("qwen2")
    runner = CliRunner()
    result = runner.invoke(main, ["split", str(pair), "--stages", "2", "-o", str(tmp_path / "s")])
    assert result.exit_code == 0, result.output
    assert "stage 1: layers 2-3" in result.output and "3 graphs -> stage1/" in result.output
    assert "verification: passed" in result.output
    args = ["--prompt", "5,9,14", "--prompt", "3,3", "--steps", "6", "-q"]
    split_tokens = runner.invoke(main, ["generate", str(tmp_path / "s"), *args])
    assert split_tokens.exit_code == 0, split_tokens.output
    assert split_tokens.output == runner.invoke(main, ["generate", str(pair), *args]).output
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["kind"] == "llm-pair"
    for extra in (["--input-shape", "input_ids:1,4"], ["--target", "cann"]):
        bad = runner.invoke(main, ["split", str(pair), "--stages", "2", "-o", str(tmp_path / "t"), *extra])
        assert bad.exit_code == 2 and bad.output.count("\n") == 1 and "not for a serving pair" in bad.output
    bad = runner.invoke(main, ["compile", str(tmp_path / "s"), "--soc-version", "Ascend910B3",
                               "-o", str(tmp_path / "om")])
    assert bad.exit_code == 2 and bad.output.count("\n") == 1 and "--target cann" in bad.output
    assert not (tmp_path / "t").exists() and not (tmp_path / "om").exists()


def test_a_wrong_stage_is_caught_by_the_tokens(pairs, tmp_path, monkeypatch):
    """A stage whose weight is off changes the generated tokens: nothing is written."""
    from k3opt.llm import split_pair as module
    from k3opt.modelio import inline_copy

    write = module.stage_model

    def broken(model, block, types, index, count):
        stage = write(model, block, types, index, count)
        if index == 1:
            for t in stage.graph.initializer:
                if t.data_type == onnx.TensorProto.FLOAT and np.prod(t.dims) >= 256:
                    t.CopyFrom(onnx.numpy_helper.from_array(-onnx.numpy_helper.to_array(inline_copy(t)), t.name))
        return stage

    monkeypatch.setattr(module, "stage_model", broken)
    with pytest.raises(VerificationError, match="differ from the unsplit pair's"):
        split_pair(pairs("llama"), tmp_path / "s", 2)
    assert not (tmp_path / "s").exists()


def test_a_cann_split_pair_compiles_each_stage_with_the_pair_gears(pairs, tmp_path):
    """`k3opt compile SPLIT_PAIR`: every graph of every stage through the stand-in ATC; each stage's prefill takes
    the unsplit prefill's gear profiles (its handed-on tensors' dims named batch/sequence by the split), the
    decode graphs are static."""
    from tests.fake_atc import recorded_argv, write_fake_atc

    pair = pairs("llama", "cann")
    atc = write_fake_atc(tmp_path / "bin")
    split_pair(pair, tmp_path / "s", 2)
    runner = CliRunner()
    check = runner.invoke(main, ["check", str(tmp_path / "s")])
    assert check.exit_code == 0, check.output
    result = runner.invoke(main, ["compile", str(tmp_path / "s" / "manifest.json"), "--soc-version", "Ascend910B3",
                                  "-o", str(tmp_path / "om"), "--atc", str(atc)])
    assert result.exit_code == 0, result.output
    graphs = ["decode_b1.om", "decode_b2.om", "prefill.om"]
    assert [sorted(p.name for p in (tmp_path / "om" / f"stage{i}").iterdir()) for i in (0, 1)] == [graphs, graphs]
    runs = {"/".join(Path(next(a[8:] for a in argv if a.startswith("--model="))).parts[-2:]): argv
            for argv in recorded_argv(atc)}
    assert len(runs) == 6

    def arg(run: list, key: str):
        return next((a.split("=", 1)[1] for a in run if a.startswith(f"--{key}=")), None)

    gears = "1,16,1,16;1,32,1,32;2,16,2,16;2,32,2,32"  # the unsplit prefill's (tests/test_llm_cli.py)
    assert arg(runs["stage0/prefill.onnx"], "input_shape") == "input_ids:-1,-1;attention_mask:-1,-1"
    assert arg(runs["stage0/prefill.onnx"], "dynamic_dims") == gears
    later = runs["stage1/prefill.onnx"]  # takes the residual stream, the rotary tables and the masks
    shapes = dict(s.rsplit(":", 1) for s in arg(later, "input_shape").split(";"))
    assert shapes["/model/model/layers.1/Add_1_output_0"] == "-1,-1,32"
    unknown = sum(d == "-1" for dims in shapes.values() for d in dims.split(","))
    profiles = arg(later, "dynamic_dims").split(";")
    assert len(profiles) == 4 <= 100 and all(len(p.split(",")) == unknown for p in profiles)
    assert profiles[-1].split(",")[:2] == ["2", "32"]  # batch, then prompt length: the residual's dims
    for i in (0, 1):
        for b in (1, 2):
            decode = runs[f"stage{i}/decode_b{b}.onnx"]
            assert arg(decode, "dynamic_dims") is None and "-1" not in arg(decode, "input_shape")
    assert "past_key_values.3.value:2,2,32,8" in arg(runs["stage1/decode_b2.onnx"], "input_shape")


def test_a_split_pair_stage_with_an_unnamed_dim_is_refused_in_one_line(pairs, tmp_path):
    pair = pairs("llama", "cann")
    split_pair(pair, tmp_path / "s", 2, verify=False)
    path = tmp_path / "s" / "manifest.json"
    data = json.loads(path.read_text())
    data["stages"][1]["graphs"]["prefill.onnx"]["inputs"][0]["shape"][0] = "unk__7"  # a dim the walk did not prove
    path.write_text(json.dumps(data))
    result = CliRunner().invoke(main, ["compile", str(tmp_path / "s"), "--soc-version", "Ascend910B3",
                                       "-o", str(tmp_path / "om"), "--dry-run"])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert "unk__7" in result.output and "neither static nor a prefill gear dim" in result.output
    assert not (tmp_path / "om").exists()
