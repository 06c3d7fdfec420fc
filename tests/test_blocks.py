"""Block-by-block verification (k3opt.blocks): layer boundaries, blocks, and the verification of an optimize
run whose model is over --verify-memory (forced here on small 4-layer exports with a tiny budget)."""
from __future__ import annotations

import itertools
import random

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

import k3opt
from k3opt.blocks import plan
from k3opt.blocks.run_hook import parse_size
from k3opt.blocks.session import block_model, run_block, value_types
from k3opt.blocks.structure import NoLayers, find_boundaries, find_stack, partition
from k3opt.cli import main
from k3opt.errors import UsageError, VerificationError
from k3opt.pipeline import pass_base as base
from k3opt.pipeline import verify as verifier
from k3opt.report import Report

from .split_models import DECODE_NAMES, LAYERS, NAMES, split_inputs, split_model
from .zoo import needs_torch

#: Over 1/3 of it, a model is verified block by block; a block group's weights stay under half of it.
SMALL_BUDGET = 120_000
CASES = [pytest.param(n, False, id=f"{n}-prefill") for n in NAMES] + \
        [pytest.param(n, True, id=f"{n}-decode") for n in DECODE_NAMES]


@needs_torch
@pytest.mark.parametrize("name,decode", CASES)
def test_boundaries_are_the_residual_stream_between_layers(name, decode):
    model = onnx.load(split_model(name, decode))
    boundaries = find_boundaries(model.graph)
    assert len(boundaries) == LAYERS + 1  # the embeddings' output, then each layer's
    blocks = partition(model.graph, boundaries)
    assert len(blocks) == LAYERS + 2
    owned = sorted(i for b in blocks for i in b.nodes)
    assert owned == list(range(len(model.graph.node)))  # every node in exactly one block
    for b in blocks:  # copies are side computations only: from the graph inputs and small constants
        copied = {y for i in b.copied for y in model.graph.node[i].output}
        assert not copied & set(boundaries) and not any(x.startswith("past") for x in b.inputs if x in copied)
    for k, b in enumerate(blocks[1:-1]):
        assert boundaries[k] in b.inputs and boundaries[k + 1] in b.outputs
        if decode:  # a layer's cache is its block's (GPT-2 reads layer 0's past keys for the positions too)
            assert [x for x in b.outputs if x.startswith("present.")] == [f"present.{k}.key", f"present.{k}.value"]
            if k:
                assert [x for x in b.inputs if x.startswith("past_")] == [f"past_key_values.{k}.{p}"
                                                                         for p in ("key", "value")]
    # the blocks chained in onnxruntime are the whole model
    feeds = split_inputs(name, decode)
    env = dict(feeds)
    types = value_types(model)
    for b in blocks:
        env.update(run_block(block_model(model, b, types), env))
    whole = verifier.run(verifier.session(model), feeds)
    for out, want in zip(model.graph.output, whole):
        np.testing.assert_array_equal(env[out.name], want)


def test_no_layer_structure_is_refused_saying_what_was_looked_for():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    with pytest.raises(NoLayers, match="residual stream"):
        find_boundaries(g)


def test_plan_groups_under_a_limit_and_balances_exactly():
    assert plan.group_under([5, 3, 3, 6, 1], 7) == [range(0, 1), range(1, 3), range(3, 5)]
    with pytest.raises(plan.TooLarge):
        plan.group_under([5, 9], 7)
    sizes = [262] + [190] * 16 + [262]
    stages = plan.balanced(sizes, 4)
    assert [r.start for r in stages] == [0, 4, 9, 14]
    assert max(sum(sizes[i] for i in r) for r in stages) == 950  # no cut at these boundaries does better
    with pytest.raises(ValueError):
        plan.balanced([1, 2], 3)


def _best_by_enumeration(sizes, parts, within, extra):
    """The cut plan.balanced promises, found by trying every cut."""
    cuts = []
    for starts in itertools.combinations(range(1, len(sizes)), parts - 1):
        bounds = [0, *starts, len(sizes)]
        totals = [sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:])]
        cuts.append((totals, sum(extra[j - 1] for j in starts)))
    fits = [(t, c) for t, c in cuts if within is not None and max(t) <= within * min(t)]
    if fits:  # fewest costly cuts within the ratio, then the smallest largest part, then the largest smallest
        return min((c, max(t), -min(t)) for t, c in fits)
    return min((max(t) / min(t), c) for t, c in cuts)  # else the most even, fewest costly cuts among those


