"""merge-slices, merge-concats and cancel-squeeze-pairs on hand-made graphs, with onnxruntime numerics."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from k3opt.passes.cleanup.cancel_squeeze_pairs import CancelSqueezePairs
from k3opt.passes.cleanup.merge_concats import MergeConcats
from k3opt.passes.cleanup.merge_slices import MergeSlices, compose
from tests.helpers import assert_equivalent, make_model, op_counts, run_passes

F = TensorProto.FLOAT
BIG = np.iinfo(np.int64).max


def two_slices(p1, p2, x_shape=(6, 10, 4), out=None, extra_out=()):
    """x -> Slice(p1) -> Slice(p2) -> y; p = (starts, ends, axes, steps) (axes/steps None: omitted)."""
    inits, nodes = {}, []
    for k, (src, dst, p) in enumerate((("x", "m", p1), ("m", "y", p2))):
        names = []
        for what, v in zip(("s", "e", "a", "t"), p):
            if v is None:
                names.append("")
                continue
            inits[f"{what}{k}"] = np.array(v, np.int64)
            names.append(f"{what}{k}")
        while names and not names[-1]:
            names.pop()
        nodes.append(helper.make_node("Slice", [src] + names, [dst]))
    shape = ["a", "b", "c"][:len(x_shape)] if out is None else out
    return make_model(nodes, [("x", F, list(x_shape))], [("y", F, shape)] + list(extra_out), inits)


def run(model, p):
    out, pm, _ = run_passes(model, [p])
    return out, pm.stats[p.name].rewrites


CASES = {
    "disjoint": (([1], [5], [0], None), ([2], [8], [1], [2])),
    "same-axis": (([1], [9], [1], None), ([2], [5], [1], None)),
    "same-axis-clamped": (([3], [BIG], [1], None), ([1], [100], [1], None)),
    "same-axis-empty": (([8], [9], [1], None), ([2], [5], [1], None)),
    "negative-static": (([-8], [-1], [1], None), ([-3], [BIG], [-2], None)),
    "default-axes": (([1, 2], [5, 9], None, None), ([1], [3], [2], None)),
    "both-steps-elsewhere": (([0, 1], [6, 4], [0, 2], [2, 1]), ([0], [4], [1], [3])),
}


@pytest.mark.parametrize("case", list(CASES))
def test_slices_merge(case):
    model = two_slices(*CASES[case])
    out, n = run(model, MergeSlices())
    assert n == 1 and op_counts(out) == {"Slice": 1}
    assert_equivalent(model, out)


def test_compose_matches_numpy():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        size = int(rng.integers(0, 8))
        s1, e1, s2, e2 = (int(v) for v in rng.integers(-10, 12, 4))
        got = compose((s1, e1, 1), (s2, e2, 1), size)
        if got is None:
            assert min(s1, e1, s2, e2) < 0
            continue
        a = np.arange(size)
        assert list(a[s1:e1][s2:e2]) == list(a[got[0]:got[1]]), (size, s1, e1, s2, e2, got)


@pytest.mark.parametrize("p1,p2,shape", [
    (([0], [4], [1], [2]), ([0], [2], [1], None), (6, 10, 4)),    # a step on the shared axis
    (([-3], [BIG], [1], None), ([0], [2], [1], None), (6, "n", 4)),  # negative start, unknown size
], ids=["step", "negative-unknown"])
def test_slices_refused(p1, p2, shape):
    model = two_slices(p1, p2, x_shape=shape)
    out, n = run(model, MergeSlices())
    assert n == 0
    assert_equivalent(model, out, feeds={"x": np.random.default_rng(1).standard_normal((6, 10, 4)).astype(np.float32)})


def test_slices_refused_when_middle_is_used():
    model = two_slices(*CASES["disjoint"], extra_out=[("m", F, ["a", "b", "c"])])
    assert run(model, MergeSlices())[1] == 0


def concat_model(inner_axis=1, outer_axis=1, extra_out=()):
    nodes = [helper.make_node("Concat", ["b", "c"], ["bc"], axis=inner_axis),
             helper.make_node("Concat", ["a", "bc", "d"], ["y"], axis=outer_axis)]
    ins = [(n, F, [2, 3, 3]) for n in "abcd"]
    return make_model(nodes, ins, [("y", F, ["p", "q", "r"])] + list(extra_out))


@pytest.mark.parametrize("inner,outer", [(1, 1), (-2, 1), (2, -1)])
def test_concats_merge(inner, outer):
    model = concat_model(inner, outer)
    out, n = run(model, MergeConcats())
    assert n == 1 and op_counts(out) == {"Concat": 1} and list(out.graph.node[0].input) == list("abcd")
    assert_equivalent(model, out)


def test_concats_refused():
    assert run(concat_model(0, 1), MergeConcats())[1] == 0
    assert run(concat_model(extra_out=[("bc", F, ["p", "q", "r"])]), MergeConcats())[1] == 0


def squeeze_pair(first, second, a1, a2, x_shape, opset=17, out_shape=None):
    inits, nodes = {}, []
    nodes.append(helper.make_node("Relu", ["x"], ["r"]))
    for k, (op, axes, src, dst) in enumerate(((first, a1, "r", "m"), (second, a2, "m", "s"))):
        if opset >= 13:
            inits[f"ax{k}"] = np.array(axes, np.int64)
            nodes.append(helper.make_node(op, [src, f"ax{k}"], [dst]))
        else:
            nodes.append(helper.make_node(op, [src], [dst], axes=axes))
    nodes.append(helper.make_node("Relu", ["s"], ["y"]))
    model = make_model(nodes, [("x", F, x_shape)], [("y", F, out_shape or x_shape)], inits, opset=opset)
    return onnx.shape_inference.infer_shapes(model)  # negative axes need the rank of the Relu's output


@pytest.mark.parametrize("opset", [11, 17])
@pytest.mark.parametrize("first,second,a1,a2,shape", [
    ("Unsqueeze", "Squeeze", [0, 2], [2, 0], [3, 4]),
    ("Unsqueeze", "Squeeze", [-1], [2], [3, 4]),
    ("Squeeze", "Unsqueeze", [1], [-2], [3, 1, 4]),
])
def test_squeeze_pairs_cancel(opset, first, second, a1, a2, shape):
    model = squeeze_pair(first, second, a1, a2, shape, opset)
    out, n = run(model, CancelSqueezePairs())
    assert n == 1 and op_counts(out) == {"Relu": 2}
    assert_equivalent(model, out)


def test_squeeze_pairs_refused():
    model = squeeze_pair("Unsqueeze", "Squeeze", [0], [1], [1, 4], out_shape=[1, 4])
    assert run(model, CancelSqueezePairs())[1] == 0
    model = make_model([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Squeeze", ["r"], ["m"]),
                        helper.make_node("Unsqueeze", ["m", "ax"], ["y"])],
                       [("x", F, [3, 1, 4])], [("y", F, [3, 1, 4])], {"ax": np.array([1], np.int64)})
    assert run(model, CancelSqueezePairs())[1] == 0
