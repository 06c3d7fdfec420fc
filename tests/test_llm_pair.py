"""The serving pair (k3opt.llm): a prefill graph and a static decode graph that generate the original's tokens."""
from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from k3opt.errors import InputError, OutputError, UsageError, VerificationError
from k3opt.llm import PairRunner, build_pair, decode_graph, left_pad, original_greedy, prefill_graph, recognise
from tests.llm_models import llm_decode_model, llm_params, llm_torch_model
from tests.zoo import needs_torch, zoo_model

pytestmark = needs_torch

STEPS, MAX_SEQ = 32, 48


def _prompts(vocab: int = 100) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(1, vocab, 7).tolist(), rng.integers(1, vocab, 4).tolist()]


@pytest.mark.parametrize("name,exporter", llm_params())
def test_pair_generates_the_original_tokens(tmp_path: Path, name: str, exporter: str) -> None:
    """Prefill + 32 decode steps, batch 1 and batch 2 left-padded: the same tokens as the export's own loop."""
    step = llm_decode_model(name, exporter)
    build_pair(step, tmp_path / "pair", max_seq=MAX_SEQ, max_batch=2)
    runner = PairRunner(tmp_path / "pair")
    for prompts in (_prompts()[:1], _prompts()):
        ids, mask = left_pad(prompts)
        want = original_greedy(step, ids, mask, STEPS)
        got = runner.generate(ids, mask, STEPS)
        assert got.shape == (len(prompts), STEPS)
        np.testing.assert_array_equal(got, want)
    assert len(runner.step_times) == STEPS
    assert_static_pair(tmp_path / "pair", runner.manifest)


def assert_static_pair(folder: Path, m) -> None:
    """Every decode graph static, without shape arithmetic, its cache written in place by an op ATC parses at its
    opset; the prefill's logits one row per sequence."""
    caches = {e.past for e in m.entries}
    for b, file in m.decode.items():
        model = onnx.load(str(folder / file), load_external_data=False)
        ops = collections.Counter(n.op_type for n in model.graph.node)
        assert not ops["Shape"] and not ops["Range"] and not ops["ConstantOfShape"], (file, ops)
        writes = [n for n in model.graph.node if n.op_type == "ScatterElements" and n.input[0] in caches]
        assert len(writes) == len(caches), file
        assert not [n for n in model.graph.node if n.op_type == "Concat" and set(n.input) & caches], file
        for vi in list(model.graph.input) + list(model.graph.output):
            dims = [d.dim_value for d in vi.type.tensor_type.shape.dim]
            assert dims and all(d > 0 for d in dims), (file, vi.name, vi.type.tensor_type.shape)
        assert [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim] == [b, 1, m.vocab]
        assert model.opset_import[0].version <= 18  # ScatterElements parses up to 18 in ATC
    prefill = onnx.load(str(folder / m.prefill), load_external_data=False)
    logits = next(o for o in prefill.graph.output if o.name == m.logits)
    assert [d.dim_value for d in logits.type.tensor_type.shape.dim][1:] == [1, m.vocab], logits
    producers = {o: n for n in prefill.graph.node for o in n.output}
    head = producers[m.logits]
    while head.op_type not in ("MatMul", "Gemm"):  # back through the row-wise ops after the lm_head
        head = producers[head.input[0]]
    reads = producers[head.input[0]]
    while reads.op_type in ("Reshape", "Cast"):  # the cann target's Gemm reads the row flattened
        reads = producers[reads.input[0]]
    assert reads.op_type == "Slice", f"the lm_head reads {reads.op_type}, not the last row"


def _cann_params() -> list:
    fast = {("llama", "torchscript"), ("gpt2", "torchscript")}
    return [pytest.param(*p.values, marks=[] if tuple(p.values) in fast else [pytest.mark.slow], id=p.id)
            for p in llm_params()]


