"""Dim tracing through an embedding block's ops (Gather, GatherElements, Expand, ``position_ids[:, :S]``'s Slice),
its refusals, and the input symbols written for the NPU lowering (k3opt.graph.symbolic.input_dims)."""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
from onnx import TensorProto as T, helper

from k3opt.pipeline.analyses import DimAnalysis
from k3opt.graph.symbolic.input_dims import input_dims_written
from tests.helpers import make_model

F, I64 = T.FLOAT, T.INT64


def _embeddings(start: int = 0, table_rows: int = 16, residual: int = 0) -> onnx.ModelProto:
    """BERT's embeddings, then ``residual`` Add/Relu blocks, then y = dim 2 of Reshape(h, [N, S, -1, 2]) as float.

    h = word[ids] + type[Expand(GatherElements(zeros, pos), [N, S])] + position[pos], pos = position_ids[:, start:S]
    (S is ids' dim 1, N its dim 0, both read with Shape/Gather)."""
    nodes = [
        helper.make_node("Shape", ["ids"], ["s"]),
        helper.make_node("Gather", ["s", "i0"], ["n"], axis=0),
        helper.make_node("Gather", ["s", "i1"], ["sq"], axis=0),
        helper.make_node("Unsqueeze", ["n", "ax"], ["n1"]),
        helper.make_node("Unsqueeze", ["sq", "ax"], ["s1"]),
        helper.make_node("Slice", ["position_ids", "start", "s1", "one", "one"], ["pos"]),
        helper.make_node("GatherElements", ["types", "pos"], ["tt"], axis=1),
        helper.make_node("Concat", ["n1", "s1"], ["ns"], axis=0),
        helper.make_node("Expand", ["tt", "ns"], ["tte"]),
        helper.make_node("Gather", ["word", "ids"], ["we"], axis=0),
        helper.make_node("Gather", ["type", "tte"], ["te"], axis=0),
        helper.make_node("Gather", ["position", "pos"], ["pe"], axis=0),
        helper.make_node("Add", ["we", "te"], ["a"]),
        helper.make_node("Add", ["a", "pe"], ["h0"]),
    ]
    for k in range(residual):  # a residual stream: h_{k+1} = h_k + Relu(h_k)
        nodes += [helper.make_node("Relu", [f"h{k}"], [f"r{k}"]), helper.make_node("Add", [f"r{k}", f"h{k}"], [f"h{k + 1}"])]
    h = f"h{residual}"
    nodes += [
        helper.make_node("Concat", ["n1", "s1", "m1", "two"], ["target"], axis=0),
        helper.make_node("Reshape", [h, "target"], ["heads"]),
        helper.make_node("Shape", ["heads"], ["hs"]),
        helper.make_node("Gather", ["hs", "i2"], ["d"], axis=0),
        helper.make_node("Cast", ["d"], ["y"], to=F),
    ]
    inits = dict(i0=np.int64(0), i1=np.int64(1), i2=np.int64(2), ax=np.int64([0]), one=np.int64([1]),
                 start=np.int64([start]), m1=np.int64([-1]), two=np.int64([2]),
                 position_ids=np.arange(table_rows, dtype=np.int64)[None], types=np.zeros((1, table_rows), np.int64),
                 word=np.random.rand(10, 8).astype(np.float32), type=np.random.rand(2, 8).astype(np.float32),
                 position=np.random.rand(table_rows, 8).astype(np.float32))
    return make_model(nodes, [("ids", I64, ["N", "S"])], [("y", F, []), (h, F, [None, None, 8])], inits, opset=17)


def _unknown_graph(model: onnx.ModelProto) -> gs.Graph:
    """The graph with every dim of every tensor but the inputs unknown (what tracing must find)."""
    graph = gs.import_onnx(onnx.shape_inference.infer_shapes(model))
    for t in graph.tensors().values():
        if isinstance(t, gs.Variable) and t not in graph.inputs and t.shape is not None:
            t.shape = [None] * len(t.shape)
    return graph