def test_plan_balanced_equals_trying_every_cut():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(2, 9)
        parts = rng.randint(1, min(n, 4))
        sizes = [rng.randint(1, 20) for _ in range(n)]
        extra = [rng.choice((0, 0, 1)) for _ in range(n - 1)]
        within = rng.choice((None, 1.1, 1.3, 2.0))
        ranges = plan.balanced(sizes, parts, within=within, extra=extra)
        assert [r.start for r in ranges][0] == 0 and ranges[-1].stop == n
        assert all(a.stop == b.start and len(a) for a, b in zip(ranges, ranges[1:]))
        totals = [sum(sizes[i] for i in r) for r in ranges]
        cost = sum(extra[r.start - 1] for r in ranges[1:])
        want = _best_by_enumeration(sizes, parts, within, extra)
        got = (cost, max(totals), -min(totals)) if len(want) == 3 else (max(totals) / min(totals), cost)
        assert got == want, (sizes, parts, within, extra)


def test_plan_prefers_layer_boundaries_among_equal_cuts():
    # units: a layer's attention (1) and MLP (3) halves; a cut between halves (rank 1) ties with the layer cut
    sizes, rank = [1, 3, 1, 3], [1, 0, 1]
    assert [r.start for r in plan.balanced([2, 2, 2, 2], 2, rank=[1, 0, 1])] == [0, 2]
    assert [r.start for r in plan.balanced(sizes, 2, within=1.1, rank=rank)] == [0, 2]


@needs_torch
@pytest.mark.parametrize("name,decode", CASES)
def test_every_cut_point_is_a_boundary_the_blocks_chain_through(name, decode):
    """Layer boundaries, the stream between a layer's attention and MLP, and the activations inside them that a
    cut hands on with the stream: the model cut at all of them at once runs equal to the whole."""
    model = onnx.load(split_model(name, decode))
    stack = find_stack(model.graph, inner=True)
    assert stack.boundaries == find_boundaries(model.graph)
    for layer in range(1, LAYERS):
        kinds = [(p.kind, p.part) for p in stack.points if p.layer == layer]
        assert kinds[0] == ("layer", "") and ("sublayer", "attention") in kinds
        assert ("inner", "attention") in kinds  # the attention's output before its projection
        if name != "deepseek_v3" or layer == 0:  # a SwiGLU / GELU MLP; DeepSeek's MoE has none
            assert kinds[-1] == ("inner", "mlp")
    cuts = [stack.boundaries[0]] + [p.tensor for p in stack.points] + [stack.boundaries[-1]]
    blocks = partition(model.graph, cuts)
    feeds = split_inputs(name, decode)
    env = dict(feeds)
    types = value_types(model)
    ends = [None] + [(p.kind, p.part) for p in stack.points] + [None, None]  # what block k ends at
    for k, b in enumerate(blocks):
        env.update(run_block(block_model(model, b, types), env))
        if decode:  # a layer's cache stays with its attention's core
            presents = [x for x in b.outputs if x.startswith("present")]
            assert len(presents) == (2 if ends[k] == ("inner", "attention") else 0)
    whole = verifier.run(verifier.session(model), feeds)
    for out, want in zip(model.graph.output, whole):
        np.testing.assert_array_equal(env[out.name], want)


def test_parse_size():
    assert parse_size("4GB") == 4 << 30 and parse_size("512MB") == 512 << 20 and parse_size("1000") == 1000
    assert parse_size("1.5g") == 3 << 29
    with pytest.raises(UsageError, match="--verify-memory"):
        parse_size("lots")


