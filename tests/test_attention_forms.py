"""Attention as other exporters write it: heads folded into the batch (rank-3 scores: Megatron, 3-D BMM), and
tf2onnx/Keras BERT (``(1 - m) * -10000`` masks, int32 masks cast late); hand-made graphs, each verified against
onnxruntime with ``--opset 23`` (Attention emitted) and with the default opset (declined sites recorded)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T, helper as h, numpy_helper as nh

from k3opt import api
from k3opt.report import Report

B, H, S, D = 2, 4, 5, 8
HID = H * D


def _model(nodes, inputs, inits, opset: int = 17, out_shape=(B, S, HID)) -> onnx.ModelProto:
    graph = h.make_graph(nodes, "attn", inputs, [h.make_tensor_value_info("y", T.FLOAT, list(out_shape))],
                         [nh.from_array(v, k) for k, v in inits.items()])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)], ir_version=8)
    onnx.checker.check_model(model)
    return model


def _weights(rng) -> dict:
    return {f"w{n}": (rng.standard_normal((HID, HID)) * 0.2).astype(np.float32) for n in "qkv"}


def bmm3d(mask: str = "none", scale_on: str = "scores") -> onnx.ModelProto:
    """x [B,S,HID] -> q/k/v [B,H,S,D] -> view(B*H, S, D) -> bmm(q, k^T) -> softmax -> bmm(., v) -> [B,S,HID]."""
    rng = np.random.default_rng(0)
    inits = _weights(rng)
    inits.update({"split4": np.array([B, S, H, D], np.int64), "flat3": np.array([-1, S, D], np.int64),
                  "back4": np.array([B, H, S, D], np.int64), "out3": np.array([B, S, HID], np.int64),
                  "scale": np.array(1 / np.sqrt(D), np.float32)})
    nodes = []
    for n in "qkv":
        nodes += [h.make_node("MatMul", ["x", f"w{n}"], [f"{n}p"]),
                  h.make_node("Reshape", [f"{n}p", "split4"], [f"{n}s"]),
                  h.make_node("Transpose", [f"{n}s"], [f"{n}4"], perm=[0, 2, 1, 3]),
                  h.make_node("Reshape", [f"{n}4", "flat3"], [f"{n}3"])]
    nodes.append(h.make_node("Transpose", ["k3"], ["kt3"], perm=[0, 2, 1]))
    q = "q3"
    if scale_on == "q":
        nodes.append(h.make_node("Mul", ["q3", "scale"], ["q3s"]))
        q = "q3s"
    nodes.append(h.make_node("MatMul", [q, "kt3"], ["scores"]))
    last = "scores"
    if scale_on == "scores":
        nodes.append(h.make_node("Mul", [last, "scale"], ["scaled"]))
        last = "scaled"
    inputs = [h.make_tensor_value_info("x", T.FLOAT, [B, S, HID])]
    if mask == "causal":
        inits["causal"] = np.triu(np.full((S, S), np.finfo(np.float32).min, np.float32), 1)[None]
        nodes.append(h.make_node("Add", [last, "causal"], ["masked"]))
        last = "masked"
    elif mask == "per_head":
        inputs.append(h.make_tensor_value_info("m", T.FLOAT, [B * H, S, S]))
        nodes.append(h.make_node("Add", [last, "m"], ["masked"]))
        last = "masked"
    nodes += [h.make_node("Softmax", [last], ["probs"], axis=-1),
              h.make_node("MatMul", ["probs", "v3"], ["o3"]),
              h.make_node("Reshape", ["o3", "back4"], ["o4"]),
              h.make_node("Transpose", ["o4"], ["ot"], perm=[0, 2, 1, 3]),
              h.make_node("Reshape", ["ot", "out3"], ["y"])]
    return _model(nodes, inputs, inits)


def megatron() -> onnx.ModelProto:
    """Megatron's layout: x [S,B,HID] -> q/k/v [S,B,H,D] -> view(S, B*H, D) -> transpose(0,1) -> baddbmm form."""
    rng = np.random.default_rng(1)
    inits = _weights(rng)
    inits.update({"sbhd": np.array([S, B, H, D], np.int64), "sbh_d": np.array([S, B * H, D], np.int64),
                  "scale": np.array(1 / np.sqrt(D), np.float32), "bhsd": np.array([B, H, S, D], np.int64),
                  "out": np.array([S, B, HID], np.int64)})
    nodes = []
    for n in "qkv":
        nodes += [h.make_node("MatMul", ["x", f"w{n}"], [f"{n}p"]),
                  h.make_node("Reshape", [f"{n}p", "sbhd"], [f"{n}4"]),
                  h.make_node("Reshape", [f"{n}4", "sbh_d"], [f"{n}r"]),
                  h.make_node("Transpose", [f"{n}r"], [f"{n}3"], perm=[1, 0, 2])]
    nodes += [h.make_node("Transpose", ["k3"], ["kt3"], perm=[0, 2, 1]),
              h.make_node("MatMul", ["q3", "kt3"], ["scores"]),
              h.make_node("Mul", ["scores", "scale"], ["scaled"]),
              h.make_node("Softmax", ["scaled"], ["probs"], axis=-1),
              h.make_node("MatMul", ["probs", "v3"], ["o3"]),
              h.make_node("Reshape", ["o3", "bhsd"], ["o4"]),
              h.make_node("Transpose", ["o4"], ["ot"], perm=[2, 0, 1, 3]),
              h.make_node("Reshape", ["ot", "out"], ["y"])]
    return _model(nodes, [h.make_tensor_value_info("x", T.FLOAT, [S, B, HID])], inits, out_shape=(S, B, HID))


