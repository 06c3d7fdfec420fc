"""Folding float16/bfloat16 arithmetic only where onnxruntime computes the same value (issue #26 item 8).

onnxruntime's CPU provider has no float16 kernel for most arithmetic (Exp, Sqrt, Mul, ReduceSum...): it
computes a run of such nodes in float32 and rounds to float16 where the run ends, so an intermediate that
overflows float16 (300 * 300 in Mul -> Div) stays finite, and a result just past 65504 is finite until the
next op with a float16 kernel. A value folded node by node, or rounded where the folded group ends, can
then differ from what the unfolded model computes: inf where onnxruntime gives 300.

So a group whose arithmetic touches float16/bfloat16 is evaluated again as its float32 twin (every
low-precision constant, Cast target and constant fill widened to float32) and each value the group hands
on is folded only when the two agree exactly: a low-precision value only where the twin's values are
already of that type (Sqrt(4) = 2, Exp(0) = 1; NaN for NaN, an infinity for an infinity), since the
reader of the folded value, computed in float32 by onnxruntime, would otherwise see it rounded once more
than the unfolded model does (relative 2**-11 in float16: over a float32 output's tolerance); any other
value is the twin's exactly. A disagreement leaves the producing nodes to the runtime.
"""
from __future__ import annotations

from typing import Optional, Sequence

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from ...graph.ir import Graph, Node
from ._eval import EvalError, as_array, run_model, sub_model

_LOW = frozenset({TensorProto.FLOAT16, TensorProto.BFLOAT16})
#: Ops that move or select bits, or convert types by one rounding both ways of computing agree on: a group of
#: these alone needs no twin.
MOVES_BITS = frozenset({
    "Identity", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Concat", "Split", "Slice", "Gather",
    "Expand", "Tile", "Shape", "Size", "ConstantOfShape", "Cast", "CastLike", "Pad",
})


def disagreeing(graph: Graph, nodes: Sequence[Node], values: dict[str, object]) -> set[str]:
    """Names among ``values`` (the group's outputs, as evaluated) whose float32 twin disagrees: not foldable."""
    names = [k for k, v in values.items() if as_array(v) is not None]
    if not names or all(n.op in MOVES_BITS for n in nodes) or not _touches_low(nodes, values):
        return set()
    try:
        twin = float32_twin(sub_model(graph, nodes, names, {}))
        if twin is None:  # nothing in low precision: the values stand
            return set()
        widened = run_model(twin)
    except Exception:  # noqa: BLE001 - EvalError, or onnxruntime's own types: the twin cannot say, so do not fold
        return set(names)
    return {n for n, w in zip(names, widened) if not agrees(as_array(values[n]), as_array(w))}


def _touches_low(nodes: Sequence[Node], values: dict[str, object]) -> bool:
    """Does the group read, make or hand on a float16/bfloat16 tensor (known without reading any data)?"""
    if any(_low(getattr(as_array(v), "dtype", None)) for v in values.values()):
        return True
    for node in nodes:
        if any(_low(t.dtype) for t in node.inputs if t.name) or any(
                isinstance(v, int) and k in ("to", "dtype") and v in _LOW for k, v in node.attrs.items()):
            return True
        if any(_low(getattr(v, "dtype", None)) for v in node.attrs.values()):  # a Constant's or a fill's tensor
            return True
    return False


def _low(dtype: object) -> bool:
    """Is ``dtype`` (numpy's, an ONNX enum, or a TypeProto gs keeps for optionals) float16 or bfloat16?"""
    if isinstance(dtype, np.dtype):
        return dtype in (np.float16, ml_dtypes.bfloat16)
    return isinstance(dtype, int) and dtype in _LOW


def float32_twin(model: onnx.ModelProto) -> Optional[onnx.ModelProto]:
    """``model`` (a fold group's sub-model, changed in place) with float16/bfloat16 widened to float32; None
    when it holds nothing in low precision. Raises EvalError for a body or a type attribute it cannot widen."""
    changed = False
    graph = model.graph
    for i, t in enumerate(graph.initializer):
        if t.data_type in _LOW:
            graph.initializer[i].CopyFrom(_widened(t))
            changed = True
    for node in graph.node:
        for attr in node.attribute:
            if attr.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
                raise EvalError(f"{node.op_type} holds a body")
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type in _LOW:
                attr.t.CopyFrom(_widened(attr.t))
                changed = True
            elif attr.name in ("to", "dtype", "output_dtype") and attr.type == onnx.AttributeProto.INT and attr.i in _LOW:
                if node.op_type not in ("Cast", "EyeLike"):
                    raise EvalError(f"{node.op_type}'s {attr.name} cannot be widened")
                attr.i = TensorProto.FLOAT
                changed = True
    return model if changed else None


def _widened(t: TensorProto) -> TensorProto:
    return numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name)


def agrees(value: Optional[np.ndarray], twin: Optional[np.ndarray]) -> bool:
    """Whether a folded ``value`` is what its float32 ``twin`` gives (see the module docstring)."""
    if value is None or twin is None or value.shape != twin.shape:
        return False
    if value.dtype in (np.float16, ml_dtypes.bfloat16):
        wide = twin.astype(np.float32)
        rounded = wide.astype(value.dtype)
        # the twin's values must be the type's own: the reader of the folded value gets exactly what the
        # unfolded run hands it, rounded or not (a NaN for a NaN, an infinity only for an infinity)
        exact = np.array_equal(rounded.astype(np.float32), wide, equal_nan=True)
        return exact and np.array_equal(value.astype(np.float32), wide, equal_nan=True)
    return bool(np.array_equal(value, twin.astype(value.dtype), equal_nan=value.dtype.kind == "f"))
