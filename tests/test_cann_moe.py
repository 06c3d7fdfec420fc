"""lower-moe-npu: transformers' batched_mm MoE blocks -> Ascend's MoE routing ops, verified under the reference ops.

Every lowered model is verified by the pipeline itself (``verify=True``): onnxruntime runs the original, onnx's
reference evaluator with k3opt's NPU reference ops (k3opt/targets/cann/reference/moe_ops.py) the lowered one.
"""
from __future__ import annotations

import html

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T, helper

import k3opt
from k3opt.cann_bridge import check_model, invariant_violations
from k3opt.targets.cann.reference.moe_ops import (MoeReferenceError, finalize_routing, gating_top_k_softmax,
                                             init_routing)
from k3opt.targets.cann.passes.lower_moe_npu import LowerMoeNPU
from k3opt.report import Report
from tests.helpers import make_model, op_counts
from tests.moe_models import (EXPORTERS, moe_config, moe_decode_inputs, moe_decode_model, moe_inputs, moe_model,
                              moe_torch_model, traced_eager_model)

TOKENS, HIDDEN, EXPERTS, K, INTER = 6, 8, 4, 2, 12
_ROUTING = ("NPUMoeGatingTopKSoftmax", "NPUMoeInitRouting", "NPUMoeFinalizeRouting")


def lowered(model, feeds=None):
    """``--target cann`` with verification; the lowered model passes the invariants and the pre-flight check."""
    report = Report()
    out = k3opt.optimize(model, target="cann", verify=True, report=report, input_data=feeds)
    assert report.verification["status"] == "passed"
    assert report.lowering_verification["status"] == "passed", report.lowering_verification
    assert invariant_violations(out) == []
    assert [str(f) for f in check_model(out) if f.kind != "dynamic"] == []  # every node has an ATC parser
    return out, report


def moe_lines(report):
    return [line for line in report.lowering if "MoE" in line]


# ----------------------------------------------------------------------------- tiny transformers models

