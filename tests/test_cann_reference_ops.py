"""The numpy reference NPU ops, each against an independent loop computing its documented semantics."""
from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import TensorProto as T, helper

from k3opt.targets.cann.npu_contract import ALL_TOKENS, template_mask
from k3opt.targets.cann.reference import evaluator

RNG = np.random.default_rng(0)


def run_node(op, inputs, attrs, domain="", opset=16, n_outputs=1):
    """Run one NPU node (inputs: name -> array, or None for an empty slot) in the reference evaluator."""
    names = [n if a is not None else "" for n, a in inputs]
    feeds = {n: a for n, a in inputs if a is not None}
    node = helper.make_node(op, names, [f"out{i}" for i in range(n_outputs)], domain=domain, **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, T.UNDEFINED, None) for n in feeds],
                              [helper.make_tensor_value_info(f"out{i}", T.UNDEFINED, None) for i in range(n_outputs)])
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(graph, opset_imports=imports)
    return evaluator(model).run(None, feeds)


def loop_attention(q, k, v, keep, scale, kv_heads):
    """Per (batch, head, query row): softmax over the keys ``keep`` allows, in float64; 0 for a row with none."""
    b_, n_, sq, d = q.shape
    out = np.zeros((b_, n_, sq, v.shape[-1]))
    for b in range(b_):
        for h in range(n_):
            g = h // (n_ // kv_heads)
            for i in range(sq):
                keys = [j for j in range(k.shape[2]) if keep(b, h, i, j)]
                if not keys:
                    continue
                s = [scale * float(np.dot(q[b, h, i].astype(np.float64), k[b, g, j])) for j in keys]
                top = max(s)
                w = [math.exp(x - top) for x in s]
                out[b, h, i] = sum(wi * v[b, g, j] for wi, j in zip(w, keys)) / sum(w)
    return out


def qkv(b=2, n=4, nkv=2, sq=5, skv=5, d=8, dtype=np.float32):
    return (RNG.standard_normal((b, n, sq, d)).astype(dtype), RNG.standard_normal((b, nkv, skv, d)).astype(dtype),
            RNG.standard_normal((b, nkv, skv, d)).astype(dtype))


def pfa(q, k, v, mask=None, **attrs):
    inputs = [("q", q), ("k", k), ("v", v)] + ([("pse", None), ("m", mask)] if mask is not None else [])
    return run_node("NPUPromptFlashAttention", inputs, {"num_heads": q.shape[1], "input_layout": "BNSD", **attrs})[0]


# -- NPURmsNorm ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, shape, gamma_shape", [(np.float32, (2, 3, 16), (16,)), (np.float16, (2, 3, 16), (16,)),
                                                       (np.float32, (2, 4, 6), (4, 6))])
def test_rmsnorm_is_the_plugin_formula(dtype, shape, gamma_shape):
    x = RNG.standard_normal(shape).astype(dtype)
    gamma = (1 + 0.1 * RNG.standard_normal(gamma_shape)).astype(dtype)
    y, rstd = run_node("NPURmsNorm", [("x", x), ("g", gamma)], {}, n_outputs=2)
    k = len(gamma_shape)
    flat = x.astype(np.float64).reshape(*shape[:-k], -1)
    want_rstd = 1 / np.sqrt((flat ** 2).mean(-1) + 1e-6)
    want = (flat * want_rstd[..., None]).reshape(shape) * gamma.astype(np.float64)
    assert y.dtype == dtype and rstd.dtype == np.float32 and rstd.shape == shape[:-k] + (1,) * k
    tol = 1e-2 if dtype == np.float16 else 1e-5
    np.testing.assert_allclose(y.astype(np.float64), want, rtol=tol, atol=tol)
    np.testing.assert_allclose(rstd.reshape(want_rstd.shape), want_rstd, rtol=1e-5)


