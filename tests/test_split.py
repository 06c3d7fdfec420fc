"""`k3opt split`: pipeline stages cut at decoder-layer boundaries, chained equal to the whole model; the manifest;
`k3opt compile` of a split (one .om per stage, against the stand-in atc); bad input refused in one line."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

import k3opt
from k3opt.blocks.split import read_manifest, split_model
from k3opt.cli import main
from k3opt.errors import OutputError, UsageError, VerificationError
from k3opt.pipeline import verify as verifier
from k3opt.blocks.structure import NoLayers

from .fake_atc import recorded_argv, write_fake_atc
from .split_models import DECODE_NAMES, LAYERS, NAMES, split_inputs, split_model as export
from .zoo import needs_torch

CASES = [pytest.param(n, False, s, None, id=f"{n}-prefill-{s}") for n in NAMES for s in (2, 3)] + \
        [pytest.param(n, True, s, None, id=f"{n}-decode-{s}") for n in DECODE_NAMES for s in (2, 3)]
#: balance 2: 3 stages of 4 layers cut between a layer's attention and its MLP (the default 1.1 cuts inside them)
MID_LAYER = [pytest.param(n, d, 3, 2.0, id=f"{n}-{'decode' if d else 'prefill'}-3-mid-layer")
             for n in NAMES for d in (False, True) if not d or n in DECODE_NAMES]

def chained(folder: Path, feeds: dict) -> dict:
    """The stages of ``folder`` run in manifest order from their files, each fed from the graph inputs and
    earlier stages as the manifest says."""
    manifest = read_manifest(folder)
    env = dict(feeds)
    for stage in manifest["stages"]:
        session = verifier.session(folder / stage["file"])
        names = [i["name"] for i in stage["inputs"]]
        assert [i.name for i in session.get_inputs()] == names
        for i in stage["inputs"]:
            assert i["from"] == "graph" or i["from"] < stage["index"]
        env.update(zip([o.name for o in session.get_outputs()], verifier.run(session, {n: env[n] for n in names})))
    return env


@needs_torch
@pytest.mark.parametrize("name,decode,stages,balance", CASES + MID_LAYER)
def test_stages_chained_equal_the_whole_model(name, decode, stages, balance, tmp_path):
    src = export(name, decode)
    out = tmp_path / "stages"
    manifest = split_model(src, out, stages, **({} if balance is None else {"balance": balance}))
    assert manifest["verification"]["status"] == "passed"
    assert len(manifest["stages"]) == stages
    whole = onnx.load(src)
    feeds = split_inputs(name, decode)
    want = verifier.run(verifier.session(whole), feeds)
    env = chained(out, feeds)
    for o, w in zip(whole.graph.output, want):
        np.testing.assert_array_equal(env[o.name], w)
    # every node once, plus only copied side computations (constants, masks...)
    nodes = [onnx.load(out / s["file"], load_external_data=False).graph.node for s in manifest["stages"]]
    assert sum(len(n) for n in nodes) == len(whole.graph.node) + sum(s["copied_constants"] for s in manifest["stages"])
    layers = [s["layers"] for s in manifest["stages"]]
    assert layers[0][0] == 0 and layers[-1][1] == LAYERS - 1
    for (a, b), cut in zip(zip(layers, layers[1:]), manifest["cuts"]):  # a layer cut inside is in both stages
        assert b[0] == (a[1] + 1 if cut["kind"] == "layer" else a[1]) == cut["layer"]
        assert cut["tensor"] in cut["hands"] or cut["kind"] != "layer"
    if balance is not None:  # the stream between a layer's attention and its MLP
        assert [(c["kind"], c["part"]) for c in manifest["cuts"]] == [("sublayer", "attention"), ("layer", "")]
    for s in manifest["stages"]:
        assert (out / s["data"]).is_file() and s["device"] == s["index"]
        if decode:  # a layer's caches are the stage's holding its attention: the first holding the layer
            own = [f"past_key_values.{i}.{p}" for i in range(s["layers"][0], s["layers"][1] + 1)
                   if s["index"] == 0 or layers[s["index"] - 1][1] < i for p in ("key", "value")]
            assert sorted(s["cache_inputs"]) == sorted(own)
            assert sorted(s["cache_outputs"]) == sorted(n.replace("past_key_values", "present") for n in own)


@needs_torch
def test_manifest_records_boundaries_types_bytes_and_stage_metadata(tmp_path):
    out = tmp_path / "s"
    manifest = split_model(export("llama", True), out, 2)
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk["format"] == "k3opt-pipeline/1" and on_disk["boundaries"] == manifest["boundaries"]
    first, second = on_disk["stages"]
    handed = {o["name"] for o in first["outputs"] if 1 in o["to"]}
    assert handed and handed == {i["name"] for i in second["inputs"] if i["from"] == 0}
    assert manifest["boundaries"][0] in handed
    boundary = next(i for i in second["inputs"] if i["name"] == manifest["boundaries"][0])
    assert boundary["dtype"] == "float32" and len(boundary["shape"]) == 3
    assert all(s["weight_bytes"] > 0 and s["bytes"] >= s["weight_bytes"] for s in on_disk["stages"])
    meta = {p.key: p.value for p in onnx.load(out / second["file"], load_external_data=False).metadata_props}
    assert meta["k3opt.pipeline_stage"] == "1" and meta["k3opt.pipeline_stages"] == "2"


@needs_torch
def test_layers_by_hand_and_balance(tmp_path):
    manifest = split_model(export("qwen2"), tmp_path / "a", layers=[(0, 0), (1, 3)])
    assert [s["layers"] for s in manifest["stages"]] == [[0, 0], [1, 3]]
    manifest = split_model(export("qwen2"), tmp_path / "b", 2)
    assert [s["layers"] for s in manifest["stages"]] == [[0, 1], [2, 3]] and manifest["balance"] < 1.01


@needs_torch
def test_an_optimized_model_splits_too(tmp_path):
    opt = tmp_path / "opt.onnx"
    k3opt.optimize_file(export("llama", True), opt)
    manifest = split_model(opt, tmp_path / "s", 3)
    assert manifest["verification"]["status"] == "passed"


@needs_torch
def test_bad_input_is_refused_in_one_line(tmp_path):
    with pytest.raises(UsageError, match="5 stages but the model has 4 decoder layers"):
        split_model(export("llama"), tmp_path / "a", 5)
    with pytest.raises(UsageError, match="over --max-stage-bytes"):
        split_model(export("llama"), tmp_path / "b", 2, max_stage_bytes=50_000)
    with pytest.raises(UsageError, match="--layers must cover"):
        split_model(export("llama"), tmp_path / "c", layers=[(0, 1), (3, 3)])
    flat = tmp_path / "flat.onnx"
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])
    onnx.save(onnx.helper.make_model(onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "g", [x],
              [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])])), flat)
    with pytest.raises(NoLayers, match="residual stream"):
        split_model(flat, tmp_path / "d", 2)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(OutputError, match="--overwrite"):
        split_model(export("llama"), tmp_path / "full", 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flat.onnx", "full"]  # nothing left behind
    result = CliRunner().invoke(main, ["split", str(export("llama")), "--stages", "9", "-o", str(tmp_path / "e")])
    assert result.exit_code == 2 and result.output.count("\n") == 1 and "at most 4 stages" in result.output


@needs_torch
def test_cli_split_then_compile_one_om_per_stage(tmp_path, monkeypatch):
    atc = write_fake_atc(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{atc.parent}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "stages"
    runner = CliRunner()
    result = runner.invoke(main, ["split", str(export("qwen2", True)), "--stages", "2", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "verification: passed" in result.output and "stage 1: layers 2-3" in result.output
    shapes = ["--input-shape", "input_ids:2,1", "--input-shape", "attention_mask:2,6"]
    for i in range(LAYERS):
        shapes += [f"--input-shape=past_key_values.{i}.{p}:2,2,5,8" for p in ("key", "value")]
    result = runner.invoke(main, ["compile", str(out / "manifest.json"), "--soc-version", "Ascend910B3",
                                  "-o", str(tmp_path / "om" / "q"), "-q", *shapes])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "om").glob("*.om")) == ["q_stage0.om", "q_stage1.om"]
    argv = recorded_argv(atc)
    assert len(argv) == 2
    second = next(a for a in argv[1] if a.startswith("--input_shape="))
    assert "past_key_values.2.key:2,2,5,8" in second and "past_key_values.0.key" not in second
    boundary = read_manifest(out)["boundaries"][0]
    assert f"{boundary}:2,1,32" in second  # the residual stream [batch, sequence, 32]: input_ids' batch, sequence
    # (the rotary tables, [1, 1, unk, 8] in the manifest, come from a run of the source model)


@needs_torch
def test_compile_of_a_static_cann_split_needs_no_input_shape(tmp_path, monkeypatch):
    """Split with every input's dims fixed: the manifest has every handed tensor's static shape, and
    `k3opt compile MANIFEST` gives each stage's ATC its inputs' shapes with no --input-shape (the source
    gone). The shapes are checked against the stages run under the reference NPU ops."""
    from k3opt.api import reference_evaluator

    atc = write_fake_atc(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{atc.parent}{os.pathsep}{os.environ['PATH']}")
    src = tmp_path / "src.onnx"
    src.write_bytes(export("llama", True).read_bytes())
    fixed = ["input_ids:2,1", "attention_mask:2,6"] + [f"past_key_values.{i}.{p}:2,2,5,8" for i in range(LAYERS)
                                                        for p in ("key", "value")]
    runner = CliRunner()
    result = runner.invoke(main, ["split", str(src), "--stages", "3", "--target", "cann", "-o", str(tmp_path / "s"),
                                  *[f"--input-shape={f}" for f in fixed]])
    assert result.exit_code == 0, result.output
    src.unlink()
    manifest = read_manifest(tmp_path / "s")
    assert all(isinstance(d, int) for s in manifest["stages"] for t in s["inputs"] for d in t["shape"])
    result = runner.invoke(main, ["compile", str(tmp_path / "s"), "--soc-version", "Ascend910B3",
                                  "-o", str(tmp_path / "om" / "l"), "-q"])
    assert result.exit_code == 0, result.output
    argv = recorded_argv(atc)
    assert len(argv) == 3
    env = dict(split_inputs("llama", True))  # what the stages really receive, run under the reference ops
    evaluate = reference_evaluator("cann")
    for stage, args in zip(manifest["stages"], argv):
        given = next(a for a in args if a.startswith("--input_shape=")).removeprefix("--input_shape=")
        model = onnx.load(tmp_path / "s" / stage["file"])
        names = [i.name for i in model.graph.input]
        assert given == ";".join(f"{n}:{','.join(str(d) for d in env[n].shape)}" for n in names)
        env.update(zip([o.name for o in model.graph.output], evaluate(model).run(None, {n: env[n] for n in names})))


@needs_torch
def test_target_cann_lowers_then_cuts(tmp_path):
    manifest = split_model(export("llama"), tmp_path / "c", 2, target="cann")
    assert manifest["target"] == "cann" and manifest["verification"]["status"] == "passed"
    ops = {n.op_type for s in manifest["stages"]
           for n in onnx.load(tmp_path / "c" / s["file"], load_external_data=False).graph.node}
    assert {"NPURmsNorm", "NPUPromptFlashAttention"} <= ops


def _break_stage_one(monkeypatch):
    """Stage 1 written with one weight scaled by 1.5 (a wrong cut or write the stage check must catch)."""
    from k3opt.blocks import split as split_module

    write = split_module.stage_model

    def broken(model, block, types, index, count):
        stage = write(model, block, types, index, count)
        if index == 1:
            t = next(t for t in stage.graph.initializer if t.data_type == onnx.TensorProto.FLOAT and
                     np.prod(t.dims) >= 256)
            t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t) * np.float32(1.5), t.name))
        return stage

    monkeypatch.setattr(split_module, "stage_model", broken)


@needs_torch
@pytest.mark.parametrize("budget", [None, 120_000], ids=["whole", "block-wise"])
def test_target_cann_stages_are_run_under_the_reference_ops_and_a_wrong_stage_is_caught(budget, tmp_path,
                                                                                          monkeypatch):
    """Lowered stages are verified themselves (chained, under k3opt's reference NPU ops, against the source
    in onnxruntime), layer by layer when the model is over --verify-memory; before, the stages of a
    block-verified run were written unrun."""
    src = export("llama", True)
    manifest = split_model(src, tmp_path / "a", 2, target="cann", verify_memory=budget)
    v = manifest["verification"]
    assert v["status"] == "passed" and v["stages_run_by"] == "the cann reference ops"
    assert v.get("mode") == (None if budget is None else "block-wise")
    assert manifest["optimization"]["lowering_verification"]["status"] == "passed"
    _break_stage_one(monkeypatch)
    with pytest.raises(VerificationError, match=r"stages chained \(the cann reference ops\) differ"):
        split_model(src, tmp_path / "b", 2, target="cann", verify_memory=budget)
    assert not (tmp_path / "b").exists()


@needs_torch
def test_external_data_model_over_the_budget_splits_and_verifies_layer_by_layer(tmp_path):
    """Weights in a data file, the budget under the model: the whole model and the written stages run one
    layer at a time, weights read from the data files for each layer's run."""
    from k3opt import modelio

    src = tmp_path / "ext.onnx"
    modelio.save(modelio.read_model(export("llama", True)).model, src, external_data=True)
    manifest = split_model(src, tmp_path / "s", 3, verify_memory=100_000)
    assert manifest["verification"]["status"] == "passed"
    env = chained(tmp_path / "s", split_inputs("llama", True))
    want = verifier.run(verifier.session(onnx.load(src)), split_inputs("llama", True))
    np.testing.assert_array_equal(env["logits"], want[0])


