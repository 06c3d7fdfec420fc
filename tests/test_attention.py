"""fuse-attention on hand-made graphs: each form the exporters emit becomes one Attention (opset 23) with the
original's outputs in onnxruntime, and each unsafe variant is left decomposed with its reason noted."""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto as TP
from onnx import helper
from onnx.reference import ReferenceEvaluator

from k3opt.pipeline import shapes
from k3opt.graph.ir import NameScope
from k3opt.passes._shared.attention_match import AttentionMatch, attention_rules
from k3opt.patterns import apply_rules
from k3opt.pipeline.pass_base import PassContext
from k3opt.plugins import get_pass
from tests.helpers import assert_equivalent, make_model, op_counts, random_feeds, run_passes

B, NQ, S, D = 2, 4, 5, 8
LOWEST = float(np.finfo(np.float32).min)


class Attn:
    """Writes one attention graph: ``Attn(...).model()``; options pick the exporter's spelling."""

    def __init__(self, *, scale="split", k_form="bnsd", kv_heads=NQ, repeat=False, mask="where_inf", guard=True,
                 dv=D, dqk=D, past=0, axis=-1, elem=TP.FLOAT, opset=23, mask_shape=(B, 1, S, S),
                 causal_value=None, dropout=False, extra_outputs=(), q_len=S, q_table=False, new_len=None):
        self.nodes, self.inits, self.inputs, self.outputs = [], {}, [], []
        self.elem, self.opset, self.np = elem, opset, helper.tensor_dtype_to_np_dtype(elem)
        new_len = q_len if new_len is None else new_len  # the new keys' length: q's in every real graph
        sk = past + new_len
        q = self.input("q", [B, NQ, q_len, dqk])
        if k_form == "bsnd":
            k = self.input("k", [B, new_len, kv_heads, dqk])
        else:
            k = self.input("k", [B, kv_heads, new_len, dqk])
        v = self.input("v", [B, kv_heads, new_len, dv])
        if past:
            pk, pv = self.input("past_k", [B, kv_heads, past, dqk]), self.input("past_v", [B, kv_heads, past, dv])
            k = self.op("Concat", pk, k, axis=2, out="present_k")
            v = self.op("Concat", pv, v, axis=2, out="present_v")
            self.outputs += [("present_k", elem, [B, kv_heads, sk, dqk]), ("present_v", elem, [B, kv_heads, sk, dv])]
        if repeat:
            k = self.repeat(k, NQ // kv_heads, merged=k_form == "batched5")
            v = self.repeat(v, NQ // kv_heads)
        if q_table:  # q times a constant table (a folded rotary factor): part of q, not a scale
            q = self.op("Mul", q, self.const(np.linspace(0.5, 1.5, q_len * dqk).reshape(q_len, dqk)))
        d4 = self.const(float(dqk) ** -0.25)
        if scale == "split":
            q = self.op("Mul", q, d4)
        if k_form == "bnsd":
            kt = self.op("Transpose", k, perm=[0, 1, 3, 2])
        elif k_form == "bsnd":
            kt = self.op("Transpose", k, perm=[0, 2, 3, 1])
        elif k_form == "batched5":  # the same, flattening GQA's rank-5 repeat directly (static shapes)
            flat = self.op("Reshape", k, self.ints([-1, sk, dqk]))
            kt = self.op("Reshape", self.op("Transpose", flat, perm=[0, 2, 1]), self.ints([B, NQ, dqk, sk]))
        elif k_form == "batched_const":  # the same once copy-reshape-dims made both targets constant: batch -1
            flat = self.op("Reshape", k, self.ints([-1, sk, dqk]))
            kt = self.op("Reshape", self.op("Transpose", flat, perm=[0, 2, 1]), self.ints([-1, kv_heads, dqk, sk]))
        else:  # dynamo: Reshape(Transpose(Reshape(k, [-1, S, D]), [0, 2, 1]), Shape(k)[:2] + [D, S])
            shape = self.op("Shape", k)
            flat = self.op("Reshape", k, self.op("Concat", self.ints([-1]), self.op("Slice", shape, self.ints([-2]),
                                                                                    self.ints([-1])),
                                                  self.ints([dqk]), axis=0))
            back = self.op("Concat", self.op("Slice", shape, self.ints([0]), self.ints([-2])), self.ints([dqk]),
                           self.op("Slice", shape, self.ints([-2]), self.ints([-1])), axis=0)
            kt = self.op("Reshape", self.op("Transpose", flat, perm=[0, 2, 1]), back)
        if scale == "split":
            kt = self.op("Mul", kt, d4)
        scores = self.op("MatMul", q, kt, out="scores")
        if scale == "div":
            scores = self.op("Div", scores, self.const(float(dqk) ** 0.5))
        elif scale == "mul":
            scores = self.op("Mul", scores, self.const(float(dqk) ** -0.5))
        elif scale == "input":
            scores = self.op("Div", scores, self.input("divisor", []))
        elif scale == "vector":
            scores = self.op("Mul", scores, self.const(np.full(sk, dqk ** -0.5)))

        x = scores
        if mask is not None:
            x = self.op("Add", x, self.mask(mask, mask_shape, q_len, sk, causal_value))
        probs = self.op("Softmax", x, out="probs", **({} if axis is None else {"axis": axis}))
        if guard:
            probs = self.op("Where", self.op("IsNaN", probs), self.const(0.0), probs)
        if dropout:
            probs = self.op("Dropout", probs, self.const(0.1), self.ints_scalar(True), out="dropped")
        y = self.op("MatMul", probs, v, out="y")
        self.outputs.insert(0, ("y", elem, [B, NQ, q_len, dv]))
        for name in extra_outputs:
            if name == "scores_reader":
                self.outputs.append((self.op("ReduceMax", scores, self.ints([-1])), elem, [B, NQ, q_len, 1]))
            else:
                self.outputs.append((name, elem, [B, NQ, q_len, sk]))

    def input(self, name, shape, elem=None):
        self.inputs.append((name, self.elem if elem is None else elem, shape))
        return name

    def const(self, value, dtype=None):
        name = f"c{len(self.inits)}"
        self.inits[name] = np.asarray(value, dtype=dtype or self.np)
        return name

    def ints(self, value):
        return self.const(value, np.int64)

    def ints_scalar(self, value):
        return self.const(value, np.bool_)

    def op(self, op, *inputs, out=None, **attrs):
        out = out or f"t{len(self.nodes)}"
        self.nodes.append(helper.make_node(op, list(inputs), [out], name=f"n{len(self.nodes)}_{op}", **attrs))
        return out

    def repeat(self, x, rep, merged=False):
        """repeat_kv: Reshape(Expand(Unsqueeze(x, 2), [B, H, rep, S, D]), [B, H*rep, S, D]), shapes from Shape(x)
        (``merged``: the rank-5 Expand, its Reshape left to the next one)."""
        shape = self.op("Shape", x)
        dims = [self.op("Gather", shape, self.ints([i]), axis=0) for i in range(4)]
        target = self.op("Concat", dims[0], dims[1], self.ints([rep]), dims[2], dims[3], axis=0)
        expanded = self.op("Expand", self.op("Unsqueeze", x, self.ints([2])), target)
        if merged:
            return expanded
        merged = self.op("Concat", dims[0], self.ints([NQ]), dims[2], dims[3], axis=0)
        return self.op("Reshape", expanded, merged)

    def mask(self, kind, shape, q_len, sk, causal_value):
        if kind == "float_input":
            return self.input("mask", list(shape))
        if kind == "causal":
            keep = np.tril(np.ones((q_len, sk), bool), sk - q_len) if causal_value is None else causal_value
            return self.const(np.where(keep, 0.0, -np.inf))
        fill = {"where_inf": -np.inf, "where_min": float(np.finfo(self.np).min), "where_small": -1e4}[kind]
        keep = self.input("keep", list(shape), TP.BOOL)
        return self.op("Where", keep, self.const(0.0), self.const(fill))

    def model(self):
        """The checked model with inferred intermediate shapes (as the pass manager's refresh gives them)."""
        model = make_model(self.nodes, self.inputs, self.outputs, self.inits, opset=self.opset)
        return onnx.shape_inference.infer_shapes(model)


def fuse(model, target="onnx"):
    return run_passes(model, [get_pass("fuse-attention")()], target=target)


def feeds_for(model, full_rows=True, seed=0):
    """Random inputs; with ``full_rows`` the keep mask has a fully masked query row (and one fully open)."""
    feeds = random_feeds(model, seed)
    keep = feeds.get("keep")
    if keep is not None and full_rows and keep.ndim == 4:
        keep[...] = True
        keep[1, ..., -1, :] = False
        keep[0, ..., -1, -2:] = False
    return feeds


def attention_nodes(model):
    return [n for n in model.graph.node if n.op_type == "Attention"]


def assert_fused(model, feeds=None, tol=1e-5, **want):
    """One Attention, no Softmax left, the original's outputs; the pass is idempotent."""
    out, pm, ctx = fuse(model)
    (node,) = attention_nodes(out)
    assert "Softmax" not in op_counts(out)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    for key, value in want.items():
        assert attrs.get(key) == pytest.approx(value) if isinstance(value, float) else attrs.get(key) == value, key
    assert_equivalent(model, out, feeds=feeds if feeds is not None else feeds_for(model), rtol=tol, atol=tol / 10)
    again, pm2, _ = fuse(out)
    assert pm.stats["fuse-attention"].rewrites == 1 and pm2.stats["fuse-attention"].rewrites == 0
    return out, node, ctx


def assert_declined(model, reason: str, target="onnx"):
    """Nothing rewritten, and the report note names the reason."""
    out, pm, ctx = fuse(model, target)
    assert pm.stats["fuse-attention"].rewrites == 0 and not attention_nodes(out)
    assert any(reason in n for n in ctx.notes), ctx.notes
    return ctx


# -- forms ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scale", ["split", "div", "mul"])
@pytest.mark.parametrize("k_form", ["bnsd", "bsnd", "batched", "batched_const"])
def test_scale_and_key_transpose_forms(scale, k_form):
    """sdpa's split d^-1/4 on q and k, eager's Div/Mul after the MatMul; k^T of BNSD and BSND keys, dynamo's 3-D."""
    _, node, _ = assert_fused(Attn(scale=scale, k_form=k_form).model(), scale=D ** -0.5)
    assert len(node.input) == 4  # q, k, v, attn_mask


def test_gqa_repeat_kv_is_absorbed():
    out, node, _ = assert_fused(Attn(kv_heads=2, repeat=True).model(), q_num_heads=NQ, kv_num_heads=2)
    assert not {"Expand", "Unsqueeze", "Reshape"} & set(op_counts(out))
    assert node.input[1] == "k" and node.input[2] == "v"


def test_gqa_repeat_flattened_by_the_batched_transpose():
    """dynamo with static shapes: merge-reshapes leaves Reshape(Expand(...), [-1, S, D]) under the transpose."""
    out, node, _ = assert_fused(Attn(kv_heads=2, repeat=True, k_form="batched5").model(), kv_num_heads=2)
    assert node.input[1] == "k" and "Expand" not in op_counts(out)


def test_mqa_by_broadcast():
    assert_fused(Attn(kv_heads=1).model(), q_num_heads=NQ, kv_num_heads=1)


def test_mla_head_dims_differ():
    """DeepSeek-V3's MLA: qk head dim 12 (nope 8 + rope 4), v head dim 8."""
    assert_fused(Attn(dqk=12, dv=8, scale="mul").model(), scale=12 ** -0.5)


def test_q_times_a_constant_table_is_part_of_q():
    _, node, _ = assert_fused(Attn(scale="div", q_table=True).model(), scale=D ** -0.5)


def test_no_mask():
    _, node, _ = assert_fused(Attn(mask=None, guard=False).model())
    assert len(node.input) == 3


def test_eager_lowest_fill_without_guard_keeps_uniform_rows():
    """finfo.min fill: a fully masked row is uniform in the graph; onnxruntime's Attention would zero a row of
    lowest values, so the mask is rebuilt with the next larger value (the feeds hold such a row)."""
    model = Attn(scale="mul", mask="where_min", guard=False).model()
    out, node, _ = assert_fused(model)
    (where,) = [n for n in out.graph.node if n.op_type == "Where"]
    fill = next(i for i in out.graph.initializer if i.name == where.input[2])
    assert onnx.numpy_helper.to_array(fill) == np.nextafter(np.float32(LOWEST), np.float32(0))


def test_sdpa_inf_fill_with_guard_zeroes_rows_like_attention():
    assert_fused(Attn(mask="where_inf", guard=True).model())


def test_moderate_fill_is_kept():
    """A finite fill above the dtype's lowest (BERT's old -10000) is added as it is."""
    assert_fused(Attn(mask="where_small", guard=False).model())


def test_padding_mask_over_keys_only_is_expanded_to_the_query_length():
    """A (B, 1, 1, Skv) mask broadcasts over the queries; onnxruntime's Attention wants (.., Sq, Skv)."""
    out, node, _ = assert_fused(Attn(mask_shape=(B, 1, 1, S)).model())
    assert "Expand" in op_counts(out)


@pytest.mark.parametrize("shape", [(S,), (S, S), (NQ, 1, S)])
def test_masks_of_lower_rank(shape):
    out, node, _ = assert_fused(Attn(mask_shape=shape).model(), feeds=None)
    assert len(node.input) == 4


def test_exact_causal_mask_becomes_is_causal():
    out, node, _ = assert_fused(Attn(mask="causal", guard=False).model(), is_causal=1)
    assert len(node.input) == 3


def test_causal_mask_repeated_over_the_batch_becomes_is_causal():
    keep = np.broadcast_to(np.tril(np.ones((S, S), bool)), (B, 1, S, S))
    assert_fused(Attn(mask="causal", guard=False, causal_value=keep).model(), is_causal=1)


def test_non_triangular_causal_mask_stays_a_mask():
    """An upper triangle is not causal: no is_causal; no row is fully masked, so the mask is fused as it is."""
    keep = np.triu(np.ones((S, S), bool))
    out, node, _ = assert_fused(Attn(mask="causal", guard=True, causal_value=keep).model())
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs.get("is_causal", 0) == 0 and len(node.input) == 4


def test_causal_with_past_keeps_its_mask():
    """Decode: keys Concat(past, new), the causal mask over past + new bottom-right aligned. The op gets
    past_key/past_value and the new keys, and the mask as it is (is_causal is kept for constant square masks);
    its present outputs are the graph's."""
    model = Attn(mask="causal", guard=False, past=3, q_len=2).model()
    seen = []
    out, node, _ = assert_fused(model)
    assert list(node.input[4:]) == ["past_k", "past_v"] and node.input[3] and "Concat" not in op_counts(out)
    assert list(node.output[1:]) == ["present_k", "present_v"]
    recognise(model, seen.append)
    assert seen[0].mask.causal_only


def test_square_causal_over_a_cache_keeps_its_mask():
    """q of 5 over 3 cached + 2 new keys, a constant square causal mask: where is_causal aligns with past_key
    given (upper left in the spec's text, offset by the past in onnxruntime) would matter, so the mask is
    passed as it is (found in review)."""
    out, node, _ = assert_fused(Attn(mask="causal", guard=False, past=3, q_len=5, new_len=2).model())
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs.get("is_causal", 0) == 0 and node.input[3]


@pytest.mark.parametrize("kv_heads, repeat", [(NQ, False), (2, True)], ids=["mha", "gqa"])
def test_decode_with_padding_mask_gets_the_cache_as_past(kv_heads, repeat):
    """One new token after 4 cached (a fully masked row included): Attention(q, k, v, mask, past_k, past_v),
    its present outputs replacing the Concats (graph outputs); GQA's repeat after the Concat is absorbed."""
    model = Attn(past=4, q_len=1, mask_shape=(B, 1, 1, 5), kv_heads=kv_heads, repeat=repeat).model()
    out, node, _ = assert_fused(model)
    assert list(node.input) == ["q", "k", "v", node.input[3], "past_k", "past_v"]
    assert list(node.output[1:]) == ["present_k", "present_v"] and "Concat" not in op_counts(out)


def test_cache_read_elsewhere_is_passed_concatenated():
    """A Concat of the cache with another reader stays: the op reads it as k and v (no past inputs)."""
    a = Attn(past=4, q_len=1, mask_shape=(B, 1, 1, 5))
    a.outputs.append((a.op("ReduceMax", "present_k", a.ints([-1])), TP.FLOAT, [B, NQ, 5, 1]))
    out, node, ctx = assert_fused(a.model())
    assert node.input[1] == "present_k" and node.input[2] == "present_v" and len(node.input) == 4
    assert any("reads the concatenated KV cache: the cache Concat 'present_k' is also read by" in n for n in ctx.notes)


def test_mask_from_the_cache_length_keeps_the_concat_for_it():
    """The mask's keep is expanded to Shape(present_k)'s length: reading the op's present output would be a
    cycle, so the Concat stays for the mask and the graph output (the op still gets the cache as past)."""
    a = Attn(past=4, q_len=1, mask_shape=(B, 1, 1, 1))
    where = next(i for i, n in enumerate(a.nodes) if n.op_type == "Where")
    first = len(a.nodes)
    length = a.op("Shape", "present_k", start=2, end=3)
    a.nodes[where].input[0] = a.op("Expand", "keep", a.op("Concat", a.ints([1, 1, 1]), length, axis=0))
    moved = a.nodes[first:]
    del a.nodes[first:]
    a.nodes[where:where] = moved  # before the Where that reads them
    out, node, _ = assert_fused(a.model())
    assert list(node.input[4:]) == ["past_k", "past_v"] and op_counts(out)["Concat"] >= 1
    assert "present_k" not in node.output


def recognise(model, record):
    """Run the recogniser with ``record(op, am)`` as its rewrite (which declines)."""
    graph = gs.import_onnx(model)
    shapes.ShapeRefresher()(graph)
    ctx = PassContext(opset=23, names=NameScope(graph))
    assert apply_rules(graph, ctx, attention_rules(lambda op, am: record(am)), bodies=True) == 0


def test_recogniser_describes_the_decode_cache():
    model = Attn(past=4, q_len=1, mask_shape=(B, 1, 1, 5), kv_heads=2, repeat=True).model()
    seen: list[AttentionMatch] = []

    def record(am):
        seen.append(am)

    recognise(model, record)
    (am,) = seen
    cache = am.cache
    assert (cache.past_key.name, cache.new_key.name, cache.present_key.name) == ("past_k", "k", "present_k")
    assert (cache.past_value.name, cache.new_value.name, cache.present_value.name) == ("past_v", "v", "present_v")
    assert (am.q_num_heads, am.kv_num_heads, am.head_dim_qk, am.head_dim_v) == (NQ, 2, D, D)
    assert am.scale == pytest.approx(D ** -0.5) and am.mask.zero_fully_masked and am.mask.fill == float("-inf")
    assert am.mask.keep.name == "keep" and not am.mask.causal_only and am.dtype == TP.FLOAT


@pytest.mark.parametrize("mask", ["where_inf", "where_min"])
def test_float16(mask):
    """fp16, the fill -inf or float16's lowest (rebuilt as the next larger value). onnxruntime's CPU provider
    runs the decomposed fp16 Add and Softmax in float32 (no fp16 kernels), so its fully masked rows are not
    the uniform rows float16 arithmetic gives: those are compared in the reference evaluator."""
    model = Attn(elem=TP.FLOAT16, mask=mask, guard=mask == "where_inf").model()
    out, _, _ = assert_fused(model, feeds=feeds_for(model, full_rows=False), tol=1e-2)
    feeds = feeds_for(model)
    want, got = ReferenceEvaluator(model).run(None, feeds)[0], ReferenceEvaluator(out).run(None, feeds)[0]
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=1e-2, atol=1e-3)


# -- refusals ------------------------------------------------------------------------------------------------

def test_softmax_over_another_axis():
    assert_declined(Attn(axis=2).model(), "not the last (keys) axis")


def test_softmax_default_axis_before_opset_13_is_not_the_keys():
    """Opset 12's Softmax defaults to axis 1 (over the flattened heads, queries and keys)."""
    model = Attn(opset=12, axis=None, guard=False, mask=None).model()
    out, pm, ctx = fuse(model)
    assert ctx.counters.get("attention_found", 0) == 0
    assert any("not the last (keys) axis" in n for n in ctx.notes)


def test_non_constant_scale():
    assert_declined(Attn(scale="input").model(), "scaled by a non-constant")


def test_scale_that_is_not_a_scalar():
    assert_declined(Attn(scale="vector").model(), "not a float scalar")


def test_mask_that_broadcasts_the_scores():
    """A mask with 3 query rows for scores of 1 would make the result larger."""
    assert_declined(Attn(q_len=1, mask_shape=(B, 1, 3, 1)).model(), "broadcasts the scores")


def test_mask_of_higher_rank():
    assert_declined(Attn(mask_shape=(1, B, 1, S, S)).model(), "rank 5")


def test_probabilities_as_graph_output():
    assert_declined(Attn(guard=False, extra_outputs=("probs",)).model(), "is a graph output")


def test_second_reader_of_the_scores():
    assert_declined(Attn(extra_outputs=("scores_reader",)).model(), "is also read by")


def test_dropout_in_training_mode():
    assert_declined(Attn(dropout=True).model(), "Dropout")


def test_unsupported_dtype():
    assert_declined(Attn(elem=TP.DOUBLE).model(), "DOUBLE")


def test_inf_fill_without_guard_is_declined():
    """The graph gives NaN for a fully masked row, Attention zeros: not the same for every input."""
    assert_declined(Attn(mask="where_inf", guard=False).model(), "without the IsNaN guard")


def test_non_triangular_inf_mask_without_guard_is_declined():
    """Claimed causal but shifted by one: row 0 is fully masked (NaN in the graph)."""
    keep = np.tril(np.ones((S, S), bool), -1)
    assert_declined(Attn(mask="causal", guard=False, causal_value=keep).model(), "without the IsNaN guard")


def test_mask_of_unknown_form_is_declined():
    assert_declined(Attn(mask="float_input").model(), "unknown form")


# -- below opset 23 / other targets ---------------------------------------------------------------------------

def test_below_opset_23_counted_and_left_decomposed():
    model = Attn(opset=21).model()
    out, pm, ctx = fuse(model)
    assert pm.stats["fuse-attention"].rewrites == 0 and not attention_nodes(out)
    assert ctx.counters["attention_found"] == 1
    assert ctx.notes == ["1 attention(s) found, left decomposed: opset < 23"]


def test_cann_target_counted_and_left_decomposed():
    out, pm, ctx = fuse(Attn().model(), target="cann")
    assert not attention_nodes(out) and ctx.notes == ["1 attention(s) found, left decomposed: target cann (its lowering passes decide, see the lowering lines)"]


# -- cost -----------------------------------------------------------------------------------------------------

class _CountingList(list):
    """A node list that counts the walks over it."""

    walks = 0

    def __iter__(self):
        _CountingList.walks += 1
        return super().__iter__()


def _parallel_attentions(n: int) -> onnx.ModelProto:
    """``n`` independent attentions in one graph (their inputs and outputs renamed apart)."""
    one = Attn(scale="mul", mask="where_min", guard=False, kv_heads=2, repeat=True).model()
    graph = onnx.GraphProto()
    for i in range(n):
        part = onnx.compose.add_prefix(one, f"a{i}_")
        graph.node.extend(part.graph.node)
        graph.input.extend(part.graph.input)
        graph.output.extend(part.graph.output)
        graph.initializer.extend(part.graph.initializer)
    return onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=one.opset_import,
                                                               ir_version=one.ir_version))


