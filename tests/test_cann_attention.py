"""lower-attention-npu on hand-made attentions: each lowering and each refusal, checked numerically.

Every lowered model is verified by the pipeline itself (``verify=True``: onnxruntime runs the original,
onnx's reference evaluator with k3opt's NPU reference ops runs the lowered one, same inputs).
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T, helper

import k3opt
from k3opt.cann_bridge import check_model, invariant_violations
from k3opt.report import Report
from tests.helpers import make_model

B, N, S, D = 2, 4, 5, 8
NEG_INF = float("-inf")


def attention_model(n_kv=N, dv=D, mask="keep", fill=NEG_INF, guard=True, dtype=T.FLOAT, decode=False, sq=S,
                    layernorm=False, skv=None):
    """q @ k^T * scale [+ mask] -> Softmax [-> sdpa's IsNaN guard] -> @ v, GQA's repeat_kv when n_kv < N.

    mask: None; "keep" (Where(keep, 0, fill) from a bool input); "causal" (a constant bottom-right
    triangle); "float" (an arbitrary float input: a mask of unknown form).
    """
    skv = skv or S
    np_t = onnx.helper.tensor_dtype_to_np_dtype(dtype)
    inits: dict = {"scale": np.array(D ** -0.5, np_t)}
    inputs = [("q", dtype, [B, N, sq, D])]
    nodes = []
    if decode:
        inputs += [("past_k", dtype, [B, n_kv, skv - sq, D]), ("new_k", dtype, [B, n_kv, sq, D]),
                   ("past_v", dtype, [B, n_kv, skv - sq, dv]), ("new_v", dtype, [B, n_kv, sq, dv])]
        nodes += [helper.make_node("Concat", ["past_k", "new_k"], ["k"], axis=2, name="cat_k"),
                  helper.make_node("Concat", ["past_v", "new_v"], ["v"], axis=2, name="cat_v")]
    else:
        inputs += [("k", dtype, [B, n_kv, skv, D]), ("v", dtype, [B, n_kv, skv, dv])]
    kk, vv = "k", "v"
    if n_kv < N:
        rep = N // n_kv
        for name, d in (("k", D), ("v", dv)):
            inits[f"{name}_ax"] = np.array([2], np.int64)
            inits[f"{name}_to"] = np.array([B, n_kv, rep, skv, d], np.int64)
            inits[f"{name}_shape"] = np.array([B, N, skv, d], np.int64)
            nodes += [helper.make_node("Unsqueeze", [name, f"{name}_ax"], [f"{name}_u"]),
                      helper.make_node("Expand", [f"{name}_u", f"{name}_to"], [f"{name}_e"]),
                      helper.make_node("Reshape", [f"{name}_e", f"{name}_shape"], [f"{name}_rep"])]
        kk, vv = "k_rep", "v_rep"
    nodes += [helper.make_node("Transpose", [kk], ["kt"], perm=[0, 1, 3, 2]),
              helper.make_node("MatMul", ["q", "kt"], ["qk"]),
              helper.make_node("Mul", ["qk", "scale"], ["scores"])]
    x = "scores"
    if mask == "keep":
        inputs.append(("keep", T.BOOL, [B, 1, sq, skv]))
        inits.update(zero=np.array(0, np_t), fill=np.array(fill, np_t))
        nodes += [helper.make_node("Where", ["keep", "zero", "fill"], ["mask"]),
                  helper.make_node("Add", ["scores", "mask"], ["masked"])]
        x = "masked"
    elif mask == "causal":
        tri = np.arange(skv)[None, :] <= np.arange(sq)[:, None] + (skv - sq)
        inits["mask"] = np.where(tri, 0, NEG_INF).astype(np_t)[None, None]
        nodes.append(helper.make_node("Add", ["scores", "mask"], ["masked"]))
        x = "masked"
    elif mask == "float":
        inputs.append(("mask", dtype, [B, 1, sq, skv]))
        nodes.append(helper.make_node("Add", ["scores", "mask"], ["masked"]))
        x = "masked"
    nodes.append(helper.make_node("Softmax", [x], ["probs"], axis=-1, name="softmax"))
    p = "probs"
    if guard:
        inits["p0"] = np.array(0, np_t)
        nodes += [helper.make_node("IsNaN", ["probs"], ["nan"]),
                  helper.make_node("Where", ["nan", "p0", "probs"], ["guarded"])]
        p = "guarded"
    nodes.append(helper.make_node("MatMul", [p, vv], ["attn"]))
    out = "attn"
    if layernorm:
        inits.update(ln_s=np.ones(dv, np_t), ln_b=np.zeros(dv, np_t))
        nodes.append(helper.make_node("LayerNormalization", ["attn", "ln_s", "ln_b"], ["y"], axis=-1))
        out = "y"
    else:
        nodes.append(helper.make_node("Identity", ["attn"], ["y"]))
    outputs = [("y", dtype, [B, N, sq, dv])]
    if decode:
        outputs += [("k", dtype, [B, n_kv, skv, D]), ("v", dtype, [B, n_kv, skv, dv])]
    return make_model(nodes, inputs, outputs, inits)


def feeds_for(model, dead_row=False):
    rng = np.random.default_rng(0)
    feeds = {}
    for vi in model.graph.input:
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        if vi.type.tensor_type.elem_type == T.BOOL:
            keep = rng.random(shape) < 0.7
            keep[..., 0] = True
            if dead_row:
                keep[1, :, 2, :] = False
            feeds[vi.name] = keep
        else:
            feeds[vi.name] = rng.standard_normal(shape).astype(onnx.helper.tensor_dtype_to_np_dtype(
                vi.type.tensor_type.elem_type))
    return feeds


def lower(model, dead_row=False, **options):
    report = Report()
    out = k3opt.optimize(model, target="cann", verify=True, input_data=feeds_for(model, dead_row), report=report,
                         **options)
    assert report.verification["status"] == "passed"
    assert invariant_violations(out) == [] and [str(f) for f in check_model(out)] == []
    return out, report


def flash_nodes(model):
    return [n for n in model.graph.node if n.op_type.startswith("NPU")]


def attrs(node):
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def test_prefill_with_a_keep_mask_is_prompt_flash_attention_at_opset_16():
    out, report = lower(attention_model())
    (pfa,) = flash_nodes(out)
    assert pfa.op_type == "NPUPromptFlashAttention" and pfa.domain == "" and len(pfa.input) == 5 and pfa.input[3] == ""
    assert [(o.domain, o.version) for o in out.opset_import] == [("", 16)]
    a = attrs(pfa)
    assert a == {"num_heads": N, "input_layout": b"BNSD", "scale_value": pytest.approx(D ** -0.5),
                 "num_key_value_heads": N, "pre_tokens": 2147483647, "next_tokens": 2147483647, "sparse_mode": 0,
                 "inner_precise": 2}
    assert next(x for x in pfa.attribute if x.name == "scale_value").type == onnx.AttributeProto.FLOAT
    assert "Softmax" not in {n.op_type for n in out.graph.node}
    assert report.lowering_verification["status"] == "passed"
    assert report.lowering[-2].startswith("NPU flash attention: 1 of 1 attention(s) lowered (opset 16")


@pytest.mark.parametrize("fill, guard", [(NEG_INF, True), (float(np.finfo(np.float32).min), False),
                                         (float(np.finfo(np.float32).min), True)])
def test_rows_with_every_key_masked_keep_the_graphs_value(fill, guard):
    """0 under sdpa's guard with -inf, the mean of v with the dtype's lowest: rebuilt, whatever the device does."""
    out, report = lower(attention_model(fill=fill, guard=guard), dead_row=True)
    assert len(flash_nodes(out)) == 1 and report.lowering_verification["status"] == "passed"


def test_gqa_sets_num_key_value_heads():
    out, report = lower(attention_model(n_kv=2), dead_row=True)
    (pfa,) = flash_nodes(out)
    assert attrs(pfa)["num_key_value_heads"] == 2 and report.lowering_verification["status"] == "passed"


def test_causal_constant_mask_uses_sparse_mode_3_and_the_template():
    out, _ = lower(attention_model(mask="causal", guard=False, sq=3, skv=6))
    (pfa,) = flash_nodes(out)
    a = attrs(pfa)
    assert a["sparse_mode"] == 3 and a["pre_tokens"] == 2147483647 and a["next_tokens"] == 0
    template = next(i for i in out.graph.initializer if i.name == pfa.input[4])
    assert list(template.dims) == [2048, 2048] and template.data_type == T.BOOL


def test_no_mask_gives_three_inputs():
    out, _ = lower(attention_model(mask=None, guard=False))
    (pfa,) = flash_nodes(out)
    assert len(pfa.input) == 3 and attrs(pfa)["inner_precise"] == 0


def test_layernorm_model_uses_the_npu_domain_and_the_form_is_selectable():
    out, report = lower(attention_model(layernorm=True))
    (pfa,) = flash_nodes(out)
    assert pfa.domain == "npu" and [(o.domain, o.version) for o in out.opset_import] == [("", 17), ("npu", 1)]
    assert "LayerNormalization differ(s) from 17" in report.lowering[-2]
    out, _ = lower(attention_model(), npu_attention_form="npu")
    assert flash_nodes(out)[0].domain == "npu"
    out, report = lower(attention_model(layernorm=True), npu_attention_form="opset16")
    assert flash_nodes(out) == [] and "the opset-16 form was asked for" in report.lowering[-1]
    with pytest.raises(k3opt.UsageError, match="npu_attention_form"):
        k3opt.optimize(attention_model(), target="cann", npu_attention_form="bsh")


def test_decode_with_a_one_head_cache_and_one_query_is_incre_flash_attention():
    out, report = lower(attention_model(n_kv=1, mask=None, guard=False, decode=True, sq=1, skv=6))
    (ifa,) = flash_nodes(out)
    assert ifa.op_type == "NPUIncreFlashAttention" and len(ifa.input) == 6 and list(ifa.input[3:]) == ["", "", ""]
    assert set(attrs(ifa)) == {"num_heads", "input_layout", "scale_value"}  # all the plugin reads
    assert [o.name for o in out.graph.output] == ["y", "k", "v"]  # present key/value still produced
    assert report.lowering_verification["status"] == "passed"


def test_decode_with_a_gqa_cache_is_prompt_flash_attention():
    """IncreFlashAttention's plugin never passes num_key_value_heads (the kernel's default 1): an MHA/GQA cache
    is PromptFlashAttention with one query row."""
    out, report = lower(attention_model(n_kv=2, decode=True, sq=1, skv=6), dead_row=False)
    (pfa,) = flash_nodes(out)
    assert pfa.op_type == "NPUPromptFlashAttention" and attrs(pfa)["num_key_value_heads"] == 2
    assert "(decode step, 4/2 heads, mask, sparse_mode 0)" in report.lowering[-1]


@pytest.mark.parametrize("dv, options", [(4, {}), (12, {}), (4, {"fill": float(np.finfo(np.float32).min),
                                                                      "guard": False})])
def test_mla_head_dims_pad_the_smaller_side_and_slice_the_output(dv, options):
    """MLA (q/k dim 8, v dim 4 or 12): one head dim for the kernel by zero columns, exact; a fully masked row keeps
    the graph's mean of v (the unpadded v)."""
    out, report = lower(attention_model(dv=dv, **options), dead_row=True)
    (pfa,) = flash_nodes(out)
    producers = {o: n.op_type for n in out.graph.node for o in n.output}
    padded = [producers.get(pfa.input[i]) for i in range(3)]
    assert padded == (["Pad", "Pad", None] if dv > D else [None, None, "Pad"])
    assert ("Slice" in {n.op_type for n in out.graph.node}) == (dv < D)
    assert report.lowering_verification["status"] == "passed"
    assert f"MLA: q/k dim {D}, v dim {dv} padded" in report.lowering[-1]


