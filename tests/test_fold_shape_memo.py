"""The traced-dims memo (``k3opt.graph.symbolic.memo.DimMemo``) answers what a fresh trace of the graph as it is
now answers.

The memo keeps results across rewrites and across fold-constants' sweeps,
dropping only those that read a rewired tensor; a stale answer would change
a fold. Each test compares every top-level answer with the one a fresh
:class:`Dims` (nothing remembered) gives for the current graph.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto as T, helper, numpy_helper
from onnx_graphsurgeon.ir.tensor import LazyValues

import k3opt
from k3opt.graph.symbolic import dims as symbolic_dims
from k3opt.graph.symbolic.dims import Dims
from k3opt.pipeline.analyses import DimAnalysis
from k3opt.graph import small_constants
from k3opt.graph.ir import as_constant, replace_uses, watching_edits
from tests.helpers import make_model
from tests.zoo import needs_torch, zoo_model

F = T.FLOAT


def _same(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return a is not None and b is not None and a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


def fresh_dims(graph: gs.Graph, declared: bool = True) -> Dims:
    """A :class:`Dims` remembering nothing yet; ``declared=False``: the symbols of the inputs are traced too."""
    dims = Dims(graph)
    if not declared:
        dims.declared = frozenset()
    return dims


@pytest.fixture
def checked_memo(monkeypatch) -> list:
    """Every answer a Dims gives to a question asked outside a trace is compared with a fresh Dims' answer;
    yields the questions checked."""
    checked: list = []
    checking: list = []

    def check(method: str) -> None:
        real = getattr(Dims, method)

        def asked(self, t, *args):
            got = real(self, t, *args)
            if not self.memo._computing and not checking:
                fresh = Dims(self.graph, self.name_unknown)
                fresh.declared = self.declared
                checking.append(t)
                try:
                    again = real(fresh, t, *args)
                finally:
                    checking.pop()
                assert _same(got, again), (t.name, method, args, got, again)
                checked.append((t.name, method))
            return got

        monkeypatch.setattr(Dims, method, asked)

    for method in ("at", "elements", "const"):
        check(method)
    return checked


@contextmanager
def remembered(graph: gs.Graph, declared: bool = True) -> Iterator[DimAnalysis]:
    """``graph``'s dims analysis, told of the edits made through the graph-editing helpers, as a pass under the
    pass manager has it; ``declared=False``: the symbols of the inputs are traced too."""
    dims = DimAnalysis(graph)
    if not declared:
        dims.declared = frozenset()
    with watching_edits(dims.edited):
        yield dims


def reshaped_graph() -> gs.Graph:
    """y = Reshape(x, Concat(Unsqueeze(Gather(Shape(x), 0)), [-1])) with x: [N, 6]."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
        helper.make_node("Unsqueeze", ["n", "zero1"], ["n1"]),
        helper.make_node("Concat", ["n1", "minus1"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
    ]
    inits = {"zero": np.array(0, np.int64), "zero1": np.array([0], np.int64), "minus1": np.array([-1], np.int64)}
    model = make_model(nodes, [("x", F, ["N", 6])], [("y", F, ["N", 6])], initializers=inits)
    return gs.import_onnx(onnx.shape_inference.infer_shapes(model))


def test_rewired_reader_is_traced_again():
    """A Reshape target whose piece is replaced by a constant is read again; untouched results stay."""
    graph = reshaped_graph()
    tensors = graph.tensors()
    with remembered(graph, declared=False) as dims:
        assert dims.elements(tensors["target"])[0] == ["N", -1]
        assert dims.at(tensors["y"], 0) == "N"
        n = tensors["n"]
        seven = as_constant("seven", np.array(7, dtype=np.int64))
        replace_uses(graph, n, seven)  # told to the memo by the editing helper
        assert dims.elements(tensors["target"])[0] == [7, -1]
        assert dims.at(tensors["y"], 0) == 7
        assert dims.at(tensors["x"], 1) == 6
        dims.forget(list(graph.tensors().values()))
        assert dims.at(tensors["y"], 0) == 7


def test_forgetting_everything_then_tracing_again():
    """Once every result is dropped, a forget has nothing to do (it only drops the reader links, which lead
    nowhere) and later traces are remembered and forgotten as before."""
    graph = reshaped_graph()
    tensors = graph.tensors()
    with remembered(graph, declared=False) as dims:
        memo = dims.memo
        assert dims.at(tensors["y"], 0) == "N"
        memo.forget(list(tensors.values()))
        assert memo._results == {}
        memo._readers[id(tensors["n"])] = {id(tensors["target"])}  # a link whose result is gone
        memo.forget([tensors["x"]])
        assert memo._readers == {}
        memo.forget([tensors["n"]])  # an empty memo: nothing to walk
        assert dims.elements(tensors["target"])[0] == ["N", -1]
        seven = as_constant("seven", np.array(7, dtype=np.int64))
        replace_uses(graph, tensors["n"], seven)
        assert dims.elements(tensors["target"])[0] == [7, -1]


def test_depth_limited_results_are_kept_per_depth():
    """A trace cut short by the depth limit is not reused at a greater depth (which would trace further)."""
    graph = reshaped_graph()
    y = graph.tensors()["y"]
    y.shape = ["unk__1", 6]  # as when inference loses track
    with remembered(graph, declared=False) as dims:
        assert dims.at(y, 0, depth=0) == "unk__1"
        assert dims.at(y, 0) == "N"
        assert dims.at(y, 0, depth=0) == "unk__1"


def relu_chain(length: int) -> gs.Graph:
    """x: [N, 6] through ``length`` Relus to y, every dim 0 after x unknown to inference (traced to N)."""
    nodes = [helper.make_node("Relu", [f"t{i}"], [f"t{i + 1}"]) for i in range(length)]
    graph = gs.import_onnx(make_model(nodes, [("t0", F, ["N", 6])], [(f"t{length}", F, [None, 6])]))
    for t in graph.tensors().values():
        if t.name != "t0":
            t.shape = [None, 6]
    return graph


def test_complete_results_are_reused_at_the_depths_their_walk_needed(monkeypatch):
    """A trace that was not cut short holds at every depth its walk still passes, shallower ones included,
    and answers there without walking again; below that it is traced again. Every answer is a fresh trace's."""
    graph = relu_chain(5)
    y = graph.outputs[0]
    fresh = {depth: fresh_dims(graph, declared=False).at(y, 0, depth) for depth in range(10)}
    assert fresh[9] == fresh[5] == "N" and fresh[4] is None
    walks = []  # the depths y is walked at
    real = Dims._traced_or
    monkeypatch.setattr(Dims, "_traced_or",
                        lambda self, d, t, *a: (t is y and walks.append(a[-1])) or real(self, d, t, *a))
    # Walked at 9, y's trace reaches x at depth 4: it holds down to depth 6; at 5 and below x is cut off.
    for order, walked in ((range(9, -1, -1), [9, 5, 4, 3, 2, 1]), (range(10), [1, 2, 3, 4, 5, 6])):
        with remembered(graph, declared=False) as dims:
            walks.clear()
            assert [dims.at(y, 0, depth) for depth in order] == [fresh[depth] for depth in order]
            assert walks == walked


def test_small_constants_are_decoded_once(monkeypatch):
    """Shape tracing decodes a small constant once per process, not once per memo (pass run); a big one is
    decoded at every read, so weights are never held."""
    graph = reshaped_graph()
    tensors = graph.tensors()
    big = as_constant("big", np.arange(small_constants.MAX_DECODED_BYTES, dtype=np.int64))
    decoded = []
    for module, name in ((symbolic_dims, "peek"), (small_constants, "_decode")):  # big ones peeked, small decoded
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda c, real=real: decoded.append(c.name) or real(c))
    for _ in range(2):
        with remembered(graph, declared=False) as dims:
            assert dims.elements(tensors["target"])[0] == ["N", -1]
            assert dims.const(big) is not None
    assert sorted(decoded) == ["big", "big", "minus1", "zero", "zero1"]
    value = small_constants.small_const_value(tensors["minus1"])
    assert value.dtype == np.int64 and value.tolist() == [-1]


