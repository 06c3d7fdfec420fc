"""merge-transposes: ``Transpose(Transpose(x, p1), p2)`` becomes ``Transpose(x, q)``, q[i] = p1[p2[i]].

When q is the identity both go (through the usual graph-output refusals).
Refused when a permutation is implicit and the rank unknown, or when the
middle tensor has another reader or is a graph output.
"""
from __future__ import annotations

from ...graph.ir import Graph, Node, set_input
from .._rewire import ChainPass, bypass, detach
from .._shared.op_kinds import perm_of


class MergeTransposes(ChainPass):
    name = "merge-transposes"
    description = "Compose consecutive Transposes into one (or none)."
    order = 240
    ops = frozenset({"Transpose"})

    def merge(self, graph: Graph, first: Node, node: Node, dead: list[Node]) -> bool:
        p1, p2 = perm_of(first), perm_of(node)
        if p1 is None or p2 is None or len(p1) != len(p2):
            return False
        composed = [p1[i] for i in p2]
        x = first.inputs[0]
        if composed == list(range(len(composed))):
            if not bypass(graph, node, x, dead):
                return False
        else:
            set_input(node, 0, x)
            node.attrs["perm"] = composed
        detach(first, dead)
        return True
