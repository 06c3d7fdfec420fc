"""k3opt's own outputs optimize again: opset-23 Attention/RMSNormalization/RotaryEmbedding reach opsets below 23
(and the NPU) through their decomposed forms, a cann output keeps its NPU nodes, and a second run changes
nothing in the graph."""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T, helper as h, numpy_helper as nh

from k3opt import api
from k3opt.errors import UsageError
from k3opt.report import Report
from tests.zoo import DECODE_NAMES, EAGER_NAMES, EXPORTERS, NAMES, needs_torch, zoo_decode_model, zoo_model

B, H, KV, S, P, D = 2, 4, 2, 3, 2, 8


def _vi(name, dtype, shape):
    return h.make_tensor_value_info(name, dtype, shape)


def opset23_model(mask: str = "bool", past: bool = True, kv: int = KV, position_ids: bool = True) -> onnx.ModelProto:
    """x -> RMSNormalization -> q/k/v projections -> RotaryEmbedding(q, k) -> Attention (GQA, past, mask)."""
    rng = np.random.default_rng(0)
    hidden = H * D
    inits = {
        "w_norm": (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32),
        "wq": rng.standard_normal((hidden, H * D)).astype(np.float32) * 0.2,
        "wk": rng.standard_normal((hidden, kv * D)).astype(np.float32) * 0.2,
        "wv": rng.standard_normal((hidden, kv * D)).astype(np.float32) * 0.2,
        "shape_q": np.array([0, 0, H, D], np.int64), "shape_kv": np.array([0, 0, kv, D], np.int64),
    }
    angles = np.arange(16)[:, None] * (1.0 / 10000 ** (np.arange(0, D, 2) / D))[None]
    inits["cos"], inits["sin"] = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    nodes = [h.make_node("RMSNormalization", ["x", "w_norm"], ["xn"], axis=-1, epsilon=1e-6)]
    for name, w, shape in (("q", "wq", "shape_q"), ("k", "wk", "shape_kv"), ("v", "wv", "shape_kv")):
        nodes += [h.make_node("MatMul", ["xn", w], [f"{name}_p"]),
                  h.make_node("Reshape", [f"{name}_p", shape], [f"{name}_s"]),
                  h.make_node("Transpose", [f"{name}_s"], [f"{name}_t"], perm=[0, 2, 1, 3])]
    pos = ["pos"] if position_ids else []
    nodes += [h.make_node("RotaryEmbedding", ["q_t", "cos", "sin"] + pos, ["q_r"]),
              h.make_node("RotaryEmbedding", ["k_t", "cos", "sin"] + pos, ["k_r"])]
    inputs = [_vi("x", T.FLOAT, [B, S, hidden]), _vi("pos", T.INT64, [B, S])]
    ins = ["q_r", "k_r", "v_t", "mask" if mask else ""]
    outputs = [_vi("y", T.FLOAT, [B, H, S, D])]
    total = S + (P if past else 0)
    if mask:
        inputs.append(_vi("mask", T.BOOL if mask == "bool" else T.FLOAT, [B, 1, S, total]))
    if past:
        ins += ["past_k", "past_v"]
        inputs += [_vi("past_k", T.FLOAT, [B, kv, P, D]), _vi("past_v", T.FLOAT, [B, kv, P, D])]
        outputs += [_vi("present_k", T.FLOAT, [B, kv, total, D]), _vi("present_v", T.FLOAT, [B, kv, total, D])]
    nodes.append(h.make_node("Attention", ins, [o.name for o in outputs], q_num_heads=H, kv_num_heads=kv,
                             scale=0.3))
    graph = h.make_graph(nodes, "g23", inputs, outputs, [nh.from_array(v, k) for k, v in inits.items()])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 23)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model


