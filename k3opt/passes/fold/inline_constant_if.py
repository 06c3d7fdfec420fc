"""inline-constant-if: an ``If`` whose condition is a constant is replaced by the branch it takes.

The chosen branch's nodes move into the graph holding the If (its outer-scope reads are the very
tensors of the enclosing graphs, so they resolve by themselves); its initializers move with the
nodes that read them. Each If output becomes an ``Identity`` of the branch's output (remove-identity
then bypasses those it can, keeping graph-output names). A branch-local tensor whose name is used
anywhere outside the branch is renamed with ``ctx.fresh_name``, so names stay unique.

Refused: a condition that is not a constant of exactly one element, a branch with inputs (invalid
ONNX) or with a different number of outputs than the If.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
from ... import graph as gs

from ...graph.ir import Graph, Node, Tensor, all_graphs, const_tensor, const_value
from ...pipeline.pass_base import Hints, Pass, PassContext
from .._rewire import detach, remove


def chosen_branch(node: Node) -> Optional[Graph]:
    """The branch a constant condition selects, or None."""
    c = const_tensor(node.inputs[0]) if node.inputs else None
    if c is None or int(np.prod(c.shape)) != 1:
        return None
    value = const_value(node.inputs[0])
    branch = node.attrs.get("then_branch" if bool(np.asarray(value).ravel()[0]) else "else_branch")
    if not isinstance(branch, gs.Graph) or branch.inputs or len(branch.outputs) != len(node.outputs):
        return None
    return branch


def _local_tensors(branch: Graph) -> list[Tensor]:
    """Tensors that belong to ``branch``: its nodes' outputs and the constants only its nodes read."""
    local: dict[int, Tensor] = {}
    mine = {id(n) for n in branch.nodes}
    for n in branch.nodes:
        for t in n.outputs:
            local[id(t)] = t
        for t in n.inputs:
            if isinstance(t, gs.Constant) and t.name and all(id(r) in mine for r in t.outputs):
                local[id(t)] = t
    return list(local.values())


def _names_outside(root: Graph, branch: Graph) -> set[str]:
    """Tensor names of every graph under ``root`` except ``branch`` and its bodies."""
    inside = {id(g) for g in all_graphs(branch)}
    names: set[str] = set()
    for g in all_graphs(root):
        if id(g) in inside:
            continue
        names.update(t.name for t in g.inputs + g.outputs if t.name)
        for n in g.nodes:
            names.update(t.name for t in n.inputs + n.outputs if t.name)
    return names


class InlineConstantIf(Pass):
    name = "inline-constant-if"
    description = "Replace an If whose condition is a constant by the nodes of the branch it takes."
    order = 110
    _hints = Hints(adds_bodies=False)

    def run(self, graph: Graph, ctx: PassContext) -> int:
        total = 0
        for g in ctx.graphs(graph):
            dead: list[Node] = []
            for node in ctx.nodes_of(g, {"If"}):
                if node.outputs and (node.domain or "") in ("", "ai.onnx"):
                    total += self._inline(graph, g, node, ctx, dead)
            remove(g, dead)
        return total

    def _inline(self, root: Graph, g: Graph, node: Node, ctx: PassContext, dead: list[Node]) -> bool:
        branch = chosen_branch(node)
        if branch is None:
            return False
        taken = _names_outside(root, branch)
        for t in _local_tensors(branch):
            if t.name in taken:
                t.name = ctx.fresh_name(t.name)
        moved = list(branch.nodes)
        results = list(branch.outputs)
        branch.nodes = []  # so that detaching the If leaves the moved nodes linked
        outputs = list(node.outputs)
        detach(node, dead)
        copies = []
        for out, result in zip(outputs, results):
            copy = gs.Node("Identity", name=ctx.fresh_name(f"{node.name or 'if'}_result"), inputs=[], outputs=[])
            copy.inputs.append(result)
            copy.outputs.append(out)
            copies.append(copy)
        at = next(i for i, n in enumerate(g.nodes) if n is node)
        g.nodes[at:at] = moved + copies
        ctx.changed()
        return True