def _feeds(model: onnx.ModelProto) -> dict:
    rng = np.random.default_rng(5)
    feeds = {}
    for i in model.graph.input:
        shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
        if i.name == "m":
            feeds[i.name] = np.where(rng.random(shape) > 0.3, 0, -1e9).astype(np.float32)
        elif i.type.tensor_type.elem_type == T.INT32:
            m = (rng.random(shape) > 0.3).astype(np.int32)
            m[:, 0] = 1
            feeds[i.name] = m
        else:
            feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def _fused(model: onnx.ModelProto, opset: int = 23, **kw) -> tuple[onnx.ModelProto, Report]:
    report = Report()
    out = api.optimize(model, opset=opset, verify=True, input_data=_feeds(model), report=report, **kw)
    assert report.verification["status"] == "passed", report.verification
    return out, report


def test_heads_folded_with_an_input_mask_reaches_the_recogniser():
    """A per-head mask fed as an input may hold -inf rows, which Attention-23 zeroes and the graph does not:
    unfolded to rank 4, then declined for that reason (not for the rank)."""
    out, report = _fused(bmm3d("per_head"))
    assert any("declined" in n and "rank 3" not in n for n in report.notes), report.notes
    assert all(len(vi.type.tensor_type.shape.dim) != 3 for vi in out.graph.value_info if vi.name.endswith("softmax4"))


@pytest.mark.parametrize("build", [
    lambda: bmm3d(), lambda: bmm3d("causal"), lambda: bmm3d(scale_on="q"), megatron,
], ids=["bmm", "bmm-causal", "bmm-scaled-q", "megatron"])
def test_heads_folded_into_the_batch_fuse(build):
    out, report = _fused(build())
    ops = Counter(n.op_type for n in out.graph.node)
    assert ops["Attention"] == 1 and ops["Softmax"] == 0, (ops, report.notes)


def test_heads_folded_cann_lowers():
    out, report = _fused(bmm3d("causal"), opset=None, target="cann")
    assert report.lowering_verification["status"] == "passed"
    assert Counter(n.op_type for n in out.graph.node)["NPUPromptFlashAttention"] == 1, report.lowering


def test_rank3_not_from_heads_is_declined_and_recorded():
    """q/k/v that are not views of rank-4 head tensors: the rank-3 site stays and the report says why."""
    rng = np.random.default_rng(2)
    inits = {"wq": rng.standard_normal((D, D)).astype(np.float32), "wk": rng.standard_normal((D, D)).astype(np.float32)}
    nodes = [h.make_node("MatMul", ["x", "wq"], ["q"]), h.make_node("MatMul", ["x", "wk"], ["k"]),
             h.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]), h.make_node("MatMul", ["q", "kt"], ["s"]),
             h.make_node("Softmax", ["s"], ["p"], axis=-1), h.make_node("MatMul", ["p", "x"], ["y"])]
    model = _model(nodes, [h.make_tensor_value_info("x", T.FLOAT, [B, S, D])], inits, out_shape=(B, S, D))
    out, report = _fused(model)
    assert "Attention" not in {n.op_type for n in out.graph.node}
    assert any("declined" in n and "rank 3" in n for n in report.notes), report.notes
    assert "1 rank-3 attention(s) not unfolded to rank 4: q is not a view of a rank-4 (batch, heads, positions, " \
           "head dim) tensor" in "\n".join(report.notes), report.notes