def _feeds(model: onnx.ModelProto) -> dict:
    rng = np.random.default_rng(1)
    feeds = {}
    for i in model.graph.input:
        shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
        if i.name == "pos":
            feeds[i.name] = np.tile(np.arange(P, P + S), (B, 1)).astype(np.int64)
        elif i.type.tensor_type.elem_type == T.BOOL:
            keep = rng.random(shape) > 0.3
            keep[..., 0] = True
            feeds[i.name] = keep
        elif i.name == "mask":
            feeds[i.name] = np.where(rng.random(shape) > 0.3, 0.0, -1e4).astype(np.float32)
        else:
            feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


@pytest.mark.parametrize("mask", ["bool", "float", None])
@pytest.mark.parametrize("past", [True, False])
def test_opset23_ops_reach_opset_17_exactly(mask, past):
    model = opset23_model(mask, past)
    report = Report()
    out = api.optimize(model, opset=17, verify=True, input_data=_feeds(model), report=report)
    assert report.verification["status"] == "passed", report.verification
    ops = {n.op_type for n in out.graph.node}
    assert not ops & {"Attention", "RMSNormalization", "RotaryEmbedding"}
    assert any("decomposed form" in n for n in report.notes)


@pytest.mark.parametrize("mask", ["bool", None])
def test_opset23_ops_reach_the_npu(mask):
    model = opset23_model(mask, past=False)
    report = Report()
    out = api.optimize(model, target="cann", verify=True, input_data=_feeds(model), report=report)
    assert report.verification["status"] == "passed"
    assert report.lowering_verification["status"] == "passed", report.lowering_verification
    ops = Counter(n.op_type for n in out.graph.node)
    assert ops["NPURmsNorm"] == 1 and ops["NPUPromptFlashAttention"] == 1, ops


def test_opset23_without_a_decomposed_form_is_named():
    model = opset23_model("bool", past=False)
    for a in model.graph.node[-1].attribute:
        if a.name == "scale":
            continue
    model.graph.node[-1].attribute.append(h.make_attribute("softcap", 5.0))
    with pytest.raises(UsageError, match="Attention"):
        api.optimize(model, opset=17)


def test_opset23_output_kept_at_23_is_left_alone():
    model = opset23_model("bool")
    out = api.optimize(model)
    assert Counter(n.op_type for n in out.graph.node)["Attention"] == 1


def canonical(model: onnx.ModelProto) -> list:
    """The graph without its names: each node's op, domain, attributes, and inputs as (producer index,
    output index) or the graph input / initializer's bytes, in node order."""
    where = {i.name: ("input", k) for k, i in enumerate(model.graph.input)}
    for t in model.graph.initializer:
        where[t.name] = ("init", t.data_type, tuple(t.dims), t.raw_data or nh.to_array(t).tobytes())
    rows = []
    for k, n in enumerate(model.graph.node):
        rows.append((n.op_type, n.domain, tuple((a.name, str(h.get_attribute_value(a))) for a in n.attribute
                                               if a.type != onnx.AttributeProto.TENSOR),
                     tuple(where.get(i, i if not i else "?") for i in n.input)))
        for j, o in enumerate(n.output):
            where[o] = ("node", k, j)
    rows.append(tuple(where.get(o.name) for o in model.graph.output))
    return rows


@needs_torch
@pytest.mark.parametrize("options", [{}, {"opset": 23}, {"target": "cann"}], ids=["default", "opset23", "cann"])
def test_llama_second_run_changes_nothing(options, tmp_path):
    first = tmp_path / "first.onnx"
    api.optimize_file(zoo_model("llama"), first, **options)
    second = api.optimize(str(first), **options)
    assert canonical(second) == canonical(onnx.load(str(first)))