def test_embedding_dims_traced():
    graph = _unknown_graph(_embeddings())
    t = graph.tensors()
    dims = DimAnalysis(graph)
    assert [dims.at(t["pos"], i) for i in range(2)] == [1, "min(S, 16)"]
    assert [dims.at(t["tt"], i) for i in range(2)] == [1, "min(S, 16)"]  # GatherElements: the indices' shape
    assert [dims.at(t["tte"], i) for i in range(2)] == ["N", "S"]  # Expand: min(S, 16) broadcast with S
    assert [dims.at(t["te"], i) for i in range(3)] == ["N", "S", 8]  # Gather: the indices' dims, then the row's
    assert [dims.at(t["pe"], i) for i in range(3)] == [1, "min(S, 16)", 8]
    assert [dims.at(t["h0"], i) for i in range(3)] == ["N", "S", 8]


@pytest.mark.parametrize("shape", [(2, 5), (1, 1), (3, 16), (1, 16)])
def test_traced_dims_are_onnxruntimes(shape):
    """Every traced dim (symbols and ``min(S, 16)`` evaluated) is the one onnxruntime computes, for S up to the
    table's rows (beyond them the broadcast, and so the model, fails)."""
    model = _embeddings()
    names = ["pos", "tt", "tte", "te", "pe", "a", "h0"]
    runnable = onnx.ModelProto()
    runnable.CopyFrom(model)
    runnable.graph.output.extend([helper.make_empty_tensor_value_info(n) for n in names])
    ids = np.random.randint(0, 10, shape).astype(np.int64)
    got = ort.InferenceSession(runnable.SerializeToString(), providers=["CPUExecutionProvider"]).run(names, {"ids": ids})
    size = {"N": shape[0], "S": shape[1], "min(S, 16)": min(shape[1], 16)}
    graph = _unknown_graph(model)
    t = graph.tensors()
    dims = DimAnalysis(graph)
    for name, value in zip(names, got):
        assert [size.get(d, d) for d in (dims.at(t[name], i) for i in range(value.ndim))] == list(value.shape)


@pytest.mark.parametrize("start, rows", [(1, 16), (0, 1)], ids=["sliced-from-1", "one-row-table"])
def test_broadcasts_that_are_not_exact_stay_unknown(start, rows):
    """``position_ids[:, 1:S]`` is not ``min(S, c)`` (its length is S - 1, which broadcasts S only when S is 2);
    a one-row table gives min(S, 1), which S broadcasts too (kept: c >= 1). The batch still traces."""
    graph = _unknown_graph(_embeddings(start, rows))
    t = graph.tensors()
    dims = DimAnalysis(graph)
    assert dims.at(t["pos"], 1) == (None if start else "min(S, 1)")
    assert dims.at(t["h0"], 0) == "N"
    assert dims.at(t["h0"], 1) == (None if start else "S")


def test_symbol_beside_an_unknown_stays_unknown():
    """Add(x[N, 4], y[?, 4]): y's dim may be N, or anything when N is 1: unknown (not N, not 1)."""
    nodes = [helper.make_node("Add", ["x", "y"], ["z"])]
    model = make_model(nodes, [("x", F, ["N", 4]), ("y", F, [None, 4])], [("z", F, [None, 4])])
    graph = gs.import_onnx(model)
    graph.outputs[0].shape = [None, 4]
    assert DimAnalysis(graph).at(graph.outputs[0], 0) is None


def test_input_dims_written_for_a_deep_residual_stream_and_restored():
    """12 residual blocks are deeper than tracing looks; written block by block, the last one's N and S are
    found, and the head count; the shapes are inference's again afterwards."""
    graph = _unknown_graph(_embeddings(residual=12))
    t = graph.tensors()
    assert DimAnalysis(graph).at(t["h12"], 0) is None
    with input_dims_written(graph) as written:
        assert written > 12
        assert list(t["h12"].shape) == ["N", "S", 8]
        assert DimAnalysis(graph).at(t["heads"], 2) == 4
    assert list(t["h12"].shape) == [None, None, None]
