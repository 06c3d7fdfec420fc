"""sequence-to-split: ``SplitToSequence`` read only by ``SequenceAt`` at constant positions becomes ``Split``.

The chunk sizes must be known: a constant 1-D ``split``, or a constant
scalar chunk size / no ``split`` with the split dim statically known. With
no ``split`` and ``keepdims=0`` each used chunk is squeezed on the axis.
Refused when the sequence is a graph output, has any other reader, a
position is not constant or out of range, or two readers of the same
position are both graph outputs.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
from ... import graph as gs

from ...graph.ir import Graph, Node, Tensor, const_value, int_list, is_graph_output, replace_uses
from ...pipeline.pass_base import PassContext
from .._rewire import NodeRewritePass, detach


def chunk_sizes(node: Node) -> Optional[list[int]]:
    """Sizes of the chunks a SplitToSequence makes, when statically known."""
    x = node.inputs[0]
    axis = int(node.attrs.get("axis", 0))
    split = node.inputs[1] if len(node.inputs) > 1 and node.inputs[1].name else None
    sizes = int_list(split) if split is not None else None
    if split is not None and sizes is None:
        return None
    if split is not None and np.asarray(const_value(split)).ndim == 1:
        return sizes
    if x.shape is None or not -len(x.shape) <= axis < len(x.shape):
        return None
    dim = x.shape[axis]
    if not isinstance(dim, (int, np.integer)) or dim < 0:
        return None
    step = sizes[0] if sizes else 1
    if step <= 0:
        return None
    return [step] * (int(dim) // step) + ([int(dim) % step] if dim % step else [])


def _positions(graph: Graph, seq: Tensor, n: int) -> Optional[dict[int, list[Node]]]:
    """Readers grouped by normalized position; None when some reader is not a constant SequenceAt."""
    by_pos: dict[int, list[Node]] = {}
    for reader in seq.outputs:
        if reader.op != "SequenceAt" or reader.inputs[0] is not seq or not any(reader is m for m in graph.nodes):
            return None
        pos = int_list(reader.inputs[1])
        if pos is None or len(pos) != 1 or not -n <= pos[0] < n:
            return None
        by_pos.setdefault(pos[0] % n, []).append(reader)
    for readers in by_pos.values():
        if sum(is_graph_output(graph, r.outputs[0]) for r in readers) > 1:
            return None
    return by_pos


class SequenceToSplit(NodeRewritePass):
    name = "sequence-to-split"
    description = "Replace SplitToSequence + SequenceAt with Split."
    order = 260
    ops = frozenset({"SplitToSequence"})

    def rewrite(self, graph: Graph, node: Node, ctx: PassContext, dead: list[Node]) -> bool:
        seq = node.outputs[0]
        sizes = chunk_sizes(node)
        if sizes is None or not sizes or is_graph_output(graph, seq) or not seq.outputs:
            return False
        by_pos = _positions(graph, seq, len(sizes))
        if by_pos is None:
            return False
        axis = int(node.attrs.get("axis", 0))
        squeeze = not node.attrs.get("keepdims", 1) and not (len(node.inputs) > 1 and node.inputs[1].name)
        x = node.inputs[0]
        chunks: list[Optional[Tensor]] = [None] * len(sizes)
        squeezes = []
        for pos, readers in sorted(by_pos.items()):
            readers.sort(key=lambda r: not is_graph_output(graph, r.outputs[0]))
            out = readers[0].outputs[0]
            for r in readers:
                value = r.outputs[0]
                detach(r, dead)
                if value is not out:
                    replace_uses(graph, value, out)
            if squeeze:
                chunks[pos] = gs.Variable(ctx.fresh_name(f"{out.name}_chunk"), dtype=x.dtype)
                squeezes.append(self._squeeze(ctx, chunks[pos], axis, out))
            else:
                chunks[pos] = out
        outs = [c if c is not None else gs.Variable(ctx.fresh_name(f"{seq.name}_{i}"), dtype=x.dtype)
                for i, c in enumerate(chunks)]
        new_nodes = [self._split(ctx, x, sizes, axis, outs)] + squeezes
        at = next(i for i, n in enumerate(graph.nodes) if n is node)
        detach(node, dead)
        graph.nodes[at:at] = new_nodes
        return True

    @staticmethod
    def _split(ctx: PassContext, x: Tensor, sizes: list[int], axis: int, outs: list[Tensor]) -> Node:
        name = ctx.fresh_name("Split")
        if ctx.opset < 13:
            return gs.Node("Split", name, {"axis": axis, "split": sizes}, [x], outs)
        split = gs.Constant(ctx.fresh_name(f"{name}_sizes"), np.array(sizes, dtype=np.int64))
        return gs.Node("Split", name, {"axis": axis}, [x, split], outs)

    @staticmethod
    def _squeeze(ctx: PassContext, chunk: Tensor, axis: int, out: Tensor) -> Node:
        name = ctx.fresh_name("Squeeze")
        if ctx.opset < 13:
            return gs.Node("Squeeze", name, {"axes": [axis]}, [chunk], [out])
        axes = gs.Constant(ctx.fresh_name(f"{name}_axes"), np.array([axis], dtype=np.int64))
        return gs.Node("Squeeze", name, {}, [chunk, axes], [out])