@pytest.mark.parametrize("name,exporter", _cann_params())
def test_cann_pair_generates_the_original_tokens(tmp_path: Path, name: str, exporter: str) -> None:
    """The Ascend-lowered pair, run under k3opt's reference NPU ops: the same 32 tokens, batch 1 and 2."""
    from k3opt.api import reference_evaluator

    step = llm_decode_model(name, exporter)
    build_pair(step, tmp_path / "pair", max_seq=MAX_SEQ, max_batch=2, target="cann")
    runner = PairRunner(tmp_path / "pair", evaluator=reference_evaluator("cann"))
    graph_ops = [{n.op_type for n in onnx.load(str(tmp_path / "pair" / f), load_external_data=False).graph.node}
                 for f in (runner.manifest.prefill, runner.manifest.decode[2])]
    assert all("NPUPromptFlashAttention" in ops for ops in graph_ops) or name == "gpt2"
    if name in ("mixtral", "qwen2_moe", "deepseek_v3"):  # MoE routing lowered in both graphs (issue #28)
        assert all({"NPUMoeInitRouting", "NPUMoeFinalizeRouting"} <= ops for ops in graph_ops), graph_ops
        assert all(("NPUMoeGatingTopKSoftmax" in ops) == (name != "deepseek_v3") for ops in graph_ops)
    decode = onnx.load(str(tmp_path / "pair" / runner.manifest.decode[2]), load_external_data=False)
    producers = {o: n for n in decode.graph.node for o in n.output}
    for node in decode.graph.node:
        if node.op_type == "NPUPromptFlashAttention":  # the valid length: position + 1, for every batch
            assert len(node.input) == 7 and node.input[5] == ""
            assert producers[node.input[6]].op_type == "Add" and "position" in producers[node.input[6]].input
    for prompts in (_prompts()[:1], _prompts()):
        ids, mask = left_pad(prompts)
        np.testing.assert_array_equal(runner.generate(ids, mask, STEPS), original_greedy(step, ids, mask, STEPS))
    assert_static_pair(tmp_path / "pair", runner.manifest)


def test_original_loop_is_transformers_greedy_generate() -> None:
    """Batch 1 without padding: the export's own loop is transformers' greedy generate (the reference is right)."""
    import torch

    hf = llm_torch_model("llama")
    ids = np.array([_prompts()[0]], dtype=np.int64)
    with torch.no_grad():
        out = hf.generate(torch.from_numpy(ids), attention_mask=torch.ones_like(torch.from_numpy(ids)),
                          max_new_tokens=STEPS, do_sample=False, min_new_tokens=STEPS, pad_token_id=0)
    want = out[0, ids.shape[1]:].numpy()
    got = original_greedy(llm_decode_model("llama"), ids, np.ones_like(ids), STEPS)[0]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", ["llama", "gpt2", "deepseek_v3"])
def test_decode_graph_is_static_without_shape_arithmetic(tmp_path: Path, name: str) -> None:
    """Three batch sizes (1, 2 and 3: a size that is not a power of two); every family and exporter, and the
    cann pairs, are checked the same way by the token tests above."""
    m = build_pair(llm_decode_model(name), tmp_path / "pair", max_seq=32, max_batch=3)
    assert sorted(m.decode) == [1, 2, 3] and m.vocab == 100
    assert_static_pair(tmp_path / "pair", m)


def test_prefill_runs_the_lm_head_on_one_row(tmp_path: Path) -> None:
    m = build_pair(llm_decode_model("llama"), tmp_path / "pair", max_seq=16)
    model = onnx.load(str(tmp_path / "pair" / m.prefill), load_external_data=False)
    producers = {o: n for n in model.graph.node for o in n.output}
    head = producers[m.logits]
    assert head.op_type == "MatMul" and producers[head.input[0]].op_type == "Slice"
    ids, mask = left_pad(_prompts())
    logits = PairRunner(tmp_path / "pair").prefill.run(None, {"input_ids": ids, "attention_mask": mask})[0]
    assert logits.shape == (2, 1, 100)


