"""lower-rotary-npu: rotary embeddings become NPURotaryPositionEmbedding (mode 0) for --target cann, each lowered
model verified by the pipeline itself (onnxruntime on the original, the reference NPU op in onnx's reference
evaluator on the lowered one); and the reference op against an independent loop over its documented formulas."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP

import k3opt
from k3opt.cann_bridge import check_model, invariant_violations
from k3opt.targets.cann.reference import ReferenceError
from k3opt.report import Report
from tests.helpers import op_counts, random_feeds
from tests.test_cann_reference_ops import run_node
from tests.test_layer_norm import Net
from tests.test_rotary import D, H, INV_FREQ, X, angles, explicit, i64, model_of, rotate_half
from tests.zoo import zoo_config, zoo_decode_inputs, zoo_decode_model, zoo_inputs, zoo_model

RNG = np.random.default_rng(3)
NPU_ROPE = "NPURotaryPositionEmbedding"


# -- the reference op --------------------------------------------------------------------------------------------

def loop_rope(x, cos, sin, mode):
    """[RoPE-doc]'s formulas, one element at a time, in float64."""
    c, s = np.broadcast_to(cos, x.shape), np.broadcast_to(sin, x.shape)
    y = np.zeros(x.shape)
    d = x.shape[-1]
    for idx in np.ndindex(*x.shape[:-1]):
        for i in range(d):
            if mode == 0:
                r = -x[idx + (i + d // 2,)] if i < d // 2 else x[idx + (i - d // 2,)]
            else:
                r = -x[idx + (i + 1,)] if i % 2 == 0 else x[idx + (i - 1,)]
            y[idx + (i,)] = float(x[idx + (i,)]) * c[idx + (i,)] + float(r) * s[idx + (i,)]
    return y


def rope(x, cos, sin, **attrs):
    return run_node(NPU_ROPE, [("x", x), ("cos", cos), ("sin", sin)], attrs)[0]


@pytest.mark.parametrize("mode, angle_shape", [(0, (1, 1, 5, 8)), (0, (2, 1, 5, 8)), (0, (2, 3, 5, 8)),
                                               (0, (1, 3, 1, 8)), (0, (2, 1, 1, 8)), (1, (1, 1, 5, 8))])
def test_reference_rope_is_the_documented_formula(mode, angle_shape):
    x = RNG.standard_normal((2, 3, 5, 8)).astype(np.float32)
    cos, sin = (RNG.uniform(-1, 1, angle_shape).astype(np.float32) for _ in range(2))
    y = rope(x, cos, sin, mode=mode)
    assert y.dtype == np.float32 and y.shape == x.shape
    np.testing.assert_allclose(y, loop_rope(x, cos, sin, mode), rtol=1e-6, atol=1e-6)


def test_reference_rope_computes_float16_in_float16():
    x = RNG.standard_normal((1, 2, 3, 8)).astype(np.float16)
    cos, sin = (RNG.uniform(-1, 1, (1, 1, 3, 8)).astype(np.float16) for _ in range(2))
    h = 4
    want = x * cos + np.concatenate([-x[..., h:], x[..., :h]], axis=-1) * sin  # numpy: each op rounded to fp16
    np.testing.assert_array_equal(rope(x, cos, sin, mode=0), want)


@pytest.mark.parametrize("x_shape, angle_shape, attrs, match", [
    ((1, 2, 3, 8), (1, 1, 3, 8), {}, "mode is required"),
    ((1, 2, 3, 8), (1, 1, 3, 8), {"mode": 2}, "mode 2 is not modelled"),
    ((2, 3, 5, 8), (1, 3, 5, 8), {"mode": 0}, "not a documented layout"),  # 1NSD
    ((2, 3, 5, 8), (2, 1, 5, 8), {"mode": 1}, "not a documented layout"),  # interleave: 11SD only
    ((2, 3, 5, 8), (1, 1, 5, 4), {"mode": 0}, "head dim 8"),
    ((1, 1, 2, 896), (1, 1, 2, 896), {"mode": 0}, "not one even D < 896"),
    ((2, 3, 8), (1, 3, 8), {"mode": 0}, "not both 4-D"),
])
def test_reference_rope_refuses_what_is_not_documented(x_shape, angle_shape, attrs, match):
    x = np.ones(x_shape, np.float32)
    with pytest.raises(ReferenceError, match=match):
        rope(x, np.ones(angle_shape, np.float32), np.ones(angle_shape, np.float32), **attrs)


def test_reference_rope_refuses_mixed_dtypes_and_shapes():
    x = np.ones((1, 2, 3, 8), np.float32)
    with pytest.raises(ReferenceError, match="one of fp16, bf16, fp32"):
        rope(x, np.ones((1, 1, 3, 8), np.float16), np.ones((1, 1, 3, 8), np.float16), mode=0)
    with pytest.raises(ReferenceError, match="differ in shape"):
        rope(x, np.ones((1, 1, 3, 8), np.float32), np.ones((1, 1, 1, 8), np.float32), mode=0)


# -- the lowering on hand-made graphs -----------------------------------------------------------------------------

def lowered(model, feeds=None, n=1):
    """``--target cann`` with both verifications; ``n`` rotations lowered, each a mode-0 node of the default
    domain that ATC's parser registers at the output's opset."""
    report = Report()
    out = k3opt.optimize(model, target="cann", verify=True, report=report, input_data=feeds)
    assert report.verification["status"] == "passed"
    assert report.lowering_verification["status"] == "passed", report.lowering_verification
    assert invariant_violations(out) == [] and [str(f) for f in check_model(out) if f.kind != "dynamic"] == []
    nodes = [node for node in out.graph.node if node.op_type == NPU_ROPE]
    assert len(nodes) == n, report.lowering
    for node in nodes:
        assert node.domain == "" and [(a.name, a.type, a.i) for a in node.attribute] == [("mode", 2, 0)]
    assert "Neg" not in op_counts(out)
    return out, [line for line in report.lowering if "rotary" in line.lower()]


def opset17(build) -> onnx.ModelProto:
    net = Net(17)
    return build(net)


@pytest.mark.parametrize("neg", ["neg", "mul"])
@pytest.mark.parametrize("kind", ["slice", "split"])
def test_rotate_half_becomes_one_node(kind, neg):
    """Llama/Qwen2: angles (1, 1, S, D) against x's dynamic batch: expanded to it (the B1SD layout)."""
    out, lines = lowered(opset17(lambda net: model_of(net, rotate_half(net, "x", *angles(net), kind=kind, neg=neg))))
    assert lines == ["NPURotaryPositionEmbedding: 1 of 1 rotary embedding(s) lowered (mode 0)",
                     lines[1]] and lines[1].endswith("-> NPURotaryPositionEmbedding (mode 0)")
    assert op_counts(out)["Expand"] == 2


def test_q_and_k_of_a_decode_step():
    def build(net):
        cos, sin = angles(net, past="past")
        q, k = rotate_half(net, "x", cos, sin), rotate_half(net, "k", cos, sin)
        return model_of(net, net("MatMul", q, net("Transpose", k, perm=[0, 1, 3, 2])),
                        inputs=[X, ("k", TP.FLOAT, ["b", H, "s", D]), ("past", TP.FLOAT, ["b", 2, "p", D])])
    model = opset17(build)
    feeds = {"x": RNG.standard_normal((2, H, 1, D)).astype(np.float32),
             "k": RNG.standard_normal((2, H, 1, D)).astype(np.float32),
             "past": np.zeros((2, 2, 5, D), np.float32)}
    lowered(model, feeds, n=2)


def test_float16_scaled_angles():
    def build(net):
        y = rotate_half(net, "x", *angles(net, etype=TP.FLOAT16, scale=0.7))
        return model_of(net, y, inputs=[("x", TP.FLOAT16, ["b", H, "s", D])], etype=TP.FLOAT16)
    lowered(opset17(build))


def test_angles_with_the_batch_of_x_are_not_expanded():
    """cos_cached[position_ids] carries x's batch and positions: B1SD as it is."""
    table = np.arange(16, dtype=np.float32)[:, None] * np.concatenate([INV_FREQ, INV_FREQ])

    def build(net):
        cs = [net("Unsqueeze", net("Gather", net.const(f(table)), "pos", axis=0), i64(net, [1]))
              for f in (np.cos, np.sin)]
        return model_of(net, rotate_half(net, "x", *cs), inputs=[X, ("pos", TP.INT64, ["b", "s"])])
    model = opset17(build)
    feeds = random_feeds(model)
    feeds["pos"] = RNG.integers(0, 16, feeds["pos"].shape).astype(np.int64)
    out, _ = lowered(model, feeds)
    assert "Expand" not in op_counts(out)


def test_folded_angles_of_rank_two_get_their_leading_ones():
    emb = np.arange(3, dtype=np.float32)[:, None] * np.concatenate([INV_FREQ, INV_FREQ])
    out, _ = lowered(opset17(lambda net: model_of(
        net, rotate_half(net, "x", net.const(np.cos(emb)), net.const(np.sin(emb))),
        inputs=[("x", TP.FLOAT, ["b", H, 3, D])])))
    rope = next(n for n in out.graph.node if n.op_type == NPU_ROPE)
    ranks = {t.name: len(t.dims) for t in out.graph.initializer}  # folded after the lowering, or Unsqueezed
    assert all(ranks.get(name, 4) == 4 for name in rope.input[1:]) and op_counts(out).get("Unsqueeze", 0) in (0, 2)


@pytest.mark.parametrize("kind", ["pairs", "slice", "split"])
def test_explicit_halves_take_doubled_angles(kind):
    """Half-width angles: Concat(cos, cos); DeepSeek's even/odd pairs: of Concat(x[..., 0::2], x[..., 1::2])."""
    out, _ = lowered(opset17(lambda net: model_of(net, explicit(net, "x", *angles(net, half=True), kind=kind))))
    assert op_counts(out)["Concat"] >= 2 + (kind == "pairs")


def test_mla_prefix_and_partial_rotary():
    """The prefix (MLA) and the pass-through part (GPT-NeoX) stay concatenated around the lowered rotation."""
    def mla(net):
        net.nodes.append(onnx.helper.make_node("Split", ["x", i64(net, [4, D])], ["q_pass", "q_rot"], axis=-1))
        return model_of(net, explicit(net, "q_rot", *angles(net, "q_rot", half=True), prefix="q_pass"),
                        inputs=[("x", TP.FLOAT, ["b", H, "s", 12])])

    def partial(net):
        head = net("Slice", "x", i64(net, [0]), i64(net, [D]), i64(net, [-1]), i64(net, [1]))
        tail = net("Slice", "x", i64(net, [D]), i64(net, [12]), i64(net, [-1]), i64(net, [1]))
        return model_of(net, net("Concat", rotate_half(net, head, *angles(net)), tail, axis=-1),
                        inputs=[("x", TP.FLOAT, ["b", H, "s", 12])])
    for build in (mla, partial):
        lowered(opset17(build))


# -- refusals -----------------------------------------------------------------------------------------------------

def kept(model, reason: str) -> None:
    report = Report()
    out = k3opt.optimize(model, target="cann", verify=True, report=report)
    assert report.lowering_verification["status"] == "passed"
    assert NPU_ROPE not in op_counts(out)
    lines = [line for line in report.lowering if "rotary" in line.lower()]
    assert lines[0] == "NPURotaryPositionEmbedding: 0 of 1 rotary embedding(s) lowered (mode 0)"
    assert lines[1].startswith("rotary embedding at '") and lines[1].endswith(f"kept decomposed: {reason}")


def test_angles_broadcast_over_the_positions_are_kept():
    """Constant (1, D) angles against x's dynamic positions: (B|1, 1, 1, D) is no documented BNSD layout."""
    emb = np.concatenate([INV_FREQ, INV_FREQ])[None] * 0.5
    kept(opset17(lambda net: model_of(net, rotate_half(net, "x", net.const(np.cos(emb)), net.const(np.sin(emb))))),
         "cos/sin are broadcast over x's positions (no documented layout)")


def test_head_dim_896_and_1000_heads_are_kept():
    def wide(net, d=896):
        emb = np.arange(2, dtype=np.float32)[:, None] * np.ones(d, np.float32) * 0.01
        return model_of(net, rotate_half(net, "x", net.const(np.cos(emb)), net.const(np.sin(emb)), cut=d // 2),
                        inputs=[("x", TP.FLOAT, [1, 1, 2, d])])

    def many_heads(net):
        emb = np.arange(2, dtype=np.float32)[:, None] * np.concatenate([INV_FREQ, INV_FREQ])
        return model_of(net, rotate_half(net, "x", net.const(np.cos(emb)), net.const(np.sin(emb))),
                        inputs=[("x", TP.FLOAT, [1, 1000, 2, D])])
    kept(opset17(wide), "head dim 896 is not < 896")
    kept(opset17(many_heads), "heads 1000 is not < 1000")


def test_a_model_without_rope_gets_no_rotary_line():
    from tests.cann_models import rms_model

    report = Report()
    k3opt.optimize(rms_model(eps=1e-6), target="cann", report=report)
    assert report.lowering and not any("Rotary" in line or "rotary" in line for line in report.lowering)


# -- the zoo ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_zoo_prefill_and_decode_lower_every_rotation(name):
    """One per q and per k in every layer, prefill and a decode step after a cache of 6."""
    layers = zoo_config(name).num_hidden_layers
    lowered(str(zoo_model(name)), zoo_inputs(name), n=2 * layers)
    lowered(str(zoo_decode_model(name)), zoo_decode_inputs(name), n=2 * layers)