@needs_torch
def test_cli_balance_decides_whether_cuts_go_inside_a_sublayer(tmp_path):
    """3 stages of 4 equal layers: within 1.1 takes a cut inside an attention and one inside an MLP (each hands
    on one activation besides the stream); within 2 the stream between attention and MLP is enough."""
    src = str(export("qwen2"))
    runner = CliRunner()
    tight = runner.invoke(main, ["split", src, "--stages", "3", "-o", str(tmp_path / "a")])
    assert tight.exit_code == 0, tight.output
    assert "cut inside layer 1's attention: hands on" in tight.output and "cut inside layer 2's mlp" in tight.output
    manifest = read_manifest(tmp_path / "a")
    assert manifest["balance"] <= 1.1 and {c["kind"] for c in manifest["cuts"]} == {"inner"}
    inner = manifest["cuts"][1]
    assert inner["tensor"] in inner["hands"] and len(inner["hands"]) == 2  # the activation and the stream
    loose = runner.invoke(main, ["split", src, "--stages", "3", "--balance", "2", "-o", str(tmp_path / "b")])
    assert loose.exit_code == 0, loose.output
    assert "cut after layer 1's attention" in loose.output and "inside" not in loose.output
    assert 1.1 < read_manifest(tmp_path / "b")["balance"] <= 2
    bad = runner.invoke(main, ["split", src, "--stages", "3", "--balance", "0.5", "-o", str(tmp_path / "c")])
    assert bad.exit_code == 2 and "--balance" in bad.output