def _cases():
    return [pytest.param(n, e, id=f"{n}-{e}", marks=[pytest.mark.slow] if e == "dynamo" else [])
            for n in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3") for e in EXPORTERS]


def moe_layers(name: str) -> int:
    c = moe_config(name)
    return c.num_hidden_layers - getattr(c, "first_k_dense_replace", 0)


@pytest.mark.parametrize("name, exporter", _cases())
def test_every_moe_block_is_lowered_and_equal_under_the_reference_ops(name, exporter):
    """One InitRouting and one FinalizeRouting per MoE block; one GatingTopKSoftmax per softmax-gated block
    (DeepSeek-V3's group-limited sigmoid gate stays decomposed: no ONNX parser for MoeGatingTopK)."""
    out, report = lowered(str(moe_model(name, exporter)), moe_inputs(name))
    blocks = moe_layers(name)
    counts = op_counts(out)
    softmax_gated = name != "deepseek_v3"
    assert counts.get("NPUMoeGatingTopKSoftmax", 0) == (blocks if softmax_gated else 0), moe_lines(report)
    assert counts.get("NPUMoeInitRouting", 0) == counts.get("NPUMoeFinalizeRouting", 0) == blocks
    assert ("TopK" in counts) == (not softmax_gated)
    lines = moe_lines(report)
    assert lines[0] == f"NPU MoE routing: {blocks} of {blocks} MoE block(s) lowered {LowerMoeNPU.remark}"
    assert len(lines) == 1 + blocks and all("-> NPUMoeFinalizeRouting" in line for line in lines[1:])
    if name == "deepseek_v3":
        assert all("gate kept decomposed: MoeGatingTopK (group-limited sigmoid gate) has no ONNX parser" in line
                   for line in lines[1:])
    # Finalize takes the shared expert's Add (Qwen2-MoE's gated one, DeepSeek-V3's) and the residual Add
    adds = {"mixtral": 1, "qwen2_moe": 2, "qwen3_moe": 1, "deepseek_v3": 2}[name]
    assert all(f"weighted combine + the following {adds} Add(s)" in line for line in lines[1:]), lines
    if name in ("mixtral", "qwen3_moe"):
        assert all("softmax top-2 renormalised" in line for line in lines[1:])


@pytest.mark.parametrize("name, exporter", _cases())
def test_the_export_switches_to_batched_mm_and_equals_torch(name, exporter):
    """`k3opt export` of an MoE model with transformers' default experts (tests/moe_models.py) writes the batched_mm
    form (every expert table gathered per row, no eager loop; the setting put back: test_export_transformers), and
    the export gives torch's logits, at a second batch and length too: every expert kept, whatever the example
    routed."""
    import onnxruntime as ort
    import torch

    path = moe_model(name, exporter)
    model = onnx.load(str(path))
    experts = {t.name for t in model.graph.initializer if len(t.dims) == 3 and t.dims[0] == _experts(name)}
    experts |= {n.output[0] for n in model.graph.node if n.op_type == "Transpose" and n.input[0] in experts}
    gathers = [n for n in model.graph.node if n.op_type in ("Gather", "GatherND") and n.input[0] in experts]
    assert len(gathers) == 2 * moe_layers(name), gathers  # gate_up and down tables (dynamo: transposed) per row
    assert "NonZero" not in op_counts(model)  # not the eager loop (test_a_traced_eager_experts_loop...)
    hf = moe_torch_model(name)
    hf.config._experts_implementation = "batched_mm"  # the same maths, runnable in eager torch here
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for feeds in (moe_inputs(name), moe_inputs(name, batch=3, seq=5, seed=1)):
        with torch.no_grad():
            want = hf(**{k: torch.from_numpy(v) for k, v in feeds.items()}).logits.numpy()
        np.testing.assert_allclose(session.run(None, feeds)[0], want, rtol=1e-4, atol=1e-4)


def _experts(name):
    c = moe_config(name)
    return next(getattr(c, k) for k in ("num_local_experts", "num_experts", "n_routed_experts") if hasattr(c, k))


def test_the_json_and_html_reports_say_per_block_and_per_mla_layer_what_was_lowered():
    from k3opt.report_html import render

    _, report = lowered(str(moe_model("deepseek_v3", "torchscript")), moe_inputs("deepseek_v3"))
    data, page = report.as_dict(), render(report)
    for line in [*moe_lines(report)[1:], *(x for x in report.lowering if "MLA: q/k dim 12, v dim 8 padded" in x)]:
        assert line in data["lowering"] and f'data-lowering="{html.escape(line, quote=True)}"' in page
    assert sum("MLA" in x for x in data["lowering"]) == 2 and sum("MoE block at" in x for x in data["lowering"]) == 1


@pytest.mark.parametrize("name, exporter", [pytest.param(n, e, id=f"{n}-{e}",
                                                         marks=[pytest.mark.slow] if e == "dynamo" else [])
                                            for n in ("mixtral", "qwen2_moe", "deepseek_v3") for e in EXPORTERS])
def test_decode_steps_lower_attention_and_moe_and_stay_equal(name, exporter):
    """One token after a cache of 6: the MoE routing of a one-token-per-row step, and (DeepSeek-V3) MLA."""
    out, report = lowered(str(moe_decode_model(name, exporter)), moe_decode_inputs(name))
    counts = op_counts(out)
    assert counts.get("NPUMoeFinalizeRouting", 0) == moe_layers(name), moe_lines(report)
    assert counts.get("NPUPromptFlashAttention", 0) == moe_config(name).num_hidden_layers, report.lowering


@pytest.mark.parametrize("name, exporter", _cases())
@pytest.mark.parametrize("opset", [None, 23])
def test_default_target_and_opset_23_stay_equal_with_fewer_nodes(name, exporter, opset):
    path = str(moe_model(name, exporter))
    report = Report()
    out = k3opt.optimize(path, opset=opset, verify=True, input_data=moe_inputs(name), report=report)
    assert report.verification["status"] == "passed"
    assert len(out.graph.node) < len(onnx.load(path).graph.node)


def test_a_moe_export_compiles_with_the_stand_in_atc(tmp_path):
    """`k3opt compile` end to end: the MoE ops pass the pre-flight check and the stand-in's argument grammar."""
    from k3opt.cann_bridge import AtcOptions, compile_model
    from tests.fake_atc import write_fake_atc

    atc = write_fake_atc(tmp_path / "bin")
    opts = AtcOptions(soc_version="Ascend910B3", input_shapes=("input_ids:1,8", "attention_mask:1,8"))
    res = compile_model(str(moe_model("qwen2_moe", "torchscript")), tmp_path / "out" / "qwen2_moe", opts, atc=str(atc))
    written = onnx.load(str(res.onnx_path), load_external_data=False)
    assert res.om_path.is_file() and check_model(written) == []
    assert all(op_counts(written).get(op) == 2 for op in _ROUTING)


def test_the_default_target_keeps_the_moe_blocks():
    out = k3opt.optimize(str(moe_model("mixtral", "torchscript")))
    assert not any(op in op_counts(out) for op in _ROUTING) and op_counts(out)["TopK"] == 2


# ----------------------------------------------------------------------------- hand-made blocks

def moe_block(gate="softmax", renorm=True, escape=False, cross_rows=False, weights_input=False, dtype=T.FLOAT,
              bias_add=False, moe_output=False, tied=False, smallest=False):
    """A batched_mm MoE block as transformers exports it, on (T, H) tokens, plus the residual Add. ``tied``: the
    router's columns of experts 0, 1 and 2 are equal, so every token's scores tie three ways."""
    rng = np.random.default_rng(0)
    np_t = helper.tensor_dtype_to_np_dtype(dtype)
    router = rng.standard_normal((HIDDEN, EXPERTS)).astype(np_t)
    if tied:
        router[:, 1] = router[:, 2] = router[:, 0]
    inits = {"wr": router,
             "wg": rng.standard_normal((EXPERTS, INTER, HIDDEN)).astype(np_t),
             "wd": rng.standard_normal((EXPERTS, HIDDEN, INTER)).astype(np_t),
             "k": np.array([K], np.int64), "last": np.array([-1], np.int64), "one": np.array([1], np.int64),
             "two": np.array([2], np.int64), "rep": np.array([1, K, 1], np.int64),
             "slots": np.array([-1, K, HIDDEN], np.int64)}
    nodes = [helper.make_node("MatMul", ["x", "wr"], ["logits"]),
             helper.make_node("Softmax" if gate == "softmax" else "Sigmoid", ["logits"], ["probs"], **(
                 {"axis": -1} if gate == "softmax" else {})),
             helper.make_node("TopK", ["probs", "k"], ["vals", "idx"], axis=-1, **({"largest": 0} if smallest else {}))]
    w = "vals"
    if renorm:
        nodes += [helper.make_node("ReduceSum", ["vals", "last"], ["vsum"], keepdims=1),
                  helper.make_node("Div", ["vals", "vsum"], ["wn"])]
        w = "wn"
    inputs = [("x", dtype, [TOKENS, HIDDEN])]
    if weights_input:
        inputs.append(("w_in", dtype, [TOKENS, K]))
        w = "w_in"
    nodes += [helper.make_node("Unsqueeze", ["x", "one"], ["xu"]),
              helper.make_node("Tile", ["xu", "rep"], ["xt"]),
              helper.make_node("Flatten", ["xt"], ["rows"], axis=2),
              helper.make_node("Reshape", ["idx", "last"], ["e"]),
              helper.make_node("Gather", ["wg", "e"], ["gw"], axis=0),
              helper.make_node("Unsqueeze", ["rows", "last"], ["rc"]),
              helper.make_node("MatMul", ["gw", "rc"], ["h3"]),
              helper.make_node("Squeeze", ["h3", "two"], ["h"]),
              helper.make_node("Relu", ["h"], ["a"])]
    a = "a"
    if cross_rows:  # each row reads the mean of all rows: not row-wise
        nodes += [helper.make_node("ReduceMean", ["a"], ["am"], axes=[0], keepdims=1),
                  helper.make_node("Add", ["a", "am"], ["ax"])]
        a = "ax"
    nodes += [helper.make_node("Gather", ["wd", "e"], ["dw"], axis=0),
              helper.make_node("Unsqueeze", [a, "last"], ["ac"]),
              helper.make_node("MatMul", ["dw", "ac"], ["y3"]),
              helper.make_node("Squeeze", ["y3", "two"], ["y"]),
              helper.make_node("Reshape", [w, "last"], ["wf"]),
              helper.make_node("Unsqueeze", ["wf", "last"], ["wc"]),
              helper.make_node("Mul", ["y", "wc"], ["yw"]),
              helper.make_node("Reshape", ["yw", "slots"], ["ys"]),
              helper.make_node("ReduceSum", ["ys", "one"], ["moe"], keepdims=0, name="combine"),
              helper.make_node("Add", ["x", "moe"], ["out"])]
    if bias_add:  # a broadcast Add: (1, H) against (T, H), not a skip Finalize can take
        inits["bias"] = rng.standard_normal((1, HIDDEN)).astype(np_t)
        nodes[-1] = helper.make_node("Add", ["moe", "bias"], ["out"])
    outputs = [("out", dtype, [TOKENS, HIDDEN])] + ([("h", dtype, [TOKENS * K, INTER])] if escape else []) + \
        ([("moe", dtype, [TOKENS, HIDDEN])] if moe_output else [])
    return make_model(nodes, inputs, outputs, inits)


def feeds(model):
    rng = np.random.default_rng(1)
    return {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(
        helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)) for i in model.graph.input}