@pytest.mark.parametrize("n", [2, 8])
def test_walks_over_the_graph_do_not_grow_with_the_attentions(n):
    """One sweep finds its anchors once and edits the node list once, however many attentions match."""
    graph = gs.import_onnx(_parallel_attentions(n))
    graph.nodes = _CountingList(graph.nodes)
    ctx = PassContext(opset=23, names=NameScope(graph))
    _CountingList.walks = 0
    from k3opt.passes.fusion.fuse_attention import to_attention
    assert apply_rules(graph, ctx, attention_rules(to_attention), bodies=True) == n
    assert _CountingList.walks <= 5  # and one (without a census) to find the If/Loop/Scan bodies it also sweeps


def test_attention_24_reads_the_head_counts_from_the_shapes():
    """From opset 24 Attention refuses q_num_heads/kv_num_heads with 4-D inputs (onnx's conformance case
    flexattention_expanded_ver26 is such a graph): the fused node omits them there, and still does GQA."""
    out, node, _ = assert_fused(Attn(kv_heads=2, repeat=True, opset=24).model(), q_num_heads=None, kv_num_heads=None)
    onnx.checker.check_model(out, full_check=True)


def test_mixed_precision_scores_are_declined_with_the_reason():
    """TorchScript's float16 export of torch's CPU sdpa: the fp16 scores are Cast to float32, the softmax and
    probs @ Cast(v) run in float32. Attention-23 (softmax_precision or not) casts the probabilities back to
    float16 before probs @ v: not the same computation, so it is declined, by name."""
    h = TP.FLOAT16
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["s16"]),
        helper.make_node("Cast", ["s16"], ["s"], to=TP.FLOAT),
        helper.make_node("Where", ["keep", "zero", "fill"], ["mask"]),
        helper.make_node("Add", ["s", "mask"], ["x"]),
        helper.make_node("Softmax", ["x"], ["p"], axis=-1),
        helper.make_node("Cast", ["v"], ["v32"], to=TP.FLOAT),
        helper.make_node("MatMul", ["p", "v32"], ["y"]),
    ]
    shape = [B, NQ, S, D]
    model = make_model(nodes, [("q", h, shape), ("k", h, shape), ("v", h, shape), ("keep", TP.BOOL, [B, 1, S, S])],
                       [("y", TP.FLOAT, shape)], {"zero": np.float32(0), "fill": np.float32(-np.inf)}, opset=23)
    assert_declined(onnx.shape_inference.infer_shapes(model), "Attention-23 rounds the probabilities")