@needs_torch
@pytest.mark.parametrize("name, exporter", [("llama", "torchscript"), ("gpt2", "torchscript"),
                                            ("deepseek_v3", "torchscript"), ("llama", "dynamo")])
def test_zoo_answers_match_fresh_traces(checked_memo, name, exporter):
    """Through the whole pipeline (fold-constants, remove-noop-ops, merge-equal-dims), no answer is stale."""
    k3opt.optimize(onnx.load(zoo_model(name, exporter)))
    assert len(checked_memo) > 100


def test_declared_symbols_are_not_traced():
    """A dim the graph's inputs declare (``N``) is a run-time size: the graph's Dims answers it
    without walking the producers; a symbol the graph does not declare is traced as before."""
    nodes = [helper.make_node("Relu", [f"r{i}"], [f"r{i + 1}"]) for i in range(20)]
    model = make_model(nodes, [("r0", F, ["N", 16])], [("r20", F, ["N", 16])], {}, opset=17)
    graph = gs.import_onnx(onnx.shape_inference.infer_shapes(model))
    last = graph.outputs[0]
    with remembered(graph) as dims:
        assert dims.at(last, 0) == "N" and dims.at(last, 1) == 16
        assert not dims.memo._results
    with remembered(graph, declared=False) as dims:  # nothing is known to be declared
        assert dims.at(last, 0) == "N" and dims.memo._results
    inner = graph.tensors()["r10"]
    inner.shape = ["unk__3", 16]  # a made-up symbol: traced to what the producers say
    with remembered(graph) as dims:
        assert dims.at(inner, 0) == "N"


