"""OpCensus: one scan of a graph's op types, shared by every pass that runs at one graph version."""
from __future__ import annotations

import itertools
from typing import Collection, Optional

from ..graph.ir import Graph, Node, all_graphs


class OpCensus:
    """Which nodes of each op type a graph holds, shared by the passes that run at one graph version.

    A pass that finds nothing to do costs what finding its candidates costs: on a large graph that is
    a scan of every node (cache misses on thousands of objects), repeated by every pass. The census
    scans once and answers every pass until the graph changes. The pass manager drops it
    (:meth:`clear`) after every pass that rewrote; answers are also checked against each graph's node
    list (the same list object, the same length), so a pass that replaced or resized one gets a fresh
    census even if it wrongly reported no rewrite. What no check sees is an in-place change (an op
    renamed, a list entry replaced) by a pass that then returns 0: that breaks the pass contract.

    Finding a graph's bodies is a walk of every node's attributes. A graph that holds none keeps holding
    none through the rewrites of a pass that declares it adds none (``Hints.adds_bodies``): the census
    keeps that answer across such changes, so the passes of a body-free model walk for bodies once.
    """

    def __init__(self, graphs: Optional[list[Graph]] = None) -> None:
        """``graphs``: ``list(all_graphs(graph))`` when the caller knows it (loading saw no body: ``[graph]``)."""
        self._graphs: Optional[list[Graph]] = None  # all_graphs order, with the stamps of their node lists
        self._stamps: list[tuple[list, int]] = []
        #: A graph known to hold no body (kept by :meth:`clear` when the change added none).
        self._bodiless: Optional[Graph] = graphs[0] if graphs is not None and len(graphs) == 1 else None
        # id(graph) -> (graph, its node list, its length, op type -> positions in the list)
        self._index: dict[int, tuple[Graph, list[Node], int, dict[str, list[int]]]] = {}
        # id(graph) -> (its node list, its length, the ids of its nodes)
        self._members: dict[int, tuple[list[Node], int, set[int]]] = {}

    def clear(self, bodies_added: bool = True) -> None:
        """Forget everything: the graph changed. ``bodies_added``: the change may have given a graph a body
        it did not hold (False keeps knowing that a body-free graph holds none)."""
        self._graphs, self._stamps = None, []
        self._index.clear()
        self._members.clear()
        if bodies_added:
            self._bodiless = None

    def owns(self, graph: Graph, node: Node) -> bool:
        """``node`` is one of ``graph``'s own nodes; the ids are kept while its node list is the one seen."""
        members = self._members.get(id(graph))
        if members is None or members[0] is not graph.nodes or members[1] != len(graph.nodes):
            members = self._members[id(graph)] = (graph.nodes, len(graph.nodes), {id(n) for n in graph.nodes})
        return id(node) in members[2]

    def graphs(self, graph: Graph) -> list[Graph]:
        """``list(all_graphs(graph))``: the graph and its bodies, outermost first."""
        if graph is self._bodiless:
            return [graph]
        if self._graphs is None or self._graphs[0] is not graph or \
                any(g.nodes is not nodes or len(nodes) != n for g, (nodes, n) in zip(self._graphs, self._stamps)):
            self._graphs = list(all_graphs(graph))
            self._stamps = [(g.nodes, len(g.nodes)) for g in self._graphs]
            if len(self._graphs) == 1:
                self._bodiless = graph
        return list(self._graphs)

    def nodes_of(self, graph: Graph, ops: Collection[str]) -> list[Node]:
        """The nodes of ``graph`` (not of its bodies) whose op type is in ``ops``, in graph order."""
        nodes, index = self._entry(graph)
        found = [index[op] for op in set(ops) if op in index]
        if len(found) == 1:
            return [nodes[i] for i in found[0]]
        return [nodes[i] for i in sorted(itertools.chain.from_iterable(found))]

    def ops_in(self, graph: Graph) -> set[str]:
        """The op types of the nodes of ``graph`` (not of its bodies)."""
        return set(self._entry(graph)[1])

    def _entry(self, graph: Graph) -> tuple[list[Node], dict[str, list[int]]]:
        """``graph``'s node list and op type -> positions in it, indexed again if the list is not the one indexed."""
        entry = self._index.get(id(graph))
        if entry is None or entry[1] is not graph.nodes or len(entry[1]) != entry[2]:
            index: dict[str, list[int]] = {}
            for i, op in enumerate([n.op for n in graph.nodes]):
                index.setdefault(op, []).append(i)
            entry = self._index[id(graph)] = (graph, graph.nodes, len(graph.nodes), index)
        return entry[1], entry[3]