def test_mla_decode_with_a_one_head_cache_is_incre_flash_attention_on_padded_values():
    out, report = lower(attention_model(n_kv=1, dv=4, mask=None, guard=False, decode=True, sq=1, skv=6))
    (ifa,) = flash_nodes(out)
    assert ifa.op_type == "NPUIncreFlashAttention" and report.lowering_verification["status"] == "passed"


@pytest.mark.parametrize("model, why", [
    (lambda: attention_model(dv=520, mask=None, guard=False),
     "head dim 520 (q/k 8, v 520: MLA pads to the larger) is over the kernel's 512"),
    (lambda: attention_model(mask="float", guard=False), "the mask is of unknown form"),
    (lambda: attention_model(guard=False), "fills -inf without the IsNaN guard"),
    (lambda: attention_model(dtype=T.FLOAT16, fill=float(np.finfo(np.float16).min), guard=False),
     "in FLOAT16 the fill -65504 does not swamp the scores"),
])
def test_refusals_keep_the_attention_decomposed_with_the_reason(model, why):
    m = model()
    report = Report()
    out = k3opt.optimize(m, target="cann", report=report)
    assert flash_nodes(out) == [] and "Softmax" in {n.op_type for n in out.graph.node}
    assert any(why in line and "kept decomposed" in line for line in report.lowering), report.lowering
    assert "NPU flash attention: 0 of 1 attention(s) lowered" in report.lowering[1]


