"""merge-concats: a Concat input that is itself a Concat on the same axis (and read only there) is
spliced in: ``Concat(a, Concat(b, c), d)`` is ``Concat(a, b, c, d)``.

Axes are compared after normalizing negative ones (which needs the rank when the two spell the axis
differently). Refused: a different axis, an inner Concat read elsewhere or a graph output.
"""
from __future__ import annotations

from typing import Optional

from ...graph.ir import Graph, Node, producer, rank
from ...pipeline.analyses import Shapes
from ...pipeline.pass_base import PassContext
from .._rewire import NodeRewritePass, detach, single_use


def concat_axis(node: Node) -> Optional[int]:
    """The Concat's axis, non-negative when the rank of its output is known (else as written)."""
    axis = int(node.attrs.get("axis", 0))
    r = rank(node.outputs[0]) if node.outputs else None
    if r is None and node.inputs:
        r = rank(node.inputs[0])
    return axis + r if axis < 0 and r is not None else axis


class MergeConcats(NodeRewritePass):
    name = "merge-concats"
    description = "Splice a Concat on the same axis (read only there) into the Concat reading it."
    order = 258
    preserves = frozenset({Shapes})
    ops = frozenset({"Concat"})

    def rewrite(self, graph: Graph, node: Node, ctx: PassContext, dead: list[Node]) -> bool:
        axis = concat_axis(node)
        inner = []
        for i, t in enumerate(node.inputs):
            p = producer(t)
            if p is not None and p.op == "Concat" and (p.domain or "") in ("", "ai.onnx") and \
                    p is not node and single_use(graph, t) and concat_axis(p) == axis and ctx.owns(graph, p):
                inner.append(p)
        if not inner:
            return False
        spliced = []
        for t in node.inputs:
            p = producer(t)
            spliced.extend(list(p.inputs) if any(p is q for q in inner) else [t])
        for p in inner:
            detach(p, dead)
        set_inputs(node, spliced)
        return True


def set_inputs(node: Node, inputs: list) -> None:
    """``node.inputs = inputs``, relinking readers by identity (gs's list sync finds readers by ``__eq__``)."""
    for t in node.inputs:
        list.__setitem__(t.outputs, slice(None), [n for n in t.outputs if n is not node])
    list.__setitem__(node.inputs, slice(None), list(inputs))
    for t in inputs:
        list.append(t.outputs, node)