def test_folded_results_are_not_decoded_again(monkeypatch):
    """A small numeric constant fold-constants builds is answered from the array it was built from."""
    from k3opt.pipeline.pass_base import PassContext
    from k3opt.passes.fold.fold_constants import FoldConstants
    from k3opt.pipeline.manager import PassManager

    nodes = [helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Reshape", ["x", "s"], ["y"])]
    inits = {"a": np.array([2, 1], np.int64), "b": np.array([1, 2], np.int64)}
    graph = gs.import_onnx(make_model(nodes, [("x", F, [3, 3])], [("y", F, [3, 3])], inits, opset=17))
    assert PassManager([FoldConstants()]).run(graph, PassContext(opset=17))
    folded = graph.nodes[0].inputs[1]
    assert isinstance(folded, gs.Constant)
    monkeypatch.setattr(small_constants, "_decode", lambda c: pytest.fail(f"{c.name} decoded again"))
    assert small_constants.small_const_value(folded).tolist() == [3, 3]


def test_a_remembered_value_is_read_only_and_not_the_callers_array():
    """Every later reader shares a remembered answer: none can change it, nor can the array it was built from."""
    small = as_constant("small", np.array([4, 5], np.int64))
    built = np.array([4, 5], np.int64)
    small_constants.remember_value(small, built)
    built[0] = 99
    for c in (small, as_constant("decoded", np.array([6, 7], np.int64))):
        value = small_constants.small_const_value(c)
        with pytest.raises(ValueError, match="read-only"):
            value[0] = 0
    assert small_constants.small_const_value(small).tolist() == [4, 5]


@pytest.mark.parametrize("value", [
    np.array(7, np.int64), np.array([-1, 0, 5], np.int64), np.arange(6, dtype=np.int32).reshape(2, 3),
    np.array([1.5, -0.0, np.inf], np.float32), np.array([np.nan, 1e300], np.float64), np.array([True, False]),
    np.array([-3, 4], np.int8), np.array([200], np.uint8), np.zeros((0, 2), np.int64),
    np.array([1.5], np.float16), np.array([3], np.uint16), np.array([2], np.uint64),
], ids=lambda v: f"{v.dtype}{list(v.shape)}")
@pytest.mark.parametrize("raw", [True, False], ids=["raw", "typed-field"])
def test_small_decode_matches_peek(value, raw):
    """The fast decode of small constants gives exactly what gs's load gives: dtype, shape, bits, a
    writable array of its own; tensors it does not read directly (typed fields, other dtypes) go to gs."""
    proto = numpy_helper.from_array(value, "c")
    if not raw:
        proto = helper.make_tensor("c", proto.data_type, value.shape, value.ravel().tolist())
    c = gs.Constant("c", LazyValues(proto))
    fast, slow = small_constants._decode(c), small_constants.peek(c)
    assert fast.dtype == slow.dtype and fast.shape == slow.shape and fast.tobytes() == slow.tobytes()
    assert fast.flags.writeable and fast.flags.owndata and fast.flags.c_contiguous


def test_small_decode_reads_raw_numbers_itself(monkeypatch):
    """The common case (raw int64 bytes, as exporters write shape constants) does not go through gs."""
    c = gs.Constant("c", LazyValues(numpy_helper.from_array(np.array([2, -1], np.int64), "c")))
    monkeypatch.setattr(small_constants, "peek", lambda c: pytest.fail("went to gs"))
    assert small_constants._decode(c).tolist() == [2, -1]


def test_small_constants_are_read_outside_the_memo_but_tracked():
    """A small constant read while tracing keeps no memo entry of its own (it is remembered per process), yet
    the result that read it is dropped when it is rewired, as through the memo; a big one is memoized."""
    graph = reshaped_graph()
    y, minus1 = graph.tensors()["y"], graph.tensors()["minus1"]
    big = as_constant("big", np.arange(small_constants.MAX_DECODED_BYTES, dtype=np.int64))
    with remembered(graph, declared=False) as dims:
        memo = dims.memo
        got = memo.get(y, 7, 1, lambda: (dims.const(minus1).tolist(), dims.const(big).size))
        assert got == ([-1], small_constants.MAX_DECODED_BYTES)
        assert id(minus1) not in memo._results and -2 in memo._results[id(big)][1]
        assert id(y) in memo._readers[id(minus1)] and id(y) in memo._readers[id(big)]
        memo.forget([minus1])
        assert id(y) not in memo._results