def bmm3d_cache(mask: bool = False) -> onnx.ModelProto:
    """bmm3d's decode step: rank-3 caches [B*H, P, D] concatenated with the new keys/values, present outputs."""
    model = bmm3d()
    g = model.graph
    for n in g.node:
        if n.op_type == "Transpose" and list(n.input) == ["k3"]:
            n.input[0] = "present_k"
        if n.op_type == "MatMul" and list(n.input) == ["probs", "v3"]:
            n.input[1] = "present_v"
    cache = [h.make_node("Concat", [f"past_{n}", f"{n}3"], [f"present_{n}"], axis=1) for n in "kv"]
    at = next(i for i, n in enumerate(g.node) if n.op_type == "Transpose" and list(n.input) == ["present_k"])
    for node in reversed(cache):
        g.node.insert(at, node)
    g.input.extend(h.make_tensor_value_info(f"past_{n}", T.FLOAT, [B * H, "past", D]) for n in "kv")
    g.output.extend(h.make_tensor_value_info(f"present_{n}", T.FLOAT, [B * H, "total", D]) for n in "kv")
    if mask:  # a per-head float bias, fed as an input: it may hold rows of -inf
        g.input.append(h.make_tensor_value_info("m", T.FLOAT, [B * H, S, "total"]))
        add = next(n for n in g.node if n.op_type == "Softmax")
        g.node.insert(list(g.node).index(add), h.make_node("Add", ["scaled", "m"], ["masked"]))
        add.input[0] = "masked"
    onnx.checker.check_model(model)
    return model


def _cache_feeds(model: onnx.ModelProto, past: int = 3) -> dict:
    rng = np.random.default_rng(6)
    feeds = {"x": rng.standard_normal((B, S, HID)).astype(np.float32)}
    feeds.update({f"past_{n}": rng.standard_normal((B * H, past, D)).astype(np.float32) for n in "kv"})
    if any(i.name == "m" for i in model.graph.input):
        feeds["m"] = np.where(rng.random((B * H, S, S + past)) > 0.3, 0, -1e9).astype(np.float32)
    return feeds


def test_heads_folded_with_a_kv_cache_fuse_and_lower():
    """The rank-3 cache input is read as [B, H, P, D] (exact: the Concat gives it the new keys' B*H)."""
    model = bmm3d_cache()
    for options, op in (({"opset": 23}, "Attention"), ({"target": "cann"}, "NPUPromptFlashAttention")):
        report = Report()
        out = api.optimize(model, verify=True, input_data=_cache_feeds(model), report=report, **options)
        assert report.verification["status"] == "passed", report.verification
        assert (report.lowering_verification or {"status": "passed"})["status"] == "passed"
        assert Counter(n.op_type for n in out.graph.node)[op] == 1, (options, report.notes, report.lowering)


def test_float_masks_are_declined_with_the_reason():
    """An additive float mask fed as an input (rank 3 per head with a KV cache, unfolded first; rank 4): Attention-23
    zeroes a fully masked row, the graph need not, so each stays decomposed and the report says so."""
    rank4 = _model([h.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), h.make_node("MatMul", ["q", "kt"], ["s"]),
                    h.make_node("Add", ["s", "m"], ["sm"]), h.make_node("Softmax", ["sm"], ["p"], axis=-1),
                    h.make_node("MatMul", ["p", "v"], ["y"])],
                   [_vi4(n) for n in "qkv"] + [h.make_tensor_value_info("m", T.FLOAT, [B, 1, S, S])], {},
                   out_shape=(B, H, S, D))
    rng = np.random.default_rng(3)
    rank4_feeds = {n: rng.standard_normal((B, H, S, D)).astype(np.float32) for n in "qkv"}
    rank4_feeds["m"] = np.where(rng.random((B, 1, S, S)) > 0.3, 0, -1e9).astype(np.float32)
    for model, feeds in ((bmm3d_cache(mask=True), _cache_feeds(bmm3d_cache(mask=True))), (rank4, rank4_feeds)):
        report = Report()
        out = api.optimize(model, opset=23, verify=True, input_data=feeds, report=report)
        assert report.verification["status"] == "passed" and "Attention" not in {n.op_type for n in out.graph.node}
        assert any("attention(s) declined: the mask is of unknown form" in n for n in report.notes), report.notes
        report = Report()
        api.optimize(model, target="cann", verify=True, input_data=feeds, report=report)
        assert report.lowering_verification["status"] == "passed"
        assert any("kept decomposed: the mask is of unknown form" in n for n in report.lowering), report.lowering