@needs_torch
def test_cann_output_keeps_its_npu_nodes_and_refuses_another_target(tmp_path):
    first = tmp_path / "first.onnx"
    api.optimize_file(zoo_model("llama"), first, target="cann")
    report = Report()
    again = api.optimize(str(first), target="cann", report=report, verify=True)
    assert report.verification["status"] == "passed" and report.lowering_verification["status"] == "passed"
    assert report.verification["evaluator"] == "the cann reference evaluator" and not report.warnings
    npu = Counter(n.op_type for n in again.graph.node if n.op_type.startswith("NPU"))
    assert npu == Counter(n.op_type for n in onnx.load(str(first)).graph.node if n.op_type.startswith("NPU"))
    assert any("NPU nodes of the input kept" in n for n in report.notes)
    with pytest.raises(UsageError, match="--target cann"):
        api.optimize(str(first))


@needs_torch
def test_opset23_output_reaches_the_npu(tmp_path):
    first = tmp_path / "first.onnx"
    api.optimize_file(zoo_model("llama"), first, opset=23)
    report = Report()
    out = api.optimize(str(first), target="cann", verify=True, report=report)
    assert report.verification["status"] == "passed"
    ops = Counter(n.op_type for n in out.graph.node)
    assert ops["NPURmsNorm"] == 5 and ops["NPUPromptFlashAttention"] == 2, ops
    assert ops["NPURotaryPositionEmbedding"] == 4, ops  # both layers': the decomposed outputs keep their shapes


def _every_zoo_model() -> list:
    """(name, exporter, decode) of every zoo export: the prefill models (sdpa and eager attention) and the decode
    steps with the KV cache."""
    return [(n, e, False) for n in NAMES + EAGER_NAMES for e in EXPORTERS] + \
        [(n, e, True) for n in DECODE_NAMES for e in EXPORTERS]


@needs_torch
@pytest.mark.slow
@pytest.mark.parametrize("name, exporter, decode", _every_zoo_model(),
                         ids=[f"{n}-{e}{'-decode' if d else ''}" for n, e, d in _every_zoo_model()])
@pytest.mark.parametrize("options", [{}, {"opset": 23}, {"target": "cann"}], ids=["default", "opset23", "cann"])
def test_zoo_second_run_changes_nothing(name, exporter, decode, options, tmp_path):
    """The second run is verified (a cann output under the NPU reference ops: onnxruntime has none) and
    changes nothing in the graph."""
    first = tmp_path / "first.onnx"
    api.optimize_file(zoo_decode_model(name, exporter) if decode else zoo_model(name, exporter), first, **options)
    report = Report()
    second = api.optimize(str(first), verify=True, report=report, **options)
    assert report.verification["status"] == "passed", report.verification
    assert ("evaluator" in report.verification) == ("target" in options)
    assert canonical(second) == canonical(onnx.load(str(first)))


@pytest.mark.parametrize("kv", [KV, H])
def test_opset23_attention_on_3d_inputs(kv):
    """Attention-23 on (B, S, heads * D) inputs with q_num_heads/kv_num_heads: split into heads, equal."""
    rng = np.random.default_rng(3)
    inputs = [_vi("q", T.FLOAT, [B, S, H * D]), _vi("k", T.FLOAT, [B, S + P, kv * D]),
              _vi("v", T.FLOAT, [B, S + P, kv * D]), _vi("mask", T.BOOL, [B, 1, S, S + P])]
    node = h.make_node("Attention", ["q", "k", "v", "mask"], ["y"], q_num_heads=H, kv_num_heads=kv)
    model = h.make_model(h.make_graph([node], "a3", inputs, [_vi("y", T.FLOAT, [B, S, H * D])]),
                         opset_imports=[h.make_opsetid("", 23)], ir_version=10)
    feeds = {n: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
             for i in inputs[:3] for n in [i.name]}
    keep = rng.random((B, 1, S, S + P)) > 0.3
    keep[..., 0] = True
    feeds["mask"] = keep
    report = Report()
    out = api.optimize(model, opset=17, verify=True, input_data=feeds, report=report)
    assert report.verification["status"] == "passed", report.verification
    assert "Attention" not in {n.op_type for n in out.graph.node}