def test_rmsnorm_in_the_npu_domain_and_its_refusal():
    x, g = RNG.standard_normal((2, 8)).astype(np.float32), np.ones(8, np.float32)
    y, _ = run_node("NPURmsNorm", [("x", x), ("g", g)], {}, domain="npu", opset=17, n_outputs=2)
    assert y.shape == (2, 8)
    with pytest.raises(Exception, match="trailing dims"):
        run_node("NPURmsNorm", [("x", x), ("g", np.ones(4, np.float32))], {}, n_outputs=2)


# -- NPUPromptFlashAttention --------------------------------------------------------------------------------------

def test_pfa_without_mask_attends_everything_gqa_heads_by_group():
    q, k, v = qkv()
    got = pfa(q, k, v, scale_value=0.3, num_key_value_heads=2)
    np.testing.assert_allclose(got, loop_attention(q, k, v, lambda *_: True, 0.3, 2), rtol=1e-5, atol=1e-5)


def test_pfa_mask_true_masks_out_and_all_tokens_band_keeps_the_rest():
    q, k, v = qkv()
    mask = RNG.random((2, 1, 5, 5)) < 0.3
    mask[..., 0] = False  # no row fully masked
    got = pfa(q, k, v, mask, scale_value=0.5, num_key_value_heads=2, pre_tokens=ALL_TOKENS, next_tokens=ALL_TOKENS)
    want = loop_attention(q, k, v, lambda b, h, i, j: not mask[b, 0, i, j], 0.5, 2)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_pfa_mask_with_the_plugins_default_tokens_computes_only_the_diagonal():
    """Through the plugin pre_tokens/next_tokens default to 0/0: with a mask, sparse_mode 0 keeps i == j only."""
    q, k, v = qkv()
    mask = np.zeros((5, 5), bool)
    got = pfa(q, k, v, mask, num_key_value_heads=2)
    np.testing.assert_allclose(got, loop_attention(q, k, v, lambda b, h, i, j: i == j, 1.0, 2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode, sq, skv", [(2, 4, 6), (3, 4, 6), (3, 5, 5), (3, 1, 7)])
def test_pfa_causal_sparse_modes_use_the_template(mode, sq, skv):
    q, k, v = qkv(sq=sq, skv=skv)
    got = pfa(q, k, v, template_mask(), sparse_mode=mode, num_key_value_heads=2, scale_value=0.2)
    offset = 0 if mode == 2 else skv - sq
    want = loop_attention(q, k, v, lambda b, h, i, j: j <= i + offset, 0.2, 2)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_pfa_fully_masked_row_is_zero_with_the_invalid_row_correction_else_nan():
    q, k, v = qkv(b=1, n=2, nkv=2, sq=3, skv=3)
    mask = np.zeros((1, 1, 3, 3), bool)
    mask[0, 0, 1] = True
    common = dict(num_key_value_heads=2, pre_tokens=ALL_TOKENS, next_tokens=ALL_TOKENS)
    fixed = pfa(q, k, v, mask, inner_precise=2, **common)
    assert np.all(fixed[:, :, 1] == 0) and np.all(np.isfinite(fixed))
    raw = pfa(q, k, v, mask, inner_precise=1, **common)
    assert np.all(np.isnan(raw[:, :, 1])) and not np.any(np.isnan(raw[:, :, [0, 2]]))


@pytest.mark.parametrize("layout", ["BSND", "BSH"])
def test_pfa_layouts_agree_with_bnsd(layout):
    q, k, v = qkv(nkv=4)
    want = pfa(q, k, v)

    def to(x):
        y = x.transpose(0, 2, 1, 3)
        return y if layout == "BSND" else y.reshape(y.shape[0], y.shape[1], -1)

    got = run_node("NPUPromptFlashAttention", [("q", to(q)), ("k", to(k)), ("v", to(v))],
                   {"num_heads": 4, "input_layout": layout})[0]
    np.testing.assert_allclose(got, to(want), rtol=1e-6)


@pytest.mark.parametrize("build, match", [
    (lambda q, k, v: [("q", q), ("k", k), ("v", v), ("pse", None)], "4 inputs"),
    (lambda q, k, v: [("q", q), ("k", k), ("v", v[..., :4])], "head dims"),
    (lambda q, k, v: [("q", q), ("k", k), ("v", v), ("pse", None), ("m", np.zeros((2, 4, 5, 5), bool))],
     "atten_mask shape"),
    (lambda q, k, v: [("q", q), ("k", k), ("v", v), ("pse", None), ("m", np.zeros((5, 5), np.float32))], "dtype"),
])
def test_pfa_refuses_what_the_contract_does_not_define(build, match):
    q, k, v = qkv(nkv=4)
    with pytest.raises(Exception, match=match):
        run_node("NPUPromptFlashAttention", build(q, k, v), {"num_heads": 4, "input_layout": "BNSD"})


def test_pfa_refuses_missing_required_attributes_and_unmodelled_modes():
    q, k, v = qkv(nkv=4)
    with pytest.raises(Exception, match="required"):
        run_node("NPUPromptFlashAttention", [("q", q), ("k", k), ("v", v)], {"num_heads": 4})
    with pytest.raises(Exception, match="sparse_mode 4"):
        pfa(q, k, v, template_mask(), sparse_mode=4)
    with pytest.raises(Exception, match="template"):
        pfa(q, k, v, np.zeros((5, 5), bool), sparse_mode=3)


@pytest.mark.parametrize("lengths", [[3], [4, 2], [1, 5, 9]])
def test_pfa_actual_seq_lengths_kv_keeps_each_batchs_first_keys(lengths):
    """[PFA-doc]: one length for every batch, or the first B of at least B; keys from the length on are ignored."""
    q, k, v = qkv(sq=1, skv=6)
    per_batch = (lengths * 2)[:2] if len(lengths) == 1 else lengths[:2]
    inputs = [("q", q), ("k", k), ("v", v), ("pse", None), ("m", None), ("lq", None),
              ("lkv", np.array(lengths, np.int64))]
    if max(per_batch) > 6:
        with pytest.raises(Exception, match="outside 0..6"):
            run_node("NPUPromptFlashAttention", inputs, {"num_heads": 4, "input_layout": "BNSD",
                                                         "num_key_value_heads": 2})
        return
    got = run_node("NPUPromptFlashAttention", inputs, {"num_heads": 4, "input_layout": "BNSD", "scale_value": 0.5,
                                                       "num_key_value_heads": 2})[0]
    want = loop_attention(q, k, v, lambda b, h, i, j: j < per_batch[b], 0.5, 2)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_pfa_actual_seq_lengths_and_a_mask_combine_and_cut_rows_are_refused():
    q, k, v = qkv(sq=2, skv=6)
    mask = np.zeros((2, 1, 2, 6), bool)
    mask[1, 0, :, 0] = True  # row 1 left-padded by one
    attrs = {"num_heads": 4, "input_layout": "BNSD", "num_key_value_heads": 2, "pre_tokens": ALL_TOKENS,
             "next_tokens": ALL_TOKENS}
    got = run_node("NPUPromptFlashAttention", [("q", q), ("k", k), ("v", v), ("pse", None), ("m", mask),
                                               ("lq", np.array([2], np.int64)), ("lkv", np.array([4], np.int64))],
                   attrs)[0]
    want = loop_attention(q, k, v, lambda b, h, i, j: j < 4 and not mask[b, 0, i, j], 1.0, 2)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="cut query rows"):
        run_node("NPUPromptFlashAttention", [("q", q), ("k", k), ("v", v), ("pse", None), ("m", mask),
                                             ("lq", np.array([1], np.int64)), ("lkv", None)], attrs)
    with pytest.raises(Exception, match="0 values for 2 batches"):
        run_node("NPUPromptFlashAttention", [("q", q), ("k", k), ("v", v), ("pse", None), ("m", mask),
                                             ("lq", None), ("lkv", np.array([], np.int64))], attrs)


# -- NPUIncreFlashAttention ---------------------------------------------------------------------------------------

def test_ifa_reads_one_kv_head_whatever_the_node_says():
    """The plugin never passes num_key_value_heads on: the kernel's default 1 holds (MQA)."""
    q, k, v = qkv(b=2, n=4, nkv=1, sq=1, skv=7)
    mask = np.zeros((2, 1, 1, 7), bool)
    mask[1, ..., :3] = True
    inputs = [("q", q), ("k", k), ("v", v), ("pse", None), ("m", mask), ("lens", None)]
    got = run_node("NPUIncreFlashAttention", inputs, {"num_heads": 4, "input_layout": "BNSD", "scale_value": 0.4,
                                                      "num_key_value_heads": 4})[0]
    want = loop_attention(q, k, v, lambda b, h, i, j: not mask[b, 0, 0, j], 0.4, 1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    q2, k2, v2 = qkv(b=2, n=4, nkv=2, sq=1, skv=7)
    with pytest.raises(Exception, match="num_key_value_heads 1"):
        run_node("NPUIncreFlashAttention", [("q", q2), ("k", k2), ("v", v2), ("pse", None), ("m", None),
                                            ("lens", None)], {"num_heads": 4, "input_layout": "BNSD"})
    with pytest.raises(Exception, match="S = 1"):
        q3, k3, v3 = qkv(b=1, n=4, nkv=1, sq=2, skv=7)
        run_node("NPUIncreFlashAttention", [("q", q3), ("k", k3), ("v", v3), ("pse", None), ("m", None),
                                            ("lens", None)], {"num_heads": 4, "input_layout": "BNSD"})


def test_every_npu_domain_op_has_a_reference_in_both_domains():
    """The ops the lowerings emit are registered by @reference_op in the default domain and in ``npu``."""
    from k3opt.targets.cann.atc_ops import NPU_DOMAIN_OPS
    from k3opt.targets.cann.reference import reference_ops

    registered = {(cls.__name__, cls.op_domain) for cls in reference_ops()}
    assert {(op, d) for op in NPU_DOMAIN_OPS for d in ("", "npu")} <= registered


def test_reference_op_registers_a_new_op_and_refuses_a_second_definition(monkeypatch):
    """A new module's ``@reference_op`` class is in the evaluator without editing any list; one op defined twice
    is an error, not a silent replacement."""
    from onnx.reference.op_run import OpRun

    from k3opt.targets.cann.reference import registry

    monkeypatch.setattr(registry, "_OPS", dict(registry._OPS))

    @registry.reference_op("NPUTestDouble")
    class Double(OpRun):
        def _run(self, x):  # noqa: D102
            return (2 * x,)

    x = RNG.standard_normal((2, 3)).astype(np.float32)
    for domain in ("", "npu"):
        np.testing.assert_array_equal(run_node("NPUTestDouble", [("x", x)], {}, domain=domain)[0], 2 * x)
    with pytest.raises(ValueError, match="defined twice"):
        registry.reference_op("NPUTestDouble")(Double)


def test_loop_without_a_condition_runs_its_trip_count():
    """The spec's ``Loop(M, "", ...)`` runs M times (onnx 1.23's reference ran none); onnxruntime agrees."""
    import onnxruntime as ort

    body = helper.make_graph([helper.make_node("Identity", ["c"], ["c_out"]), helper.make_node("Add", ["x", "one"], ["x2"])],
                             "body", [helper.make_tensor_value_info("i", T.INT64, []),
                                      helper.make_tensor_value_info("c", T.BOOL, []),
                                      helper.make_tensor_value_info("x", T.FLOAT, [2])],
                             [helper.make_tensor_value_info("c_out", T.BOOL, []),
                              helper.make_tensor_value_info("x2", T.FLOAT, [2])],
                             [helper.make_tensor("one", T.FLOAT, [], [1.0])])
    graph = helper.make_graph([helper.make_node("Loop", ["m", "", "x0"], ["y"], body=body)], "loop",
                              [helper.make_tensor_value_info("m", T.INT64, []),
                               helper.make_tensor_value_info("x0", T.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", T.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    feeds = {"m": np.array(3, np.int64), "x0": np.zeros(2, np.float32)}
    want = ort.InferenceSession(model.SerializeToString()).run(None, feeds)[0]
    assert np.array_equal(evaluator(model).run(None, feeds)[0], want) and want.tolist() == [3.0, 3.0]
