"""unwrap-flattened-softmax: ``Reshape(Softmax(Flatten(x, k), -1), shape(x))`` becomes ``Softmax(x, j)``.

Raising a model past opset 13 wraps each Softmax (LogSoftmax, Hardmax) that the model gave an ``axis``
as ``Flatten`` at that axis, the op over the last axis, and a ``Reshape`` back to ``x``'s shape: the
old meaning (every axis from ``k`` on is one row) spelled in the new. When ``x``'s dims from ``k`` on
are all 1 but one, ``j`` (or all 1: ``j`` is the last axis), the row is that one axis: the op over
axis ``j`` of ``x`` gives the same values in ``x``'s shape, and the Flatten and Reshape go (tf2onnx's
BERT: ``Softmax(axis=3)`` of a rank-4 score, wrapped because the converter did not know the rank).

Exact when: a dim from ``k`` on is 1 only when known to be 1 (a symbol may be anything); the op works
over the flattened tensor's last axis (``axis`` -1 or 1); the Reshape's target is ``x``'s own shape
element by element (known equal dims or the same symbols, at most one -1); the Flatten's and the op's
results have no other reader and are no graph outputs.
"""
from __future__ import annotations

from typing import Optional

from ...graph.ir import Graph, Node, Tensor, producer, set_input
from ...graph.symbolic.dims import Dims
from ...pipeline.pass_base import PassContext
from .._rewire import NodeRewritePass, bypass, single_use

WRAPPED_OPS = frozenset({"Softmax", "LogSoftmax", "Hardmax"})


def row_axis(dims: Dims, x: Tensor, k: int) -> Optional[int]:
    """The one axis of ``x`` from ``k`` on whose dim is not known to be 1 (the last when there is none), or
    None when there are several or the rank is unknown."""
    if x.shape is None:
        return None
    r = len(x.shape)
    k = k + r if k < 0 else k
    if not 0 <= k < r:
        return None
    free = [i for i in range(k, r) if dims.at(x, i) != 1]
    return free[0] if len(free) == 1 else (r - 1 if not free else None)


def restores(dims: Dims, reshape: Node, x: Tensor) -> bool:
    """The Reshape's target is ``x``'s shape element by element (equal known dims or symbols, one -1 at most),
    or ``Shape(x)`` itself (onnx's Softmax 12 -> 13 adapter's spelling, whatever x's dims are)."""
    shape = producer(reshape.inputs[1])
    if shape is not None and shape.op == "Shape" and shape.inputs and shape.inputs[0] is x \
            and shape.attrs.get("start", 0) == 0 and shape.attrs.get("end") is None:
        return True
    elements = dims.elements(reshape.inputs[1])
    if x.shape is None or elements is None or len(elements[1]) != 1 or len(elements[0]) != len(x.shape):
        return False
    if elements[0].count(-1) > 1:
        return False
    return all(e == -1 or (e is not None and e == dims.at(x, i)) for i, e in enumerate(elements[0]))


class UnwrapFlattenedSoftmax(NodeRewritePass):
    name = "unwrap-flattened-softmax"
    description = "Reshape(Softmax(Flatten(x, k)), shape(x)) -> Softmax(x, j) when x[k:] has one dim above 1."
    order = 264
    ops = frozenset({"Reshape"})

    def rewrite(self, graph: Graph, node: Node, ctx: PassContext, dead: list[Node]) -> bool:
        op = producer(node.inputs[0])
        if (op is None or op.op not in WRAPPED_OPS or (op.domain or "") not in ("", "ai.onnx")
                or int(op.attrs.get("axis", -1)) not in (-1, 1) or not single_use(graph, node.inputs[0])):
            return False
        flat = producer(op.inputs[0])
        if (flat is None or flat.op != "Flatten" or (flat.domain or "") not in ("", "ai.onnx")
                or not single_use(graph, op.inputs[0]) or not ctx.owns(graph, flat) or not ctx.owns(graph, op)):
            return False
        x = flat.inputs[0]
        dims = ctx.dims(graph)
        j = row_axis(dims, x, int(flat.attrs.get("axis", 1)))
        if j is None or not restores(dims, node, x):
            return False
        if not bypass(graph, node, op.outputs[0], dead):
            return False
        set_input(op, 0, x)
        op.attrs["axis"] = j
        return True