def test_float16_attention_is_lowered_and_verified_in_float16():
    out, report = lower(attention_model(dtype=T.FLOAT16), dead_row=True)
    assert len(flash_nodes(out)) == 1
    assert report.lowering_verification["status"] == "passed" and report.lowering_verification["rtol"] == 1e-2


def test_causal_mask_with_more_queries_than_keys_is_a_full_mask():
    """Bottom-right causal with Sq > Skv fully masks the first rows: not sparse_mode 3 (the kernel's invalid rows
    are undocumented), but the full mask and the graph's zeros for those rows (sdpa's guard)."""
    out, report = lower(attention_model(mask="causal", guard=True, sq=6, skv=3))
    (pfa,) = flash_nodes(out)
    assert attrs(pfa)["sparse_mode"] == 0 and "Where" in {n.op_type for n in out.graph.node}
    assert report.lowering_verification["status"] == "passed"


def _head_split(shape_of_other: bool):
    """x (B, S, 32) -> Reshape(x, [B, S, -1, 8]) with B, S read from Shape(x) (or from another tensor) -> BNSD."""
    src = "other" if shape_of_other else "x"
    nodes = [helper.make_node("Shape", [src], ["shp"]),
             helper.make_node("Gather", ["shp", "i0"], ["b"], axis=0),
             helper.make_node("Gather", ["shp", "i1"], ["s"], axis=0),
             helper.make_node("Unsqueeze", ["b", "ax"], ["b1"]), helper.make_node("Unsqueeze", ["s", "ax"], ["s1"]),
             helper.make_node("Concat", ["b1", "s1", "minus1", "d"], ["target"], axis=0),
             helper.make_node("Reshape", ["x", "target"], ["split"]),
             helper.make_node("Transpose", ["split"], ["q"], perm=[0, 2, 1, 3])]
    inits = {"i0": np.array(0, np.int64), "i1": np.array(1, np.int64), "ax": np.array([0], np.int64),
             "minus1": np.array([-1], np.int64), "d": np.array([8], np.int64)}
    inputs = [("x", T.FLOAT, ["B", "S", 32]), ("other", T.FLOAT, ["B2", "S2", 32])]
    return make_model(nodes, inputs, [("q", T.FLOAT, ["B", None, "S", 8])], inits)


@pytest.mark.parametrize("other, heads", [(False, 4), (True, None)])
def test_head_count_of_a_dynamic_head_split(other, heads):
    """-1 = 32 / 8 only when B and S are provably x's own dims (the same Shape), not another tensor's."""
    from k3opt import modelio
    from k3opt.pipeline import shapes
    from k3opt.targets.cann.passes.lower_attention_npu import static_dim

    graph = modelio.import_graph(_head_split(other))
    shapes.ShapeRefresher()(graph)
    q = next(t for t in graph.outputs if t.name == "q")
    assert static_dim(q, 1) == heads and static_dim(q, 3) == 8
