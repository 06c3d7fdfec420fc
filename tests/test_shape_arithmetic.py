"""Shape computations read element by element through Cast, Squeeze, ReduceProd and integer arithmetic
(``Dims.elements``), and the refusals: a result that is not exactly known stays unknown."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T, helper, numpy_helper

from k3opt import modelio
from k3opt.pipeline.analyses import DimAnalysis

F, I64 = T.FLOAT, T.INT64
CONSTS = {"i0": np.array(0, np.int64), "st": np.array([0], np.int64), "en": np.array([2], np.int64),
          "c3": np.array([3], np.int64), "cm": np.array([-2], np.int64), "c0": np.array([0], np.int64)}


def _elements(nodes, out: str):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["b", "s", 6])],
                              [helper.make_tensor_value_info(out, T.UNDEFINED, None)],
                              [numpy_helper.from_array(v, k) for k, v in CONSTS.items()])
    graph = modelio.import_graph(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    found = DimAnalysis(graph).elements(graph.tensors()[out])
    return None if found is None else found[0]


SHAPE = [helper.make_node("Shape", ["x"], ["sh"])]
CAST32 = SHAPE + [helper.make_node("Cast", ["sh"], ["s32"], to=T.INT32)]
BATCH = CAST32 + [helper.make_node("Gather", ["s32", "i0"], ["b0"], axis=0),
                  helper.make_node("Unsqueeze", ["b0", "c0"], ["b"])]


@pytest.mark.parametrize("nodes,out,expected", [
    (CAST32 + [helper.make_node("Slice", ["s32", "st", "en"], ["bs"])], "bs", ["b", "s"]),
    (CAST32 + [helper.make_node("Slice", ["s32", "st", "en"], ["bs"]),
               helper.make_node("ReduceProd", ["bs"], ["p"], keepdims=1)], "p", ["b * s"]),
    (BATCH + [helper.make_node("Mul", ["b", "c3"], ["m"])], "m", ["b * 3"]),
    (BATCH + [helper.make_node("Mul", ["b", "c3"], ["m"]), helper.make_node("Div", ["m", "b"], ["d"])], "d", [3]),
    (BATCH + [helper.make_node("Sub", ["b", "b"], ["z"])], "z", [0]),
    (BATCH + [helper.make_node("Squeeze", ["b", "c0"], ["q"])], "q", ["b"]),
    (SHAPE + [helper.make_node("Mul", ["sh", "sh"], ["sq"])], "sq", ["b * b", "s * s", 36]),
    ([helper.make_node("Size", ["x"], ["n"])], "n", ["b * s * 6"]),
    ([helper.make_node("Size", ["x"], ["n"])] + BATCH + [helper.make_node("Div", ["n", "b"], ["d"])], "d", ["s * 6"]),
])
def test_arithmetic_of_dims(nodes, out, expected):
    assert _elements(nodes, out) == expected


@pytest.mark.parametrize("nodes,out", [
    (BATCH + [helper.make_node("Mul", ["b", "cm"], ["m"])], "m"),  # a dim times a negative number
    (BATCH + [helper.make_node("Div", ["b", "c3"], ["d"])], "d"),  # not a known multiple of 3
    (BATCH + [helper.make_node("Sub", ["b", "c3"], ["d"])], "d"),  # may be negative
    (SHAPE + [helper.make_node("Gather", ["sh", "i0"], ["g"], axis=0),
              helper.make_node("Gather", ["sh", "i0"], ["h"], axis=0),
              helper.make_node("Unsqueeze", ["g", "c0"], ["gu"]),
              helper.make_node("Slice", ["sh", "st", "en"], ["bs"]),
              helper.make_node("Sub", ["bs", "gu"], ["d"])], "d"),  # s - b: different symbols
    (SHAPE + [helper.make_node("Cast", ["sh"], ["f"], to=F)], "f"),  # not an integer
])
def test_unknown_results_stay_unknown(nodes, out):
    assert _elements(nodes, out) is None
