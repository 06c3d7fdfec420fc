"""fuse-rotary: the rotary embedding of q and of k becomes RotaryEmbedding at opset 23 (target onnx), is counted and
left decomposed otherwise; every form exporters emit is fused exactly, every unsafe one is left alone."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP

import k3opt.api
from k3opt.plugins import get_pass
from k3opt.report import Report
from tests.helpers import assert_equivalent, op_counts, random_feeds, run_passes
from tests.test_layer_norm import RNG, Net, attrs, needs_torch, zoo_cases
from tests.zoo import family, zoo_config, zoo_decode_inputs, zoo_decode_model, zoo_inputs, zoo_model

D, H = 8, 4  # head dim, heads
X = ("x", TP.FLOAT, ["b", H, "s", D])
INV_FREQ = (1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype(np.float32)


def fuse(model: onnx.ModelProto, target: str = "onnx"):
    return run_passes(model, [get_pass("fuse-rotary")()], target=target)


def rope_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "RotaryEmbedding"]


def i64(net: Net, values) -> str:
    return net.const(np.asarray(values, dtype=np.int64), TP.INT64)


def angles(net: Net, x: str = "x", etype=TP.FLOAT, half: bool = False, scale=None, trigs=("Cos", "Sin"),
           past=None) -> list[str]:
    """cos/sin as transformers' rotary module computes them from ``arange(seq)`` (Llama): (1, 1, S, D) tensors
    of ``Concat(freqs, freqs)``, or their first halves (``half``, DeepSeek-V3's interleave form); ``past``: the
    positions of a decode step, ``arange(seq) + past length`` (the past cache's dim 2)."""
    seq = net("Gather", net("Shape", x), i64(net, 2), axis=0)
    pos = net("Range", i64(net, 0), seq, i64(net, 1))
    if past:
        pos = net("Add", pos, net("Gather", net("Shape", past), i64(net, 2), axis=0))
    posf = net("Cast", net("Unsqueeze", pos, i64(net, [0, 2])), to=TP.FLOAT)
    emb = net("Concat", *[net("Mul", posf, net.const(INV_FREQ))] * 2, axis=-1)
    out = []
    for trig in trigs:
        t = net(trig, emb)
        if scale is not None:
            t = net("Mul", t, net.const(scale))
        if etype != TP.FLOAT:
            t = net("Cast", t, to=etype)
        if half:
            t = net("Slice", t, i64(net, [0]), i64(net, [D // 2]), i64(net, [2]), i64(net, [1]))
        out.append(net("Unsqueeze", t, i64(net, [1])))
    return out


def halves(net: Net, x: str, kind: str = "slice", cut: int = D // 2, axis: int = 3) -> tuple[str, str]:
    if kind == "split":
        net.nodes.append(onnx.helper.make_node("Split", [x, i64(net, [cut, D - cut])], ["lo", "hi"], axis=-1,
                                               name="split"))
        return "lo", "hi"
    if kind == "pairs":
        big = i64(net, [np.iinfo(np.int64).max])
        return (net("Slice", x, i64(net, [0]), big, i64(net, [3]), i64(net, [2])),
                net("Slice", x, i64(net, [1]), big, i64(net, [3]), i64(net, [2])))
    return (net("Slice", x, i64(net, [0]), i64(net, [cut]), i64(net, [axis]), i64(net, [1])),
            net("Slice", x, i64(net, [cut]), i64(net, [np.iinfo(np.int64).max]), i64(net, [axis]), i64(net, [1])))


def rotate_half(net: Net, x: str, cos: str, sin: str, kind: str = "slice", neg: str = "neg", cut: int = D // 2,
                swap: bool = False, axis: int = 3) -> str:
    """``x * cos + cat(-x2, x1) * sin`` (transformers' apply_rotary_pos_emb)."""
    lo, hi = halves(net, x, kind, cut, axis)
    if swap:
        lo, hi = hi, lo
    minus = net("Neg", hi) if neg == "neg" else net("Mul", hi, net.const(-1.0))
    return net("Add", net("Mul", x, cos), net("Mul", net("Concat", minus, lo, axis=-1), sin))


def explicit(net: Net, x: str, cos: str, sin: str, kind: str = "pairs", prefix=None) -> str:
    """``cat(x1*cos - x2*sin, x2*cos + x1*sin)`` (DeepSeek-V3's apply_rotary_pos_emb_interleave when ``pairs``)."""
    x1, x2 = halves(net, x, kind)
    real = net("Sub", net("Mul", x1, cos), net("Mul", x2, sin))
    imag = net("Add", net("Mul", x2, cos), net("Mul", x1, sin))
    return net("Concat", *([prefix] if prefix else []), real, imag, axis=-1)


def model_of(net: Net, out: str, inputs=(X,), etype=TP.FLOAT, outputs=()) -> onnx.ModelProto:
    return net.model(out, list(inputs), etype, outputs=outputs)


def assert_fused(model, n=1, rtol=1e-5, atol=1e-6, feeds=None, rewrites=None, **want):
    out, pm, _ = fuse(model)
    nodes = rope_nodes(out)
    assert len(nodes) == n, op_counts(out)
    for node in nodes:
        assert {k: v for k, v in attrs(node).items() if k in want} == want
        assert len(node.input) == 3  # no position_ids: the caches are the graph's own angles
    assert not {"Neg", "Sin", "Cos"} & set(op_counts(out)) - set(op_counts(model))
    assert_equivalent(model, out, rtol=rtol, atol=atol, feeds=feeds)
    again, pm2, _ = fuse(out)
    assert pm.stats["fuse-rotary"].rewrites == (rewrites or n) and pm2.stats["fuse-rotary"].rewrites == 0
    return out


def assert_untouched(model, target="onnx", found=0):
    """No rewrite, same ops and outputs; ``found`` rotations counted as left decomposed."""
    out, pm, ctx = fuse(model, target)
    assert ctx.counters.get("rotary_found", 0) == found
    assert pm.stats["fuse-rotary"].rewrites == 0 and op_counts(out) == op_counts(model)
    assert_equivalent(model, out, rtol=0, atol=0)
    return ctx


def llama_model(opset=23, **kw) -> onnx.ModelProto:
    net = Net(opset)
    return model_of(net, rotate_half(net, "x", *angles(net), **kw))


# -- every form -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("neg", ["neg", "mul"])
@pytest.mark.parametrize("kind", ["slice", "split"])
def test_rotate_half_with_angles_from_positions(kind, neg):
    """Llama/Qwen2: cos/sin computed from arange(seq) at run time; the halves by Slice (exporters) or Split (chunk)."""
    out = assert_fused(llama_model(kind=kind, neg=neg), interleaved=0)
    assert "Neg" not in op_counts(out) and "Concat" in op_counts(out)  # only the angles' Concat(freqs, freqs)


def test_decode_step_positions_after_the_cache():
    """A decode step's positions arange(new) + past: still x's positions, provably."""
    net = Net(23)
    model = model_of(net, rotate_half(net, "x", *angles(net, past="past")),
                     inputs=[X, ("past", TP.FLOAT, ["b", 2, "p", D])])
    assert_fused(model, feeds=random_feeds(model) | {"past": np.zeros((2, 2, 5, D), np.float32)})


def test_q_and_k_share_the_angles_and_fuse_separately():
    net = Net(23)
    cos, sin = angles(net)
    q = rotate_half(net, "x", cos, sin)
    k = rotate_half(net, "k", cos, sin)
    model = model_of(net, net("MatMul", q, net("Transpose", k, perm=[0, 1, 3, 2])),
                     inputs=[X, ("k", TP.FLOAT, ["b", H, "s", D])])
    assert_fused(model, n=2)


def test_scaled_angles_and_fp16():
    """cos * attention_scaling, then .to(x.dtype): both halves stay equal through the Mul and the Cast."""
    net = Net(23)
    y = rotate_half(net, "x", *angles(net, etype=TP.FLOAT16, scale=0.7))
    model = model_of(net, y, inputs=[("x", TP.FLOAT16, ["b", H, "s", D])], etype=TP.FLOAT16)
    assert_fused(model, rtol=1e-3, atol=1e-3)


def test_constant_cache_gathered_by_position_ids():
    """cos_cached[position_ids] from a constant table: no Expand (the ids carry x's batch and positions)."""
    table = np.arange(16, dtype=np.float32)[:, None] * np.concatenate([INV_FREQ, INV_FREQ])
    net = Net(23)
    cs = [net("Unsqueeze", net("Gather", net.const(f(table)), "pos", axis=0), i64(net, [1])) for f in (np.cos, np.sin)]
    model = model_of(net, rotate_half(net, "x", *cs), inputs=[X, ("pos", TP.INT64, ["b", "s"])])
    feeds = random_feeds(model)
    feeds["pos"] = RNG.integers(0, 16, feeds["pos"].shape).astype(np.int64)
    out = assert_fused(model, feeds=feeds)
    assert "Expand" not in op_counts(out)


def test_folded_constant_angles_of_two_dims():
    """A static sequence folds cos/sin to constants; here (S, D) ones, broadcast over batch and heads."""
    emb = np.arange(3, dtype=np.float32)[:, None] * np.concatenate([INV_FREQ, INV_FREQ])
    net = Net(23)
    model = model_of(net, rotate_half(net, "x", net.const(np.cos(emb)), net.const(np.sin(emb))),
                     inputs=[("x", TP.FLOAT, ["b", H, 3, D])])
    assert_fused(model)


@pytest.mark.parametrize("kind", ["pairs", "slice", "split"])
def test_explicit_halves_with_half_width_angles(kind):
    """DeepSeek-V3 (transformers' rope_interleave): even/odd elements rotated into the half-split layout, i.e.
    RotaryEmbedding of Concat(x[..., 0::2], x[..., 1::2]); with contiguous halves, of x itself."""
    net = Net(23)
    out = assert_fused(model_of(net, explicit(net, "x", *angles(net, half=True), kind=kind)), interleaved=0)
    assert op_counts(out).get("Slice", 0) == (2 if kind == "pairs" else 0) + 2  # + the angles' own halves


def test_mla_prefix_concatenated_in_the_same_concat():
    """TorchScript merges MLA's cat((q_pass, q_rot)) with the rotation's Concat: the prefix is kept in front."""
    net = Net(23)
    x = ("x", TP.FLOAT, ["b", H, "s", 12])
    q_pass, q_rot = "q_pass", "q_rot"
    net.nodes.append(onnx.helper.make_node("Split", ["x", i64(net, [4, D])], [q_pass, q_rot], axis=-1, name="split"))
    y = explicit(net, q_rot, *angles(net, q_rot, half=True), prefix=q_pass)
    out = assert_fused(model_of(net, y, inputs=[x]))
    assert op_counts(out)["Concat"] >= 2


def test_partial_rotary_becomes_rotary_embedding_dim():
    """GPT-NeoX/Phi: cat(rope(q[..., :8]), q[..., 8:]) of a head dim 12 is one RotaryEmbedding(rotary_embedding_dim=8)."""
    net = Net(23)
    big = np.iinfo(np.int64).max
    head = net("Slice", "x", i64(net, [0]), i64(net, [D]), i64(net, [-1]), i64(net, [1]))
    tail = net("Slice", "x", i64(net, [D]), i64(net, [big]), i64(net, [-1]), i64(net, [1]))
    y = net("Concat", rotate_half(net, head, *angles(net)), tail, axis=-1)
    out = assert_fused(model_of(net, y, inputs=[("x", TP.FLOAT, ["b", H, "s", 12])]), rewrites=2,
                       rotary_embedding_dim=D)
    (node,) = rope_nodes(out)
    assert node.input[0] == "x" and node.output[0] == out.graph.output[0].name  # no Slice of x, no Concat after


def test_partial_rotary_with_other_slices_stays_a_concat():
    """cat(rope(q[..., :8]), q[..., 10:]) drops dims: the rotation fuses, the Concat stays."""
    net = Net(23)
    head = net("Slice", "x", i64(net, [0]), i64(net, [D]), i64(net, [-1]), i64(net, [1]))
    tail = net("Slice", "x", i64(net, [10]), i64(net, [12]), i64(net, [-1]), i64(net, [1]))
    y = net("Concat", rotate_half(net, head, *angles(net)), tail, axis=-1)
    out = assert_fused(model_of(net, y, inputs=[("x", TP.FLOAT, ["b", H, "s", 12])]))
    (node,) = rope_nodes(out)
    assert "rotary_embedding_dim" not in attrs(node)
    assert any(n.op_type == "Concat" and node.output[0] in n.input for n in out.graph.node)


# -- counted, not fused -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("opset, target", [(18, "onnx"), (23, "cann")])
def test_left_decomposed_and_counted(opset, target):
    net = Net(opset)
    cos, sin = angles(net)
    y = net("Add", rotate_half(net, "x", cos, sin), rotate_half(net, "x", cos, sin, kind="split"))
    ctx = assert_untouched(model_of(net, y), target, found=2)
    why = "opset < 23" if target == "onnx" else "target cann"
    assert f"2 rotary embeddings found, left decomposed: {why}" in ctx.notes


# -- refusals -----------------------------------------------------------------------------------------------------

def refused(model) -> None:
    assert_untouched(model)
    low = onnx.ModelProto()
    low.CopyFrom(model)
    low.opset_import[0].version = 18
    assert_untouched(low)  # refused ones are not counted either


def test_halves_not_at_the_middle_are_refused():
    refused(llama_model(cut=3))


def test_neg_on_the_left_half_is_refused():
    refused(llama_model(swap=True))


def test_cos_and_sin_of_different_angles_are_refused():
    net = Net(23)
    (cos,), (sin,) = angles(net, trigs=("Cos",)), angles(net, x="x2", trigs=("Sin",))
    refused(model_of(net, rotate_half(net, "x", cos, sin), inputs=[X, ("x2", TP.FLOAT, ["b", H, "s", D])]))


def test_cos_twice_is_refused():
    net = Net(23)
    refused(model_of(net, rotate_half(net, "x", *angles(net, trigs=("Cos", "Cos")))))


def test_angles_with_unequal_halves_are_refused():
    """Cos(Concat(f, 2f)): the rotate-half formula is then no rotary embedding of x."""
    net = Net(23)
    f = net("Mul", net("Cast", net("Unsqueeze", net("Range", i64(net, 0), net("Gather", net("Shape", "x"),
                                                                               i64(net, 2), axis=0), i64(net, 1)),
                                   i64(net, [0, 2])), to=TP.FLOAT), net.const(INV_FREQ))
    emb = net("Concat", f, net("Mul", f, net.const(2.0)), axis=-1)
    cs = [net("Unsqueeze", net(t, emb), i64(net, [1])) for t in ("Cos", "Sin")]
    refused(model_of(net, rotate_half(net, "x", *cs)))


def test_constant_cache_with_unequal_halves_is_refused():
    table = RNG.standard_normal((16, D)).astype(np.float32)
    net = Net(23)
    cs = [net("Unsqueeze", net("Gather", net.const(v), "pos", axis=0), i64(net, [1])) for v in (table, table + 1)]
    model = model_of(net, rotate_half(net, "x", *cs), inputs=[X, ("pos", TP.INT64, ["b", "s"])])
    assert_untouched(model)


def test_angles_per_head_are_refused():
    net = Net(23)
    cos, sin = (net("Expand", t, i64(net, [1, H, 1, 1])) for t in angles(net))
    refused(model_of(net, rotate_half(net, "x", cos, sin)))


def test_positions_not_provably_x_s_are_refused():
    """cos/sin over a sequence axis of their own: x's positions could be 1 and be broadcast to theirs."""
    net = Net(23)
    cos, sin = angles(net, x="p")
    refused(model_of(net, rotate_half(net, "x", cos, sin), inputs=[X, ("p", TP.FLOAT, ["b", H, "t", D])]))


def test_double_is_refused():
    net = Net(23)
    emb = np.arange(3)[:, None] * np.concatenate([INV_FREQ, INV_FREQ]).astype(np.float64)
    y = rotate_half(net, "x", net.const(np.cos(emb), TP.DOUBLE), net.const(np.sin(emb), TP.DOUBLE))
    refused(model_of(net, y, inputs=[("x", TP.DOUBLE, ["b", H, 3, D])], etype=TP.DOUBLE))


def test_three_dims_are_refused():
    emb = np.arange(3, dtype=np.float32)[:, None] * np.concatenate([INV_FREQ, INV_FREQ])
    net = Net(23)
    refused(model_of(net, rotate_half(net, "x", net.const(np.cos(emb)), net.const(np.sin(emb)), axis=-1),
                     inputs=[("x", TP.FLOAT, ["b", 3, D])]))


def test_escaping_rotated_half_is_refused():
    net = Net(23)
    y = rotate_half(net, "x", *angles(net))
    rotated = next(n.output[0] for n in net.nodes if n.op_type == "Concat" and "Neg" in
                   {p.op_type for p in net.nodes if p.output[0] in n.input})
    refused(model_of(net, y, outputs=((rotated, TP.FLOAT),)))


def test_graph_output_name_is_kept():
    model = llama_model()
    out = assert_fused(model)
    assert out.graph.output[0].name == model.graph.output[0].name


# -- real exports (tests/zoo.py) ----------------------------------------------------------------------------------

def assert_every_rotary_fused(path, feeds, name) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """One RotaryEmbedding per q and per k in every layer at opset 23 (the default pipeline, verified in
    onnxruntime on ``feeds``, and compared again here)."""
    model = onnx.load(str(path))
    report = Report()
    out = k3opt.api.optimize(model, opset=23, verify=True, input_data=feeds, report=report)
    counts = op_counts(out)
    assert counts.get("RotaryEmbedding") == 2 * zoo_config(family(name)).num_hidden_layers and "Neg" not in counts
    assert report.verification["status"] == "passed", report.verification
    assert_equivalent(model, out, feeds=feeds, rtol=1e-4, atol=1e-5)
    return model, out


@needs_torch
@pytest.mark.parametrize("name, exporter", zoo_cases(("llama", "qwen2", "deepseek_v3", "llama_eager",
                                                      "qwen2_eager", "deepseek_v3_eager")))
def test_every_rotary_of_real_exports(name, exporter):
    """sdpa and eager attention alike; counted and left decomposed at the default opset."""
    model, _ = assert_every_rotary_fused(zoo_model(name, exporter), zoo_inputs(family(name)), name)
    layers = zoo_config(family(name)).num_hidden_layers
    kept_report = Report()
    kept = k3opt.api.optimize(model, report=kept_report, verify=False)
    assert "RotaryEmbedding" not in op_counts(kept)
    assert f"{2 * layers} rotary embeddings found, left decomposed: opset < 23" in kept_report.notes


@needs_torch
@pytest.mark.parametrize("name, exporter", zoo_cases(("llama", "qwen2")))
def test_every_rotary_of_decode_steps(name, exporter):
    """Decode steps with the KV cache: positions after the past; one new token, and three after four."""
    _, out = assert_every_rotary_fused(zoo_decode_model(name, exporter), zoo_decode_inputs(name), name)
    model = onnx.load(str(zoo_decode_model(name, exporter)))
    assert_equivalent(model, out, feeds=zoo_decode_inputs(name, past=4, new=3), rtol=1e-4, atol=1e-5)



@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_counting_remembers_angle_shapes_with_the_same_report(monkeypatch, name):
    """Counting (opset < 23) keeps each angle tensor's shape verdict for the call: q and k of every layer share
    cos and sin, so it is worked out once per tensor, and the report is the one of working it out every time."""
    from k3opt.passes._shared import rotary_match

    model = onnx.load(str(zoo_model(name)))
    calls = []
    real = rotary_match._angle_shape
    monkeypatch.setattr(rotary_match, "_angle_shape", lambda *a: calls.append(a) or real(*a))
    remembered, plain = Report(), Report()
    k3opt.api.optimize(model, report=remembered)
    once = len(calls)
    monkeypatch.setattr(rotary_match, "_known_angle_shape", lambda dims, verdicts, *a: rotary_match._angle_shape(dims, *a))
    k3opt.api.optimize(model, report=plain)
    remembered, plain = remembered.as_dict(), plain.as_dict()
    assert remembered["counters"]["rotary_found"] == plain["counters"]["rotary_found"] > 0
    assert (remembered["counters"], remembered["notes"], remembered["sites"]) == \
        (plain["counters"], plain["notes"], plain["sites"])
    assert 0 < once < len(calls) - once