@needs_torch
@pytest.mark.parametrize("name,decode", CASES)
def test_an_optimize_run_over_the_budget_is_verified_block_by_block(name, decode, tmp_path):
    report = k3opt.optimize_file(split_model(name, decode), tmp_path / "out.onnx", verify=True,
                                 verify_memory=SMALL_BUDGET)
    v = report.verification
    assert v["status"] == "passed" and v["mode"] == "block-wise", v
    assert len(v["blocks"]) >= 3 and all(b["status"] == "passed" for b in v["blocks"])
    assert all(b["weight_bytes"] <= SMALL_BUDGET // 2 for b in v["blocks"])
    assert [o["name"] for o in v["outputs"]] == [o.name for o in onnx.load(split_model(name, decode)).graph.output]
    assert any(n.startswith("verified block by block") for n in report.notes)


@needs_torch
def test_a_model_under_the_budget_keeps_the_whole_model_check(tmp_path):
    report = k3opt.optimize_file(split_model("llama"), tmp_path / "out.onnx", verify=True)
    assert report.verification["status"] == "passed" and "mode" not in report.verification


@needs_torch
def test_a_block_over_the_budget_keeps_the_skip_with_a_warning_naming_the_option(tmp_path):
    report = k3opt.optimize_file(split_model("llama"), tmp_path / "out.onnx", verify=True, verify_memory=20_000)
    assert report.verification["status"] == "skipped"
    assert len(report.warnings) == 1 and "--verify-memory" in report.warnings[0]
    assert (tmp_path / "out.onnx").exists()  # as before: written, with the warning


class BreakLayerTwo(base.Pass):
    """A hand-broken pass: scales one weight of layer 2's MLP (once)."""

    name = "t-break-layer-two"

    def run(self, graph, ctx):
        for node in graph.nodes:
            if node.name.endswith("layers.2/mlp/down_proj/MatMul"):
                weight = node.inputs[1]
                weight.values = np.asarray(weight.values) * np.float32(1.5)
                node.name += "_broken"
                return 1
        return 0


@needs_torch
def test_a_hand_broken_pass_is_caught_and_the_report_names_the_block_and_pass(tmp_path):
    out = tmp_path / "out.onnx"
    report = Report()
    with pytest.raises(VerificationError, match=r"block 2 \(layer 2; .*first diverging pass: t-break-layer-two"):
        k3opt.optimize_file(split_model("llama"), out, verify=True, verify_memory=SMALL_BUDGET,
                            plugins=[BreakLayerTwo], report=report)
    v = report.verification
    assert v["first_diverging_block"] == 2 and v["first_diverging_pass"] == "t-break-layer-two"
    assert [b["status"] for b in v["blocks"]] == ["passed", "passed", "failed"]
    assert [b["covers"] for b in v["blocks"]] == ["embeddings, layer 0", "layer 1", "layer 2"]
    assert not out.exists()


@needs_torch
def test_a_lowering_over_the_budget_is_verified_block_by_block_under_the_reference_ops(tmp_path, monkeypatch):
    """--target cann on a model over --verify-memory: the lowered model is compared block by block, its blocks
    run by k3opt's reference NPU ops (before, the lowering of a block-verified run went unverified); a lowering
    that changes layer 2's numbers is caught and named."""
    from k3opt.targets.cann.passes.lower_rmsnorm_npu import LowerRMSNormNPU

    report = k3opt.optimize_file(split_model("llama"), tmp_path / "a.onnx", target="cann", verify=True,
                                 verify_memory=SMALL_BUDGET)
    lv = report.lowering_verification
    assert report.verification["mode"] == "block-wise" and lv["status"] == "passed" and lv["mode"] == "block-wise"
    assert len(lv["blocks"]) >= 3 and any(n.startswith("lowering verified (reference evaluator) block by block")
                                          for n in report.notes)
    lower = LowerRMSNormNPU._rewrite

    def broken(self, op, nm):
        y = lower(self, op, nm)
        return op.Mul(y, op.const(np.array(1.5, np.float32))) if y is not None and "layers.2/" in nm.reduce.name \
            else y

    monkeypatch.setattr(LowerRMSNormNPU, "_rewrite", broken)
    with pytest.raises(VerificationError, match=r"reference evaluator, block by block: block 2 \(layer 2"):
        k3opt.optimize_file(split_model("llama"), tmp_path / "b.onnx", target="cann", verify=True,
                            verify_memory=SMALL_BUDGET)
    assert not (tmp_path / "b.onnx").exists()


@needs_torch
def test_cli_verify_memory(tmp_path):
    out = tmp_path / "out.onnx"
    result = CliRunner().invoke(main, ["optimize", str(split_model("qwen2")), "-o", str(out),
                                       "--verify-memory", "120KB"])
    assert result.exit_code == 0, result.output
    assert "verified block by block" in result.output
    bad = CliRunner().invoke(main, ["optimize", str(split_model("qwen2")), "-o", str(out), "--overwrite",
                                    "--verify-memory", "lots"])
    assert bad.exit_code == 2 and "--verify-memory" in bad.output


@needs_torch
def test_external_data_weights_are_streamed_per_block(tmp_path):
    from k3opt import modelio

    src = tmp_path / "ext.onnx"
    modelio.save(modelio.read_model(split_model("llama", True)).model, src, external_data=True)
    report = k3opt.optimize_file(src, tmp_path / "out.onnx", verify=True, verify_memory=100_000)
    v = report.verification
    assert v["status"] == "passed" and [b["covers"] for b in v["blocks"]] == \
        ["embeddings", "layer 0", "layer 1", "layer 2", "layer 3", "head"]