def test_finalize_takes_a_same_shape_add_but_not_a_broadcast_one():
    m = moe_block()
    _, report = lowered(m, feeds(m))
    assert "weighted combine + the following 1 Add(s)" in moe_lines(report)[1]
    for variant in ({"bias_add": True}, {"moe_output": True}):  # a broadcast; a sum that is a graph output too
        m = moe_block(**variant)
        out, report = lowered(m, feeds(m))
        assert "weighted combine -> NPUMoeFinalizeRouting" in moe_lines(report)[1] and op_counts(out)["Add"] == 1


@pytest.mark.parametrize("renorm", [True, False])
def test_a_softmax_gated_block_becomes_the_three_moe_ops(renorm):
    m = moe_block(renorm=renorm)
    out, report = lowered(m, feeds(m))
    assert all(op_counts(out).get(op) == 1 for op in _ROUTING)
    gate = next(n for n in out.graph.node if n.op_type == "NPUMoeGatingTopKSoftmax")
    init = next(n for n in out.graph.node if n.op_type == "NPUMoeInitRouting")
    assert {a.name: helper.get_attribute_value(a) for a in gate.attribute} == {"k": K}
    assert {a.name: helper.get_attribute_value(a) for a in init.attribute} == {"active_num": TOKENS}
    assert "Softmax" not in op_counts(out) and "TopK" not in op_counts(out)
    assert ("renormalised" in moe_lines(report)[1]) == renorm