def tf2onnx_bert(opset: int = 13, scale_op: str = "Mul", mask_kind: str = "int32") -> onnx.ModelProto:
    """A Keras/TF BERT attention as tf2onnx writes it: biased projections, Reshape [B,S,H,D], q Transpose
    [0,2,1,3] and k Transpose [0,2,3,1] (k^T at once), scores scaled after the MatMul, the mask an int32 [B,S]
    input Cast late, reshaped [B,1,1,S] and turned additive as ``(1 - m) * -10000``."""
    rng = np.random.default_rng(3)
    inits = _weights(rng)
    inits.update({f"b{n}": (rng.standard_normal(HID) * 0.1).astype(np.float32) for n in "qkv"})
    inits.update({"split4": np.array([-1, S, H, D], np.int64), "mask4": np.array([-1, 1, 1, S], np.int64),
                  "out3": np.array([-1, S, HID], np.int64), "one": np.array(1.0, np.float32),
                  "big": np.array(-10000.0, np.float32),
                  "dk": np.array(np.sqrt(D) if scale_op == "Div" else 1 / np.sqrt(D), np.float32)})
    nodes = []
    perms = {"q": [0, 2, 1, 3], "k": [0, 2, 3, 1], "v": [0, 2, 1, 3]}
    for n in "qkv":
        nodes += [h.make_node("MatMul", ["x", f"w{n}"], [f"{n}m"]), h.make_node("Add", [f"{n}m", f"b{n}"], [f"{n}p"]),
                  h.make_node("Reshape", [f"{n}p", "split4"], [f"{n}s"]),
                  h.make_node("Transpose", [f"{n}s"], [f"{n}t"], perm=perms[n])]
    mask_in = "mask"
    if mask_kind == "int32":
        nodes.append(h.make_node("Cast", ["mask"], ["mask_f"], to=T.FLOAT))
        mask_in = "mask_f"
    nodes += [h.make_node("Reshape", [mask_in, "mask4"], ["m4"]),
              h.make_node("Sub", ["one", "m4"], ["inv"]), h.make_node("Mul", ["inv", "big"], ["bias"]),
              h.make_node("MatMul", ["qt", "kt"], ["scores"]),
              h.make_node(scale_op, ["scores", "dk"], ["scaled"]),
              h.make_node("Add", ["scaled", "bias"], ["masked"]),
              h.make_node("Softmax", ["masked"], ["probs"], axis=3 if opset < 13 else -1),
              h.make_node("MatMul", ["probs", "vt"], ["ctx"]),
              h.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
              h.make_node("Reshape", ["ctx_t", "out3"], ["y"])]
    mask_type = T.INT32 if mask_kind == "int32" else T.FLOAT
    inputs = [h.make_tensor_value_info("x", T.FLOAT, ["batch", S, HID]),
              h.make_tensor_value_info("mask", mask_type, ["batch", S])]
    graph = h.make_graph(nodes, "tf_bert", inputs, [h.make_tensor_value_info("y", T.FLOAT, ["batch", S, HID])],
                         [nh.from_array(v, k) for k, v in inits.items()])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)], ir_version=7)
    onnx.checker.check_model(model)
    return model


def _bert_feeds(model):
    rng = np.random.default_rng(4)
    mask = (rng.random((B, S)) > 0.3).astype(np.int32)
    mask[:, 0] = 1
    if model.graph.input[1].type.tensor_type.elem_type == T.FLOAT:
        mask = mask.astype(np.float32)
    return {"x": rng.standard_normal((B, S, HID)).astype(np.float32), "mask": mask}


