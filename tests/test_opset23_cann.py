"""Opset-23 Attention, RMSNormalization and RotaryEmbedding reach the NPU: ``--target cann`` lowers them as it
lowers the export they came from. Hand-made RotaryEmbedding nodes in each form the op allows (caches as graph
inputs, initializers, Expand and Gather results; position_ids or not; interleaved; partial; 3-D input), and the
zoo's Llama, Qwen2 and DeepSeek-V3 (MLA) of both exporters at ``--opset 23`` then ``--target cann``: every NPU
node the direct lowering makes, in no more nodes, verified in onnxruntime and under the NPU reference ops."""
from __future__ import annotations

from collections import Counter
from typing import Optional

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T, helper as h, numpy_helper as nh

from k3opt import api
from k3opt.report import Report
from tests.zoo import zoo_model, zoo_params

B, H, S, D, MAX_POS = 2, 4, 5, 8, 16
ROPE = "NPURotaryPositionEmbedding"


def _vi(name: str, dtype: int, shape: list) -> onnx.ValueInfoProto:
    return h.make_tensor_value_info(name, dtype, shape)


def rotary_model(caches: str, interleaved: int = 0, rot: int = 0, three_d: bool = False,
                 batch: int = B) -> onnx.ModelProto:
    """q and k (x @ wq, x @ wk in BNSD, or 3-D with num_heads) rotated by RotaryEmbedding-23, then q @ k^T.

    ``caches``: ``init`` (max_pos, D/2) initializers with position_ids; ``input`` (B, S, D/2) graph inputs;
    ``input-pos`` (max_pos, D/2) graph inputs with position_ids; ``expand`` (1, S, D/2) inputs expanded to
    (B, S, D/2); ``gather`` a computed table gathered by position_ids into (B, S, D/2) caches.
    """
    rng = np.random.default_rng(0)
    width = rot or D
    inits = [nh.from_array((rng.standard_normal((H * D, H * D)) * 0.3).astype(np.float32), w) for w in ("wq", "wk")]
    inputs = [_vi("x", T.FLOAT, [batch, S, H * D])]
    nodes = [h.make_node("MatMul", ["x", w], [f"{w}_p"]) for w in ("wq", "wk")]
    rope_in = []
    for w in ("wq", "wk"):
        if three_d:
            rope_in.append(f"{w}_p")
            continue
        inits.append(nh.from_array(np.array([0, 0, H, D], np.int64), f"{w}_shape"))
        nodes += [h.make_node("Reshape", [f"{w}_p", f"{w}_shape"], [f"{w}_s"]),
                  h.make_node("Transpose", [f"{w}_s"], [f"{w}_t"], perm=[0, 2, 1, 3])]
        rope_in.append(f"{w}_t")
    angles = np.arange(MAX_POS)[:, None] * (1.0 / 10000 ** (np.arange(0, width, 2) / width))[None]
    table = {"cos": np.cos(angles).astype(np.float32), "sin": np.sin(angles).astype(np.float32)}
    pos = []
    if caches == "init":
        inits += [nh.from_array(v, k) for k, v in table.items()]
        pos = ["pos"]
    elif caches == "input":
        inputs += [_vi(k, T.FLOAT, [batch, S, width // 2]) for k in table]
    elif caches == "input-pos":
        inputs += [_vi(k, T.FLOAT, [MAX_POS, width // 2]) for k in table]
        pos = ["pos"]
    elif caches == "expand":
        inputs += [_vi(f"{k}_1", T.FLOAT, [1, S, width // 2]) for k in table]
        inits.append(nh.from_array(np.array([batch, S, width // 2], np.int64), "bsd"))
        nodes += [h.make_node("Expand", [f"{k}_1", "bsd"], [k]) for k in table]
    elif caches == "gather":
        inits.append(nh.from_array(angles.astype(np.float32), "angles"))
        nodes += [h.make_node("Gather", ["angles", "pos"], ["pos_angles"], axis=0),
                  h.make_node("Cos", ["pos_angles"], ["cos"]), h.make_node("Sin", ["pos_angles"], ["sin"])]
    if pos or caches == "gather":
        inputs.append(_vi("pos", T.INT64, [batch, S]))
    attrs = {"interleaved": interleaved, **({"rotary_embedding_dim": rot} if rot else {}),
             **({"num_heads": H} if three_d else {})}
    nodes += [h.make_node("RotaryEmbedding", [x, "cos", "sin"] + pos, [f"{x}_r"], name=f"rope_{x}", **attrs)
              for x in rope_in]
    q, k = (f"{x}_r" for x in rope_in)
    if three_d:  # back to heads for the scores
        inits.append(nh.from_array(np.array([0, 0, H, D], np.int64), "split_heads"))
        for t in (q, k):
            nodes += [h.make_node("Reshape", [t, "split_heads"], [f"{t}_s"]),
                      h.make_node("Transpose", [f"{t}_s"], [f"{t}_t"], perm=[0, 2, 1, 3])]
        q, k = f"{q}_t", f"{k}_t"
    nodes += [h.make_node("Transpose", [k], ["kt"], perm=[0, 1, 3, 2]), h.make_node("MatMul", [q, "kt"], ["y"])]
    graph = h.make_graph(nodes, "rope23", inputs, [_vi("y", T.FLOAT, [batch, H, S, S])], inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 23)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model


def feeds_of(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    feeds = {}
    for i in model.graph.input:
        shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
        if i.name == "pos":
            feeds[i.name] = rng.integers(0, MAX_POS, shape).astype(np.int64)
        else:
            feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def to_cann(model, feeds: Optional[dict] = None) -> tuple[onnx.ModelProto, Report]:
    """``--target cann`` with both verifications passed."""
    report = Report()
    out = api.optimize(model, target="cann", verify=True, input_data=feeds, report=report)
    assert report.verification["status"] == "passed", report.verification
    assert report.lowering_verification["status"] == "passed", report.lowering_verification
    return out, report


@pytest.mark.parametrize("caches", ["init", "input", "input-pos", "expand", "gather"])
def test_every_rotary_embedding_lowers_whatever_its_caches(caches):
    model = rotary_model(caches)
    out, report = to_cann(model, feeds_of(model))
    assert Counter(n.op_type for n in out.graph.node)[ROPE] == 2, report.lowering
    assert "RotaryEmbedding" not in {n.op_type for n in out.graph.node}


@pytest.mark.parametrize("three_d", [False, True], ids=["bnsd", "3d"])
@pytest.mark.parametrize("rot", [0, 4], ids=["full", "partial"])
def test_partial_and_3d_rotary_embeddings_lower(rot, three_d):
    model = rotary_model("input", rot=rot, three_d=three_d)
    out, report = to_cann(model, feeds_of(model))
    assert Counter(n.op_type for n in out.graph.node)[ROPE] == 2, report.lowering


def test_interleaved_rotary_embedding_lowers_as_mode_1():
    """Mode 1 takes 11SD caches only: a batch of 1 lowers; per-row caches of a batch of 2 are kept, with why."""
    model = rotary_model("input", interleaved=1, batch=1)
    out, report = to_cann(model, feeds_of(model))
    modes = [a.i for n in out.graph.node if n.op_type == ROPE for a in n.attribute if a.name == "mode"]
    assert modes == [1, 1], report.lowering
    model = rotary_model("input", interleaved=1)
    out, report = to_cann(model, feeds_of(model))
    assert ROPE not in {n.op_type for n in out.graph.node}
    assert sum("mode 1 (interleave) takes only 11SD" in line for line in report.lowering) == 2, report.lowering


def test_opset_17_gets_every_form_decomposed_exactly():
    for kw in ({"caches": "init", "interleaved": 1}, {"caches": "gather", "rot": 4}, {"caches": "input",
                                                                                        "three_d": True}):
        model = rotary_model(**kw)
        report = Report()
        out = api.optimize(model, opset=17, verify=True, input_data=feeds_of(model), report=report)
        assert report.verification["status"] == "passed", (kw, report.verification)
        assert "RotaryEmbedding" not in {n.op_type for n in out.graph.node}


def _npu(model: onnx.ModelProto) -> Counter:
    return Counter(n.op_type for n in model.graph.node if n.op_type.startswith("NPU"))


@pytest.mark.parametrize("name, exporter", [p for p in zoo_params() if p.values[0] in ("llama", "qwen2",
                                                                                           "deepseek_v3")])
def test_opset23_output_lowers_as_the_export_does(name, exporter, tmp_path):
    """Every RMSNorm, rotary embedding, attention (and MoE op) the direct lowering makes, in no more nodes."""
    first = tmp_path / "first.onnx"
    api.optimize_file(zoo_model(name, exporter), first, opset=23)
    assert {"Attention", "RotaryEmbedding", "RMSNormalization"} <= {n.op_type for n in onnx.load(str(first)).graph.node}
    via, report = to_cann(str(first))
    direct, _ = to_cann(str(zoo_model(name, exporter)))
    assert _npu(via) == _npu(direct) and _npu(via)["NPURotaryPositionEmbedding"] == 4, report.lowering
    assert len(via.graph.node) <= len(direct.graph.node)
