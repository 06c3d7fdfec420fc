"""merge-equal-dims: ``Gather(Shape(a), i)`` and ``Gather(Shape(b), j)`` reading the same symbolic dim are one value.

Two dims named by the same ``dim_param`` (inferred, or traced as
fold-constants traces them) are the same size, so every scalar or 1-element
Gather of a Shape that reads such a dim computes the same int64 value; all
are replaced by the first in topological order (it precedes every reader
of the later ones, so the graph stays acyclic). TorchScript exports read
the batch and sequence length again from nearly every activation; after
this, CSE and dead-node removal drop the duplicates. Refused for dims that
are not a symbol, non-constant or multi-element indices, and graph outputs.
If/Loop/Scan bodies are merged too, each within itself (one run of a body
sees one size per symbol, as the main graph does); a body's reader is never
replaced by a value of another graph.
"""
from __future__ import annotations

from ...graph.ir import Graph, Node, Tensor, producer, toposort
from ...graph.symbolic.dims import Dims
from ...pipeline.analyses import Shapes
from ...pipeline.pass_base import Hints, Pass, PassContext
from .._rewire import bypass, remove


def _dim_key(dims: Dims, node: Node) -> object:
    """(symbol, result shape) of a Gather of a Shape that reads one symbolic dim, else None."""
    src = producer(node.inputs[0]) if node.inputs else None
    if src is None or src.op != "Shape" or (src.domain or "") not in ("", "ai.onnx"):
        return None
    picked = dims.elements(node.outputs[0])
    if picked is None or len(picked[0]) != 1 or not isinstance(picked[0][0], str):
        return None
    return picked[0][0], picked[1]


class MergeEqualDims(Pass):
    name = "merge-equal-dims"
    description = "Gathers of Shapes that read the same symbolic dim become one value."
    order = 290
    _hints = Hints(adds_bodies=False)
    needs_shapes = True
    #: Readers of one symbolic dim read one tensor instead of equal ones: every value, so every shape, stays.
    preserves = frozenset({Shapes})

    def run(self, graph: Graph, ctx: PassContext) -> int:
        toposort(graph)  # gs's order in linear time, bodies included (gs's own rebuilds its tensor maps at every call)
        dims = ctx.dims(graph)  # the main graph's for its bodies too: the symbols its inputs declare hold there
        results = [self._merge(g, dims) for g in ctx.graphs(graph)]
        if any(sharpened for _, sharpened in results):
            ctx.analyses.sharpen_shapes(graph)
        return sum(merged for merged, _ in results)

    @staticmethod
    def _merge(graph: Graph, dims: Dims) -> tuple[int, bool]:
        """Merge within ``graph`` alone (the main graph or one If/Loop/Scan body): a body's readers keep
        to the body, whose first reader precedes the others in its own order. Also whether a merge joined
        a value inference does not know as the symbol (it was traced): inference may then know more."""
        first: dict[object, Tensor] = {}
        dead: list[Node] = []
        merged, sharpened = 0, False
        for node in list(graph.nodes):
            if node.op != "Gather" or (node.domain or "") not in ("", "ai.onnx") or len(node.outputs) != 1:
                continue
            key = _dim_key(dims, node)
            if key is None:
                continue
            kept = first.setdefault(key, node.outputs[0])
            if kept is node.outputs[0]:
                continue
            sharpened = sharpened or any(dims.inferred_picked(n) != [key[0]] for n in (node, producer(kept)))
            merged += bypass(graph, node, kept, dead)
        remove(graph, dead)
        return merged, sharpened