@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("scale_op", ["Mul", "Div"])
@pytest.mark.parametrize("mask_kind", ["int32", "float"])
def test_tf2onnx_bert_fuses(opset, scale_op, mask_kind):
    model = tf2onnx_bert(opset, scale_op, mask_kind)
    report = Report()
    out = api.optimize(model, opset=23, verify=True, input_data=_bert_feeds(model), report=report)
    assert report.verification["status"] == "passed"
    ops = Counter(n.op_type for n in out.graph.node)
    if mask_kind == "int32":  # (1 - m) * -10000 of an integer m is finite: no row is ever fully masked
        assert ops["Attention"] == 1 and ops["Softmax"] == 0, (ops, report.notes)
    else:  # a float m may hold inf: a row of -inf biases is NaN here and zeros in Attention
        assert ops["Attention"] == 0 and any("declined" in n and "mask" in n for n in report.notes), report.notes



def past_without_mask(mask: str = "none") -> onnx.ModelProto:
    """A decode step: keys and values Concat(past, new) on the sequence axis, no causal mask (one query), or an
    int32 padding mask [B, T] turned into a boolean keep mask late (Cast to bool, Where(keep, 0, lowest))."""
    rng = np.random.default_rng(6)
    inits = _weights(rng)
    inits.update({"split4": np.array([0, 1, H, D], np.int64), "out3": np.array([0, 1, HID], np.int64),
                  "scale": np.array(1 / np.sqrt(D), np.float32), "zero": np.array(0.0, np.float32),
                  "low": np.array(np.finfo(np.float32).min, np.float32), "m4": np.array([0, 1, 1, -1], np.int64)})
    nodes = []
    for n in "qkv":
        nodes += [h.make_node("MatMul", ["x", f"w{n}"], [f"{n}p"]), h.make_node("Reshape", [f"{n}p", "split4"], [f"{n}s"]),
                  h.make_node("Transpose", [f"{n}s"], [f"{n}t"], perm=[0, 2, 1, 3])]
    nodes += [h.make_node("Concat", ["past_k", "kt"], ["present_k"], axis=2),
              h.make_node("Concat", ["past_v", "vt"], ["present_v"], axis=2),
              h.make_node("Transpose", ["present_k"], ["kT"], perm=[0, 1, 3, 2]),
              h.make_node("MatMul", ["qt", "kT"], ["scores"]), h.make_node("Mul", ["scores", "scale"], ["scaled"])]
    last = "scaled"
    inputs = [h.make_tensor_value_info("x", T.FLOAT, ["batch", 1, HID]),
              h.make_tensor_value_info("past_k", T.FLOAT, ["batch", H, "past", D]),
              h.make_tensor_value_info("past_v", T.FLOAT, ["batch", H, "past", D])]
    if mask == "int32":
        inputs.append(h.make_tensor_value_info("mask", T.INT32, ["batch", "total"]))
        nodes += [h.make_node("Cast", ["mask"], ["keep"], to=T.BOOL), h.make_node("Reshape", ["keep", "m4"], ["keep4"]),
                  h.make_node("Where", ["keep4", "zero", "low"], ["bias"]),
                  h.make_node("Add", [last, "bias"], ["masked"])]
        last = "masked"
    nodes += [h.make_node("Softmax", [last], ["probs"], axis=-1), h.make_node("MatMul", ["probs", "present_v"], ["ctx"]),
              h.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
              h.make_node("Reshape", ["ctx_t", "out3"], ["y"])]
    outputs = [h.make_tensor_value_info("y", T.FLOAT, ["batch", 1, HID]),
               h.make_tensor_value_info("present_k", T.FLOAT, ["batch", H, "total", D]),
               h.make_tensor_value_info("present_v", T.FLOAT, ["batch", H, "total", D])]
    graph = h.make_graph(nodes, "decode", inputs, outputs, [nh.from_array(v, k) for k, v in inits.items()])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    return model


@pytest.mark.parametrize("mask", ["none", "int32"])
def test_past_without_a_causal_mask_fuses(mask):
    model = past_without_mask(mask)
    rng = np.random.default_rng(7)
    feeds = {"x": rng.standard_normal((B, 1, HID)).astype(np.float32),
             "past_k": rng.standard_normal((B, H, 3, D)).astype(np.float32),
             "past_v": rng.standard_normal((B, H, 3, D)).astype(np.float32)}
    if mask == "int32":
        feeds["mask"] = np.array([[1, 1, 1, 1], [0, 1, 1, 1]], np.int32)
    report = Report()
    out = api.optimize(model, opset=23, verify=True, input_data=feeds, report=report)
    assert report.verification["status"] == "passed"
    ops = Counter(n.op_type for n in out.graph.node)
    assert ops["Attention"] == 1 and ops["Softmax"] == 0, (ops, report.notes)


