"""remove-identity: readers of an ``Identity`` read its input directly.

Refused when the Identity is what keeps a graph output distinct: its output
is a graph output and its input is a graph input, another graph output or an
initializer (the output cannot take that tensor's name).
"""
from __future__ import annotations

from ...graph.ir import Graph, Node
from ...pipeline.analyses import Shapes
from ...pipeline.pass_base import PassContext
from .._rewire import NodeRewritePass, bypass


class RemoveIdentity(NodeRewritePass):
    name = "remove-identity"
    description = "Remove Identity nodes (graph outputs keep their names)."
    order = 200
    preserves = frozenset({Shapes})
    ops = frozenset({"Identity"})

    def rewrite(self, graph: Graph, node: Node, ctx: PassContext, dead: list[Node]) -> bool:
        return bypass(graph, node, node.inputs[0], dead)