def test_prefill_logits_equal_the_original_last_row() -> None:
    import onnxruntime as ort

    step = onnx.load(str(llm_decode_model("qwen2")))
    ids, mask = left_pad(_prompts())
    layout = recognise(step)
    feeds = {"input_ids": ids, "attention_mask": mask}
    full = dict(feeds, **{e.past: np.zeros((2, e.heads, 0, e.dim), np.float32) for e in layout.entries})
    want = ort.InferenceSession(step.SerializeToString()).run(None, full)
    got = ort.InferenceSession(prefill_graph(step).SerializeToString()).run(None, feeds)
    np.testing.assert_allclose(got[0], want[0][:, -1:], rtol=1e-5, atol=1e-5)
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def test_pair_shares_one_weights_file(tmp_path: Path) -> None:
    m = build_pair(llm_decode_model("llama"), tmp_path / "pair", max_seq=16, max_batch=2)
    folder = tmp_path / "pair"
    assert sorted(p.name for p in folder.iterdir()) == ["decode_b1.onnx", "decode_b2.onnx", "manifest.json",
                                                        "prefill.onnx", "weights.bin"]
    spans = collections.defaultdict(set)
    for file in [m.prefill, *m.decode.values()]:
        model = onnx.load(str(folder / file), load_external_data=False)
        for t in model.graph.initializer:
            info = {e.key: e.value for e in t.external_data}
            if info:
                assert info["location"] == "weights.bin"
                spans[file].add((info["offset"], info["length"]))
    assert spans[m.prefill] & spans[m.decode[1]] and spans[m.decode[1]] == spans[m.decode[2]]
    size = (folder / "weights.bin").stat().st_size
    assert size < 1.1 * sum(int(length) for _, length in spans[m.decode[1]])


def test_manifest_drives_the_pair(tmp_path: Path) -> None:
    build_pair(llm_decode_model("gpt2"), tmp_path / "pair", max_seq=64, max_batch=4)
    data = json.loads((tmp_path / "pair" / "manifest.json").read_text())
    assert data["format"] == "k3opt-llm-pair/1" and data["max_seq"] == 64 and data["vocab"] == 100
    assert sorted(data["decode"]) == ["1", "2", "4"]
    assert data["decode"]["2"]["inputs"]["past_key_values.0.key"] == [2, 4, 64, 8]
    assert data["decode"]["2"]["inputs"]["position"] == [1]
    assert data["prefill"]["gears"] == {"batch": [1, 2, 4], "sequence": [16, 32, 64]}
    assert len(data["prefill"]["dynamic_dims"]) == 9 and data["prefill"]["dynamic_dims"][0] == [1, 16, 1, 16]
    assert data["cache"]["entries"][0] == {"past": "past_key_values.0.key", "present": "present.0.key",
                                           "heads": 4, "dim": 8}


def test_generate_refuses_to_run_past_max_seq(tmp_path: Path) -> None:
    build_pair(llm_decode_model("llama"), tmp_path / "pair", max_seq=10)
    ids, mask = left_pad(_prompts()[:1])
    runner = PairRunner(tmp_path / "pair")
    assert runner.generate(ids, mask, 4).shape == (1, 4)  # 7 + 4 - 1 = 10 slots
    with pytest.raises(UsageError, match="--max-seq 10"):
        runner.generate(ids, mask, 5)
    with pytest.raises(InputError, match="--max-batch 1"):
        runner.generate(*left_pad(_prompts()), 2)


def test_max_seq_beyond_the_position_table_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"position table \(64 positions\)"):
        build_pair(llm_decode_model("gpt2"), tmp_path / "pair", max_seq=65)
    assert not (tmp_path / "pair").exists()


@pytest.mark.parametrize("source,message", [
    ("encoder", "no past key/value inputs"),
    ("no_cache", "no past key/value inputs"),
])
def test_models_without_a_kv_cache_are_refused(tmp_path: Path, source: str, message: str) -> None:
    path = zoo_model("bert") if source == "encoder" else zoo_model("llama")
    with pytest.raises(InputError, match=message):
        build_pair(path, tmp_path / "pair", max_seq=16)
    assert not list(tmp_path.iterdir())