def _einsum_attention() -> onnx.ModelProto:
    """Keras MultiHeadAttention as tf2onnx writes it: Einsum for the scores and for probs @ v."""
    nodes = [h.make_node("Einsum", ["q", "k"], ["scores"], equation="aecd,abcd->acbe"),
             h.make_node("Softmax", ["scores"], ["probs"], axis=-1, name="keras_softmax"),
             h.make_node("Einsum", ["probs", "v"], ["y"], equation="acbe,aecd->abcd")]
    inputs = [h.make_tensor_value_info(n, T.FLOAT, [B, S, H, D]) for n in "qkv"]
    graph = h.make_graph(nodes, "einsum", inputs, [h.make_tensor_value_info("y", T.FLOAT, [B, S, H, D])])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 13)], ir_version=7)


def _core(q: str, k: str, v: str, out: str, tag: str) -> list[onnx.NodeProto]:
    return [h.make_node("Transpose", [k], [f"{tag}kt"], perm=[0, 1, 3, 2]),
            h.make_node("MatMul", [q, f"{tag}kt"], [f"{tag}s"]),
            h.make_node("Softmax", [f"{tag}s"], [f"{tag}p"], axis=-1, name=f"{tag}softmax"),
            h.make_node("MatMul", [f"{tag}p", v], [out])]


def _vi4(name: str, lead: tuple = ()) -> onnx.ValueInfoProto:
    return h.make_tensor_value_info(name, T.FLOAT, [*lead, B, H, S, D])


def _attention_in_a_body(kind: str = "if") -> onnx.ModelProto:
    """Attention in an If branch, a Loop body (on the carried tensor, M times) or a Scan body (per slice)."""
    inputs = [_vi4(n) for n in "kv"]
    if kind == "if":
        body = h.make_graph(_core("q", "k", "v", "o", "body_"), "then", [], [_vi4("o")])
        other = h.make_graph([h.make_node("Identity", ["v"], ["o2"])], "else", [], [_vi4("o2")])
        node = h.make_node("If", ["c"], ["y"], then_branch=body, else_branch=other)
        inputs = [h.make_tensor_value_info("c", T.BOOL, []), _vi4("q")] + inputs
    elif kind == "loop":
        body = h.make_graph([h.make_node("Identity", ["cond_in"], ["cond_out"])] + _core("x", "k", "v", "x2", "body_"),
                            "loop", [h.make_tensor_value_info("i", T.INT64, []),
                                     h.make_tensor_value_info("cond_in", T.BOOL, []), _vi4("x")],
                            [h.make_tensor_value_info("cond_out", T.BOOL, []), _vi4("x2")])
        node = h.make_node("Loop", ["n", "", "q"], ["y"], body=body)  # no cond: M iterations
        inputs = [h.make_tensor_value_info("n", T.INT64, []), _vi4("q")] + inputs
    else:
        body = h.make_graph(_core("qs", "k", "v", "ys", "body_"), "scan", [_vi4("qs")], [_vi4("ys")])
        node = h.make_node("Scan", ["q"], ["y"], body=body, num_scan_inputs=1)
        inputs = [_vi4("q", (2,))] + inputs
    out = _vi4("y", (2,) if kind == "scan" else ())
    model = h.make_model(h.make_graph([node], kind, inputs, [out]), opset_imports=[h.make_opsetid("", 17)],
                         ir_version=8)
    onnx.checker.check_model(model)
    return model


def _outer_products_in_a_body() -> onnx.ModelProto:
    """A body's Softmax between products the enclosing graph computes: not moved into the body."""
    body = h.make_graph([h.make_node("Softmax", ["s"], ["p"], axis=-1, name="inner_softmax"),
                         h.make_node("MatMul", ["p", "v"], ["o"])], "then", [], [_vi4("o")])
    other = h.make_graph([h.make_node("Identity", ["v"], ["o2"])], "else", [], [_vi4("o2")])
    nodes = [h.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), h.make_node("MatMul", ["q", "kt"], ["s"]),
             h.make_node("If", ["c"], ["y"], then_branch=body, else_branch=other)]
    inputs = [h.make_tensor_value_info("c", T.BOOL, [])] + [_vi4(n) for n in "qkv"]
    return h.make_model(h.make_graph(nodes, "outer", inputs, [_vi4("y")]), opset_imports=[h.make_opsetid("", 17)],
                        ir_version=8)