def test_tied_router_scores_pick_the_experts_onnx_topk_picks():
    """Three experts tie on every token: ONNX TopK takes the lower indices first, and so must the gating op's
    reference (docs/cann.md, "Ties"); a different choice routes tokens to other experts and fails verification."""
    m = moe_block(tied=True)
    x = feeds(m)["x"]
    probs = np.exp(x @ _initializer(m, "wr"))
    assert np.all(probs[:, 0] == probs[:, 1]) and np.all(probs[:, 1] == probs[:, 2])
    out, _ = lowered(m, {"x": x})
    assert op_counts(out).get("NPUMoeGatingTopKSoftmax") == 1


def _initializer(model, name):
    return next(onnx.numpy_helper.to_array(t) for t in model.graph.initializer if t.name == name)


def test_float16_block_is_lowered_and_verified():
    m = moe_block(dtype=T.FLOAT16)
    out, _ = lowered(m, feeds(m))
    assert op_counts(out).get("NPUMoeFinalizeRouting") == 1


def test_a_gate_that_is_not_a_softmax_keeps_its_topk_but_the_routing_is_lowered():
    m = moe_block(gate="sigmoid")
    out, report = lowered(m, feeds(m))
    counts = op_counts(out)
    assert "NPUMoeGatingTopKSoftmax" not in counts and counts["TopK"] == 1
    assert counts["NPUMoeInitRouting"] == counts["NPUMoeFinalizeRouting"] == 1
    assert "gate kept decomposed: not a softmax gate (top-k of Sigmoid, not of a softmax)" in moe_lines(report)[1]


@pytest.mark.parametrize("variant, why", [
    ({"cross_rows": True}, "does not work row by row"),
    ({"escape": True}, "in the experts is read outside them"),
    ({"weights_input": True}, "the combine weights do not come from the router's TopK"),
    ({"smallest": True}, "the router's TopK takes the smallest scores"),
])
def test_refusals_keep_the_block_as_it_was_with_the_reason(variant, why):
    m = moe_block(**variant)
    report = Report()
    out = k3opt.optimize(m, target="cann", report=report)
    assert not any(op in op_counts(out) for op in _ROUTING)
    lines = moe_lines(report)
    assert lines[0] == f"NPU MoE routing: 0 of 1 MoE block(s) lowered {LowerMoeNPU.remark}"
    assert why in lines[1] and "kept decomposed" in lines[1], lines
    assert op_counts(out) == op_counts(k3opt.optimize(m, target="cann", skip=["lower-moe-npu"]))