def test_an_unrecognised_cache_layout_is_refused() -> None:
    step = onnx.load(str(llm_decode_model("llama")))
    for node in step.graph.node:  # the cache grows on the head axis: not a sequence-axis KV cache
        if node.op_type == "Concat" and "past_key_values.0.value" in node.input:
            node.attribute[0].i = 1
    with pytest.raises(InputError, match="past_key_values.0.value: cache layout not recognised"):
        recognise(step)


def test_a_failed_check_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import k3opt.llm.pair as pair

    def wrong(*args: object) -> None:
        raise VerificationError("tokens differ")

    monkeypatch.setattr(pair, "check_tokens", wrong)
    with pytest.raises(VerificationError):
        build_pair(llm_decode_model("llama"), tmp_path / "pair", max_seq=16)
    assert not list(tmp_path.iterdir())


def test_an_existing_output_folder_needs_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "pair"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(OutputError, match="--overwrite"):
        build_pair(llm_decode_model("llama"), out, max_seq=16)
    build_pair(llm_decode_model("llama"), out, max_seq=16, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "manifest.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["pair"]


def test_decode_graph_alone_matches_the_concat_step() -> None:
    """One decode step at position p over a cache holding p tokens: logits equal the Concat step's."""
    import onnxruntime as ort

    step = onnx.load(str(llm_decode_model("deepseek_v3")))
    layout = recognise(step)
    rng = np.random.default_rng(0)
    p, L = 6, 12
    past = {e.past: rng.standard_normal((2, e.heads, p, e.dim)).astype(np.float32) for e in layout.entries}
    mask = np.ones((2, p + 1), np.int64)
    mask[1, :2] = 0
    ids = np.array([[5], [9]], np.int64)
    want = ort.InferenceSession(step.SerializeToString()).run(None, {"input_ids": ids, "attention_mask": mask, **past})
    cache = {k: np.concatenate([v, rng.standard_normal((2, v.shape[1], L - p, v.shape[3])).astype(np.float32)], 2)
             for k, v in past.items()}
    full = np.concatenate([mask, np.ones((2, L - p - 1), np.int64)], 1)
    got = ort.InferenceSession(decode_graph(step, L, 2).SerializeToString()).run(
        None, {"input_ids": ids, "attention_mask": full, "position": np.array([p], np.int64), **cache})
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_allclose(g[:, :, :p + 1], w, rtol=1e-6, atol=1e-6)


def test_a_killed_run_leaves_no_temp_folder_behind_the_next(tmp_path: Path) -> None:
    """A SIGKILLed write leaves its ``.pair.*.tmp`` folder; the next write of the pair removes it."""
    dead = tmp_path / ".pair.x1y2.tmp"
    (dead / "pair").mkdir(parents=True)
    build_pair(llm_decode_model("llama"), tmp_path / "pair", max_seq=16)
    assert [p.name for p in tmp_path.iterdir()] == ["pair"]


@pytest.mark.parametrize("max_seq,max_batch", [(2, 1), (16, 1), (17, 3), (512, 4), (32768, 64), (1 << 20, 1000)])
def test_prefill_gears_stay_within_atcs_profile_limit(max_seq: int, max_batch: int) -> None:
    """ATC's --dynamic_dims takes 2..100 profiles: the longest prompt and the largest batch are always among them."""
    from k3opt.llm.manifest import MAX_PROFILES, prefill_gears

    gears = prefill_gears(max_seq, max_batch)
    profiles = len(gears["batch"]) * len(gears["sequence"])
    assert 2 <= profiles <= MAX_PROFILES == 100
    assert gears["sequence"][-1] == max_seq and gears["batch"][-1] == max_batch
    assert gears["sequence"] == sorted(set(gears["sequence"])) and gears["batch"] == sorted(set(gears["batch"]))