def _body_feeds(model: onnx.ModelProto) -> dict:
    rng = np.random.default_rng(9)
    feeds = {}
    for i in model.graph.input:
        shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
        feeds[i.name] = {T.BOOL: np.array(True), T.INT64: np.array(2, np.int64)}.get(
            i.type.tensor_type.elem_type, rng.standard_normal(shape).astype(np.float32))
    return feeds


@pytest.mark.parametrize("build,why", [(_einsum_attention, "scores come from a Einsum"),
                                       (_outer_products_in_a_body, "does not move the enclosing graph's work")])
def test_attention_shaped_sites_never_silent(build, why):
    report = Report()
    api.optimize(build(), report=report)  # opset 17: the Einsums stay (einsum-attention runs where Attention can follow)
    assert any("declined" in n and why in n for n in report.notes), report.notes


@pytest.mark.parametrize("kind", ["if", "loop", "scan"])
def test_attention_in_a_body_fuses_and_lowers(kind):
    """Inside an If branch, a Loop or a Scan body: Attention at opset 23, the NPU flash attention for cann, both
    verified (the cann reference evaluator runs a Loop without a condition M times, as onnxruntime does)."""
    model = _attention_in_a_body(kind)
    feeds = _body_feeds(model)
    for options, op in (({"opset": 23}, "Attention"), ({"target": "cann"}, "NPUPromptFlashAttention")):
        report = Report()
        out = api.optimize(model, verify=True, input_data=feeds, report=report, **options)
        assert report.verification["status"] == "passed", report.verification
        assert (report.lowering_verification or {"status": "passed"})["status"] == "passed"
        body = next(a.g for a in out.graph.node[0].attribute if a.type == onnx.AttributeProto.GRAPH and
                    any(n.op_type.startswith(("Attention", "NPU", "MatMul")) for n in a.g.node))
        assert [n.op_type for n in body.node if n.op_type != "Identity"] == [op], (options, report.notes)
    report = Report()
    api.optimize(model, report=report)
    assert "1 attention(s) found, left decomposed: opset < 23" in report.notes


def test_keras_einsum_attention_fuses():
    model = _einsum_attention()
    rng = np.random.default_rng(8)
    feeds = {n: rng.standard_normal((B, S, H, D)).astype(np.float32) for n in "qkv"}
    report = Report()
    out = api.optimize(model, opset=23, verify=True, input_data=feeds, report=report)
    assert report.verification["status"] == "passed"
    ops = Counter(n.op_type for n in out.graph.node)
    assert ops["Attention"] == 1 and ops["Einsum"] == 0, (ops, report.notes)
    report = Report()
    out = api.optimize(model, target="cann", verify=True, input_data=feeds, report=report)
    assert report.lowering_verification["status"] == "passed"
    assert Counter(n.op_type for n in out.graph.node)["NPUPromptFlashAttention"] == 1, report.lowering


@pytest.mark.parametrize("equation,plan", [
    ("aecd,abcd->acbe", (True, [0, 2, 1, 3], [0, 2, 3, 1], [0, 1, 2, 3])),
    ("acbe,aecd->abcd", (False, [0, 1, 2, 3], [0, 2, 1, 3], [0, 2, 1, 3])),
    ("bij,bjk->bik", (False, [0, 1, 2], [0, 1, 2], [0, 1, 2])),
    ("bij,bkj->bik", (False, [0, 1, 2], [0, 2, 1], [0, 1, 2])),
    ("bij,bjk->bi", None), ("ij,jk,kl->il", None), ("...ij,...jk->...ik", None), ("bii,bij->bij", None),
])
def test_einsum_matmul_plan(equation, plan):
    from k3opt.passes.fusion.einsum_attention import matmul_plan
    assert matmul_plan(equation) == plan