def unrolled_block():
    """All experts on every token, each masked by its column of ScatterElements(zeros, top-k idx, weights)."""
    rng = np.random.default_rng(0)
    inits = {"wr": rng.standard_normal((HIDDEN, EXPERTS)).astype(np.float32), "k": np.array([K], np.int64),
             "zeros": np.zeros((TOKENS, EXPERTS), np.float32)}
    nodes = [helper.make_node("MatMul", ["x", "wr"], ["logits"]),
             helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
             helper.make_node("TopK", ["probs", "k"], ["vals", "idx"], axis=-1),
             helper.make_node("ScatterElements", ["zeros", "idx", "vals"], ["dense"], axis=1, name="dense_routing")]
    total = None
    for e in range(EXPERTS):
        inits[f"w{e}"] = rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32)
        inits[f"s{e}"], inits[f"e{e}"] = np.array([e], np.int64), np.array([e + 1], np.int64)
        inits["ax1"] = np.array([1], np.int64)
        nodes += [helper.make_node("Slice", ["dense", f"s{e}", f"e{e}", "ax1"], [f"col{e}"]),
                  helper.make_node("MatMul", ["x", f"w{e}"], [f"h{e}"]),
                  helper.make_node("Mul", [f"h{e}", f"col{e}"], [f"m{e}"])]
        if total is None:
            total = f"m{e}"
        else:
            nodes.append(helper.make_node("Add", [total, f"m{e}"], [f"sum{e}"]))
            total = f"sum{e}"
    nodes.append(helper.make_node("Identity", [total], ["out"]))
    return make_model(nodes, [("x", T.FLOAT, [TOKENS, HIDDEN])], [("out", T.FLOAT, [TOKENS, HIDDEN])], inits)


def test_the_unrolled_all_experts_form_is_recognised_and_stays_with_the_reason():
    """Refused: the block keeps every node it had (the lowering adds and removes nothing), and the reason is the
    block's line in the text, JSON and HTML reports."""
    from k3opt.report_html import render

    m = unrolled_block()
    out, report = lowered(m, feeds(m))
    without = k3opt.optimize(m, target="cann", skip=["lower-moe-npu"])
    assert op_counts(out) == op_counts(without) and not any(op in op_counts(out) for op in _ROUTING)
    assert op_counts(out)["ScatterElements"] == 1
    lines = moe_lines(report)
    assert lines[0].startswith("NPU MoE routing: 0 of 1 MoE block(s) lowered")
    why = "all 4 experts computed on every token and masked by a dense routing matrix"
    assert lines[1].startswith("MoE block at 'dense_routing' kept decomposed: ") and why in lines[1], lines
    data, page = report.as_dict(), render(report)
    assert lines[1] in data["lowering"] and f'data-lowering="{html.escape(lines[1], quote=True)}"' in page


# ----------------------------------------------------------------------------- reference ops

def test_gating_reference_follows_the_documented_formula():
    x = np.array([[0.1, 1.1, 2.1, 3.1], [4.1, 5.1, 6.1, 7.1], [8.1, 9.1, 10.1, 11.1]], np.float32)
    y, idx, rows = gating_top_k_softmax(x, 2)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    assert idx.tolist() == [[3, 2]] * 3 and idx.dtype == np.int32
    np.testing.assert_allclose(y, p[:, [3, 2]], rtol=1e-6)
    assert rows.tolist() == [[0, 3], [1, 4], [2, 5]]  # [MGS-doc]: arange(N*k).reshape(k, N).T
    with pytest.raises(MoeReferenceError, match="k = 5"):
        gating_top_k_softmax(x, 5)


def test_gating_reference_breaks_ties_as_onnx_topk():
    """Equal scores: the reference op's experts and their order are onnxruntime's TopK(Softmax(x)) ones."""
    import onnxruntime as ort

    x = np.array([[1, 1, 1, 0], [2, 0, 2, 2], [0, 3, 3, 0], [5, 5, 5, 5]], np.float32)
    graph = helper.make_graph([helper.make_node("Softmax", ["x"], ["p"], axis=-1),
                               helper.make_node("TopK", ["p", "k"], ["v", "i"], axis=-1)], "g",
                              [helper.make_tensor_value_info("x", T.FLOAT, [4, 4])],
                              [helper.make_tensor_value_info("v", T.FLOAT, [4, 3]),
                               helper.make_tensor_value_info("i", T.INT64, [4, 3])],
                              [onnx.numpy_helper.from_array(np.array([3], np.int64), "k")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    want_v, want_i = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})
    y, idx, _ = gating_top_k_softmax(x, 3)
    assert idx.tolist() == want_i.tolist() == [[0, 1, 2], [0, 2, 3], [1, 2, 0], [0, 1, 2]]
    np.testing.assert_allclose(y, want_v, rtol=1e-6)


