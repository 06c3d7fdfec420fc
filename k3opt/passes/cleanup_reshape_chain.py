"""merge-reshapes: ``Reshape(Reshape(x, s1), s2)`` becomes ``Reshape(x, s2)``.

Exact when s2 does not read the first result's shape: s2 is a constant and,
unless the second Reshape has ``allowzero=1``, contains no 0 (a 0 copies the
first result's dim). A -1 is fine: it depends only on the element count,
which the first Reshape keeps. Refused when the middle tensor has another
reader or is a graph output.
"""
from __future__ import annotations

from ..ir import Graph, Node, set_input
from .base import register_pass
from .cleanup_rewire import ChainPass, detach, int_list


class MergeReshapes(ChainPass):
    name = "merge-reshapes"
    description = "Merge consecutive Reshapes whose second shape does not depend on the first."
    order = 250
    ops = frozenset({"Reshape"})

    def merge(self, graph: Graph, first: Node, node: Node, dead: list[Node]) -> bool:
        if len(node.inputs) < 2 or len(first.inputs) < 2:  # opset < 5: shape attribute
            return False
        target = int_list(node.inputs[1])
        if target is None or (0 in target and not node.attrs.get("allowzero", 0)):
            return False
        set_input(node, 0, first.inputs[0])
        detach(first, dead)
        return True


register_pass(MergeReshapes)