@pytest.mark.parametrize("kv, attrs", [(KV, {}), (H, {"q_num_heads": H, "kv_num_heads": H})], ids=["gqa", "mha"])
def test_opset23_attention_of_unknown_head_counts(kv, attrs):
    """4-D q/k/v whose head dims are symbols: GQA's group size is read from the shapes (equal q_num_heads and
    kv_num_heads, which the op ignores on 4-D inputs, choose the form without a repeat); outputs equal."""
    rng = np.random.default_rng(4)
    inputs = [_vi("q", T.FLOAT, ["b", "hq", S, D]), _vi("k", T.FLOAT, ["b", "hkv", S, D]),
              _vi("v", T.FLOAT, ["b", "hkv", S, D])]
    node = h.make_node("Attention", ["q", "k", "v"], ["y"], **attrs)
    model = h.make_model(h.make_graph([node], "a4", inputs, [_vi("y", T.FLOAT, ["b", "hq", S, D])]),
                         opset_imports=[h.make_opsetid("", 23)], ir_version=10)
    feeds = {"q": rng.standard_normal((B, H, S, D)).astype(np.float32),
             "k": rng.standard_normal((B, kv, S, D)).astype(np.float32),
             "v": rng.standard_normal((B, kv, S, D)).astype(np.float32)}
    report = Report()
    out = api.optimize(model, opset=17, verify=True, input_data=feeds, report=report)
    assert report.verification["status"] == "passed", report.verification
    assert ("Expand" in {n.op_type for n in out.graph.node}) == (not attrs)


def test_decomposed_output_shapes_keep_later_symbols():
    """The decomposed nodes' output types, as the ops define them, reach every shape refresh: past a rotation
    whose cache positions onnx cannot follow (caches of unknown length), what follows keeps x's symbols."""
    from k3opt.graph.lifetime import graph_scope
    from k3opt.modelio import import_graph
    from k3opt.modelio.opset23_down import decompose_opset23
    from k3opt.pipeline.shapes import ShapeRefresher

    inputs = [_vi("x", T.FLOAT, [B, H, "s", D]), _vi("cos", T.FLOAT, [B, None, D // 2]),
              _vi("sin", T.FLOAT, [B, None, D // 2])]
    nodes = [h.make_node("RotaryEmbedding", ["x", "cos", "sin"], ["r"]), h.make_node("Relu", ["r"], ["y"])]
    model = h.make_model(h.make_graph(nodes, "r", inputs, [_vi("y", T.FLOAT, None)]),
                         opset_imports=[h.make_opsetid("", 23)], ir_version=10)
    decomposed = decompose_opset23(model)
    assert decomposed.done == 1 and list(decomposed.shapes) == ["r"]
    with graph_scope():
        for facts, want in ((decomposed.shapes, [B, H, "s", D]), ({}, [B, H, None, D])):
            graph = import_graph(model)
            assert ShapeRefresher(facts)(graph)
            assert list(graph.outputs[0].shape) == want


def test_contradicted_shapes_are_dropped_with_a_note():
    from k3opt.graph.lifetime import graph_scope
    from k3opt.modelio import import_graph
    from k3opt.modelio.opset23_down import decompose_opset23
    from k3opt.pipeline.shapes import ShapeRefresher

    model = opset23_model("bool", past=False)
    facts = dict(decompose_opset23(model).shapes)
    wrong = onnx.TypeProto()
    wrong.CopyFrom(facts["q_r"])
    wrong.tensor_type.shape.dim[3].dim_value = D + 1
    facts["q_r"] = wrong
    with graph_scope():
        refresher = ShapeRefresher(facts)
        graph = import_graph(model)
        assert refresher(graph) and refresher.facts == {}
        assert list(next(t for t in graph.tensors().values() if t.name == "q_r").shape) == [B, H, S, D]
    assert any("contradict shape inference" in n for n in refresher.notes)