def test_init_routing_reference_on_the_documented_example():
    """[MIR-doc]'s example: x (3, 4), expert_idx [[1, 2], [0, 1], [0, 2]], row_idx [[0, 3], [1, 4], [2, 5]]."""
    x = np.array([[0.1] * 4, [0.2] * 4, [0.3] * 4], np.float32)
    expert = np.array([[1, 2], [0, 1], [0, 2]], np.int32)
    row = np.array([[0, 3], [1, 4], [2, 5]], np.int32)
    ex, erow, eexp = init_routing(x, row, expert, 3)
    assert eexp.tolist() == [0, 0, 1, 1, 2, 2]
    sorted_rows = [1, 2, 0, 4, 3, 5]  # row_idx of the flattened positions, stably sorted by expert
    assert [int(np.where(erow == i)[0][0]) for i in range(6)] == sorted_rows
    np.testing.assert_array_equal(ex, x[np.array(sorted_rows) % 3])


def test_finalize_routing_reference_undoes_the_permutation():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3)).astype(np.float32)
    y, expert, row = gating_top_k_softmax(rng.standard_normal((5, 4)).astype(np.float32), 2)
    ex, erow, _ = init_routing(x, row, expert, 5)
    bias = rng.standard_normal((4, 3)).astype(np.float32)
    out = finalize_routing(ex * 2, x, None, bias, y, erow, expert)  # "experts" that double their rows
    want = x + sum(y[:, j:j + 1] * (2 * x + bias[expert[:, j]]) for j in range(2))
    np.testing.assert_allclose(out, want, rtol=1e-5)


# ----------------------------------------------------------------------------- the export trap

def test_a_traced_eager_experts_loop_is_one_warning_per_block_in_optimize_and_check(tmp_path):
    """Traced on one token, transformers' eager experts keep the 2 experts that token hit (of 4)."""
    from click.testing import CliRunner

    from k3opt.cli import main

    path = traced_eager_model("mixtral")
    report = Report()
    k3opt.optimize(str(path), report=report)
    trap = [w for w in report.warnings if "a trace of the experts loop kept 2 of 4 expert branches" in w]
    assert len(trap) == 2 and all("k3opt export" in w for w in trap), report.warnings
    result = CliRunner().invoke(main, ["check", str(path)])
    assert result.output.count("warning: MoE experts at") == 2
    clean = Report()
    k3opt.optimize(str(moe_model("mixtral", "torchscript")), report=clean)
    assert not any("MoE experts" in w for w in clean.warnings)


@pytest.mark.parametrize("name, exporter", _cases())
def test_a_lowered_moe_model_keeps_its_layer_boundaries(name, exporter, tmp_path):
    """The residual Add folded into NPUMoeFinalizeRouting leaves its name on the node that now computes it, and
    k3opt.blocks reads a FinalizeRouting with skip inputs as a residual-stream step: the lowered model has every
    layer (before, only the layers without an MoE block: split cut coarsely, the block-wise check merged blocks),
    ``split`` of it into one stage a layer is equal to the source under the reference ops, its lowering is checked per layer."""
    from k3opt.blocks.split import split_model
    from k3opt.blocks.structure import find_stack

    src = moe_model(name, exporter)
    original = find_stack(onnx.load(str(src)).graph)
    out, _ = lowered(str(src), moe_inputs(name))
    stack = find_stack(out.graph)
    assert "NPUMoeFinalizeRouting" in op_counts(out)
    assert len(stack.boundaries) == moe_config(name).num_hidden_layers + 1
    assert set(stack.boundaries) <= {p.tensor for p in original.points} | set(original.boundaries)
    report = k3opt.optimize_file(src, tmp_path / "a.onnx", target="cann", verify=True, verify_memory=250_000)
    lv = report.lowering_verification  # under the model's size (300-400 KB), over its largest layer's
    assert lv["status"] == "passed" and lv["mode"] == "block-wise" and "merged_boundaries" not in lv
    assert not [w for w in report.warnings if "--verify-memory" in w]
    manifest = split_model(src, tmp_path / "s", moe_config(name).num_hidden_layers, target="cann")  # one a layer
    assert manifest["verification"]["status"] == "passed"
    assert manifest["verification"]["stages_run_by"] == "the cann reference ops"
