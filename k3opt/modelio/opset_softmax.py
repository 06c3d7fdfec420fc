"""What raising a model's opset costs in nodes: Softmax, LogSoftmax and Hardmax change meaning at opset 13.

Below 13 they flatten the input to 2-D at ``axis`` (every axis from it on is one row); from 13 on they
work over the one axis. Over the last axis both mean the same; over several trailing axes the conversion
must spell the old meaning as ``Reshape``/``Flatten``, the op, and a ``Reshape`` back (two nodes or more
where there was one, which no pass removes). :func:`upgrade_cost` counts those nodes so the run can keep
a model at its own opset when no pass needs a newer one (``opset.convert``).
"""
from __future__ import annotations

from typing import Iterator, Optional

import onnx

from .opset_nodes import all_graphs

#: Ops whose ``axis`` means "flatten from here" below opset 13 and "this one axis" from 13 on.
FLATTENING_OPS = frozenset({"Softmax", "LogSoftmax", "Hardmax"})
#: The opset where they changed.
CHANGED_AT = 13
#: Nodes a conversion adds per such op over several axes (a Flatten before and a Reshape after it).
ADDED_PER_OP = 2
_DEFAULT_DOMAINS = ("", "ai.onnx")


def upgrade_cost(model: onnx.ModelProto, current: int, wanted: int) -> int:
    """Nodes the conversion from ``current`` to ``wanted`` adds that no pass removes (0: none known)."""
    if not current < CHANGED_AT <= wanted:
        return 0
    ranks = _declared_ranks(model.graph)
    return ADDED_PER_OP * sum(1 for g in all_graphs(model.graph) for n in g.node if _over_several_axes(n, ranks))


def _over_several_axes(node: onnx.NodeProto, ranks: dict[str, int]) -> bool:
    """A Softmax-like node whose ``axis`` (default 1 below opset 13) is not provably its input's last."""
    if node.op_type not in FLATTENING_OPS or node.domain not in _DEFAULT_DOMAINS or not node.input:
        return False
    axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
    if axis == -1:
        return False
    r: Optional[int] = ranks.get(node.input[0])
    return r is None or (axis if axis >= 0 else axis + r) != r - 1


def _declared_ranks(graph: onnx.GraphProto) -> dict[str, int]:
    """Ranks the model declares (inputs, outputs, value_info, initializers). An input of unknown rank
    counts as over several axes: keeping the opset is always exact, it only costs the passes that need a
    newer one, and those are asked first."""
    ranks = {vi.name: len(vi.type.tensor_type.shape.dim) for vi in _infos(graph)
             if vi.type.tensor_type.HasField("shape")}
    ranks.update({t.name: len(t.dims) for t in graph.initializer})
    return ranks


def _infos(graph: onnx.GraphProto) -> Iterator[onnx.ValueInfoProto]:
    for g in all_graphs(graph):
        yield from g.input
        yield from g.output
        yield from g.value_info
