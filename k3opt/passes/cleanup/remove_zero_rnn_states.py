"""remove-zero-rnn-states: an all-zero initial_h/initial_c of an RNN/GRU/LSTM becomes the omitted input.

ONNX defines a missing ``initial_h`` (and LSTM's ``initial_c``) as zeros of shape
``(num_directions, batch, hidden)``, the only shape the input may have. PyTorch exports pass
``zeros(num_layers * dirs, batch, hidden)`` built from the input's batch size
(``Shape``/``Gather``/``Concat``/``ConstantOfShape``, then a ``Slice`` per layer), which stays at
run time; omitting it lets remove-dead-nodes drop that arithmetic.

Zero is proven, never assumed: a constant whose every element is 0, a ``ConstantOfShape`` of 0 (or
without a value), or a data-movement op (Slice, Gather, Reshape, Squeeze, Unsqueeze, Transpose,
Expand, Identity, Flatten, Tile, Concat of zeros) of proven zeros.
"""
from __future__ import annotations

import numpy as np

from ...graph.ir import Graph, Node, Tensor, const_tensor, const_value, new_variable, producer, set_input
from ...pipeline.analyses import Shapes
from ...pipeline.pass_base import PassContext
from .._rewire import NodeRewritePass

#: Ops whose output elements are all elements of their first input (or of every data input, Concat).
MOVES_DATA = frozenset({"Slice", "Gather", "Reshape", "Squeeze", "Unsqueeze", "Transpose", "Expand", "Identity",
                        "Flatten", "Tile", "Concat"})
#: Constants above this size are not read to check for zeros.
MAX_ZERO_CHECK = 1 << 16
STATE_INPUTS = {"RNN": (5,), "GRU": (5,), "LSTM": (5, 6)}


def all_zero(t: Tensor, depth: int = 8) -> bool:
    """``t`` is provably all zeros."""
    c = const_tensor(t)
    if c is not None:
        v = const_value(t) if int(np.prod(c.shape)) <= MAX_ZERO_CHECK else None
        return v is not None and not np.any(v)
    p = producer(t)
    if p is None or depth == 0 or (p.domain or "") not in ("", "ai.onnx"):
        return False
    if p.op == "ConstantOfShape":
        value = p.attrs.get("value")
        return value is None or not np.any(np.asarray(getattr(value, "values", value)))
    if p.op not in MOVES_DATA:
        return False
    data = p.inputs if p.op == "Concat" else p.inputs[:1]
    return bool(data) and all(all_zero(x, depth - 1) for x in data)


class RemoveZeroRnnStates(NodeRewritePass):
    name = "remove-zero-rnn-states"
    description = "An all-zero initial_h/initial_c of RNN/GRU/LSTM becomes the omitted input (its default)."
    order = 165
    preserves = frozenset({Shapes})
    ops = frozenset(STATE_INPUTS)

    def rewrite(self, graph: Graph, node: Node, ctx: PassContext, dead: list[Node]) -> bool:
        changed = False
        for i in STATE_INPUTS[node.op]:
            if i < len(node.inputs) and node.inputs[i].name and all_zero(node.inputs[i]):
                set_input(node, i, new_variable(""))
                changed = True
        return changed
