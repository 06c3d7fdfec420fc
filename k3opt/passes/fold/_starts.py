"""Where fold-constants' value walk starts: the nodes whose inputs are all constant.

The first sweep of a run scans every node; a later sweep carries the last answer over and adds only
the nodes that what it installed since made all-constant (a fraction of a scan of every node).
tests/test_fold_walk.py checks each carried answer against a scan.
"""
from __future__ import annotations

from typing import Optional

from ... import graph as gs

from ...graph.ir import Graph, Node, Tensor


def is_constant(t: Tensor, overridable: set[int]) -> bool:
    """True when named tensor ``t`` is a constant (an initializer no graph input overrides, or a Constant's output)."""
    if id(t) in overridable:
        return False
    if isinstance(t, gs.Constant):
        return True
    made = t.inputs  # its producer, read inline: this runs for an input of every node on every sweep
    return bool(made) and made[0].op == "Constant"


def start_nodes(graph: Graph, last: Optional[list[Node]], installed: list[tuple[Tensor, Tensor]]) -> list[Node]:
    """The nodes whose inputs are all constant, in graph order.

    Without ``last``, a scan of every node. Else from ``last`` (the answer at the last sweep) and
    ``installed`` since: an input that is constant stays so, so a node joins only by reading a tensor
    installed since (the constant, or the graph output a Constant node now computes) or by being that
    new Constant node (no inputs), and none leaves but by leaving the graph.
    """
    overridable = {id(t) for t in graph.inputs}

    def all_constant(node: Node) -> bool:
        return all(not t.name or is_constant(t, overridable) for t in node.inputs)

    if last is None:
        # A first input computed by a non-Constant node rules a node out without a call.
        return [
            n for n in graph.nodes
            if not ((ins := n.inputs) and (t := ins[0]).name and (made := t.inputs) and made[0].op != "Constant"
                    and not isinstance(t, gs.Constant))
            and all_constant(n)
        ]
    position = {id(n): i for i, n in enumerate(graph.nodes)}
    found = {id(n): n for n in last if id(n) in position}
    for t, const in installed:
        for node in (*t.outputs, *const.outputs, *t.inputs):  # readers; t.inputs: a graph output's new Constant node
            if id(node) in position and id(node) not in found and all_constant(node):
                found[id(node)] = node
    return sorted(found.values(), key=lambda n: position[id(n)])


def still_in(graph: Graph, nodes: list[Node]) -> list[Node]:
    """Those of ``nodes`` the graph still holds (ids only: no node is read, a census is a read of every one)."""
    held = {id(n) for n in graph.nodes}
    return [n for n in nodes if id(n) in held]