def _export_bmm_attention(path, layout: str) -> None:
    """A torch module computing attention on [B*H, S, D] with torch.bmm, exported by TorchScript (opset 14)."""
    import torch

    torch.manual_seed(0)

    class BmmAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(HID, 3 * HID)
            self.out = torch.nn.Linear(HID, HID)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            if layout == "megatron":  # x: [S, B, HID] -> [S, B*H, D] -> [B*H, S, D]
                s, b = x.shape[0], x.shape[1]
                q, k, v = (t.reshape(s, b * H, D).transpose(0, 1) for t in (q, k, v))
            else:  # x: [B, S, HID] -> [B, H, S, D] -> [B*H, S, D]
                b, s = x.shape[0], x.shape[1]
                q, k, v = (t.reshape(b, s, H, D).transpose(1, 2).reshape(b * H, s, D) for t in (q, k, v))
            scores = torch.bmm(q, k.transpose(1, 2)) / (D ** 0.5)
            o = torch.bmm(scores.softmax(-1), v)
            if layout == "megatron":
                o = o.transpose(0, 1).reshape(s, b, HID)
            else:
                o = o.reshape(b, H, s, D).transpose(1, 2).reshape(b, s, HID)
            return self.out(o)

    shape = (S, B, HID) if layout == "megatron" else (B, S, HID)
    torch.onnx.export(BmmAttention().eval(), (torch.randn(*shape),), str(path), input_names=["x"],
                      output_names=["y"], opset_version=14, dynamo=False)


@pytest.mark.parametrize("layout", ["megatron", "bmm"])
def test_exported_bmm_attention_fuses(layout, tmp_path):
    pytest.importorskip("torch")
    path = tmp_path / "m.onnx"
    _export_bmm_attention(path, layout)
    report = Report()
    out = api.optimize(str(path), opset=23, verify=True, report=report)
    assert report.verification["status"] == "passed"
    ops = Counter(n.op_type for n in out.graph.node)
    assert ops["Attention"] == 1 and ops["Softmax"] == 0, (ops, report.notes)


def test_softmax_wrapped_by_the_opset_13_adapter_unwraps_whatever_the_dims():
    """onnx's Softmax 12 -> 13 adapter writes Reshape(Softmax(Flatten(x, 3)), Shape(x)): with x's dims unknown
    the Reshape still restores x's shape (it is Shape(x)), so the Softmax is unwrapped to axis -1."""
    nodes = [h.make_node("Flatten", ["x"], ["f"], axis=3), h.make_node("Softmax", ["f"], ["p"], axis=-1),
             h.make_node("Shape", ["x"], ["s"]), h.make_node("Reshape", ["p", "s"], ["y"])]
    graph = h.make_graph(nodes, "wrapped", [h.make_tensor_value_info("x", T.FLOAT, [None] * 4)],
                         [h.make_tensor_value_info("y", T.FLOAT, None)])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=8)
    x = np.random.default_rng(9).standard_normal((2, 4, 5, 6)).astype(np.float32)
    report = Report()
    out = api.optimize(model, verify=True, input_data={"x": x}, report=report)
    assert report.verification["status"] == "passed"
    assert [n.op_type for n in out.graph.node] == ["Softmax"]


def test_hf_bert_exported_at_opset_11_fuses(tmp_path):
    """transformers' eager BERT exported by TorchScript at opset 11 (Softmax(axis=3), raised to 13 by onnx's
    adapter as Flatten/Softmax/Reshape): unwrapped, then fused into Attention at --opset 23."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=HID, num_hidden_layers=2, num_attention_heads=H,
                                  intermediate_size=64, attn_implementation="eager")
    bert = transformers.BertModel(cfg).eval()

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, ids, mask):
            return self.bert(input_ids=ids, attention_mask=mask).last_hidden_state

    ids = torch.randint(0, 100, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.int64)
    mask[1, 5:] = 0
    path = tmp_path / "bert11.onnx"
    torch.onnx.export(Wrapped().eval(), (ids, mask), str(path), input_names=["input_ids", "attention_mask"],
                      output_names=["y"], opset_version=11, dynamo=False,
                      dynamic_axes={"input_ids": {0: "b", 1: "s"}, "attention_mask": {0: "b", 1: "s"}})
    report = Report()
    out = api.optimize(str(path), opset=23, verify=True, report=report)
    assert report.verification["status"] == "passed"
    ops = Counter(n.op_type for n in out.graph.node)
    assert ops["Attention"] == 2 and ops["Softmax"] == 0, (ops, report.notes)
