"""remove-dead-nodes: drop every node that contributes to no graph output.

Liveness walks back from the graph outputs; a live node makes live its
inputs and every tensor its subgraphs read from the outer scope (so a value
used only inside an If/Loop body stays). Subgraph bodies are cleaned the same
way from their own outputs. Unused initializers and value_info entries go
with the dead nodes: the exported graph lists only tensors that are still
read. Graph inputs are never removed (they are the model's interface).
"""
from __future__ import annotations

from ...graph.ir import Graph, Node, outer_refs, producer
from ...pipeline.analyses import Shapes
from ...pipeline.pass_base import Hints, Pass, PassContext
from .._rewire import detach_all, remove


def live_nodes(graph: Graph) -> set[int]:
    """Ids of the nodes of ``graph`` that some graph output depends on."""
    live: set[int] = set()
    stack = [p for t in graph.outputs if (p := producer(t)) is not None]
    while stack:
        node = stack.pop()
        if id(node) in live:
            continue
        live.add(id(node))
        # only a node with attributes can hold a body reading outer tensors; producer() inlined (hot loop)
        for t in (list(node.inputs) + outer_refs(node)) if node.attrs else node.inputs:
            if t.inputs and id(t.inputs[0]) not in live:
                stack.append(t.inputs[0])
    return live


class RemoveDeadNodes(Pass):
    name = "remove-dead-nodes"
    description = "Remove nodes (and with them initializers and value_info) that reach no graph output."
    order = 390
    _hints = Hints(adds_bodies=False)
    preserves = frozenset({Shapes})

    def run(self, graph: Graph, ctx: PassContext) -> int:
        removed = 0
        for g in ctx.graphs(graph):
            live = live_nodes(g)
            dead: list[Node] = []
            detach_all([node for node in g.nodes if id(node) not in live], dead)
            remove(g, dead)
            removed += len(dead)
        return removed
