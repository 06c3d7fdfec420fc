"""Shared mechanics of the clean-up passes: bypassing a node safely, and a pass shell.

Every clean-up removes a node whose output equals one of its inputs (or
rewires a chain). The one subtle part is graph outputs: replacing a graph
output by another tensor renames that tensor (``ir.replace_uses``), which is
impossible when that tensor is a graph input, another graph output or an
initializer. :func:`bypass` refuses those cases, so every clean-up does too.
"""
from __future__ import annotations

from typing import ClassVar, Optional, Sequence

import numpy as np

from ..graph.ir import (
    Graph, Node, Tensor, all_graphs, disconnect, edited, int_list, is_graph_output, node_subgraphs, producer,
    replace_uses,
)
from ..pipeline.pass_base import Hints, Pass, PassContext


def is_used(graph: Graph, t: Tensor) -> bool:
    """True when ``t`` is read by a node (subgraphs included) or is a graph output."""
    return bool(t.outputs) or is_graph_output(graph, t)


def can_replace(graph: Graph, old: Tensor, new: Tensor) -> bool:
    """Whether readers of ``old`` may read ``new`` instead, keeping the graph's interface."""
    if old is new:
        return False
    if not is_graph_output(graph, old):
        return True
    # ``new`` will take the output's name: it must be a node output of this very
    # graph (not an input, initializer or outer-scope value) and not an output already.
    p = producer(new)
    local = p is not None and any(p is n for n in graph.nodes)
    return local and not is_graph_output(graph, new) and (old.dtype is None or new.dtype is None or old.dtype == new.dtype)


def bypass(graph: Graph, node: Node, new: Tensor, dead: list[Node]) -> bool:
    """Replace ``node``'s (only used) output by ``new`` and queue ``node`` for removal; False if unsafe."""
    outs = [t for t in node.outputs if is_used(graph, t)]
    if len(outs) != 1 or not can_replace(graph, outs[0], new):
        return False
    replace_uses(graph, outs[0], new)
    detach(node, dead)
    return True


def detach(node: Node, dead: list[Node]) -> None:
    """Disconnect ``node`` (and the nodes of its subgraphs, which read outer tensors) and queue it for removal."""
    if node.attrs and node_subgraphs(node):
        detach_all([node], dead)
    else:  # one node: unlinking it where it is never costs more than filtering each whole list
        disconnect(node)
        dead.append(node)


def detach_all(nodes: Sequence[Node], dead: list[Node]) -> None:
    """:func:`detach` each of ``nodes``, filtering each link list they are in once.

    Unlinking node by node scans a tensor's reader list once per node: quadratic when many of
    a constant's thousands of readers go (CSE's duplicates, dead-node removal).
    """
    gone = {id(n) for n in nodes}
    links: dict[int, list] = {}
    for node in nodes:
        if node.attrs:
            for body in node_subgraphs(node):
                for sub in all_graphs(body):
                    for inner in sub.nodes:
                        disconnect(inner)
        for t in node.inputs:
            links[id(t.outputs)] = t.outputs
        for t in node.outputs:
            links[id(t.inputs)] = t.inputs
    for items in links.values():
        list.__setitem__(items, slice(None), [n for n in items if id(n) not in gone])  # by identity, no gs sync
    for node in nodes:
        edited(node.outputs)
        list.clear(node.inputs)
        list.clear(node.outputs)
    dead.extend(nodes)


def remove(graph: Graph, dead: list[Node]) -> None:
    """Drop detached nodes from ``graph.nodes`` in one pass."""
    if dead:
        ids = {id(n) for n in dead}
        graph.nodes = [n for n in graph.nodes if id(n) not in ids]


def single_use(graph: Graph, t: Tensor) -> bool:
    """``t`` feeds exactly one node and is not a graph output (so its producer may be rewritten)."""
    return len(t.outputs) == 1 and not is_graph_output(graph, t)


def chain_producer(graph: Graph, node: Node, op: str, ctx: PassContext) -> Optional[Node]:
    """The ``op`` node of ``graph`` computing ``node``'s first input, if ``node`` is that value's only reader."""
    first = producer(node.inputs[0])
    if first is None or first.op != op or (first.domain or "") not in ("", "ai.onnx"):
        return None
    return first if single_use(graph, node.inputs[0]) and ctx.owns(graph, first) else None


def unsqueeze_axes(node: Node) -> Optional[list[int]]:
    """An Unsqueeze's axes (attribute before opset 13, constant input after), else None."""
    if "axes" in node.attrs:
        return [int(a) for a in node.attrs["axes"]]
    return int_list(node.inputs[1]) if len(node.inputs) > 1 else None


def cast_target(node: Node) -> Optional[int]:
    """The ``to`` type of a Cast as an ONNX type int (None for opset-1 string types)."""
    to = node.attrs.get("to")
    return int(to) if isinstance(to, (int, np.integer)) else None


class NodeRewritePass(Pass):
    """A pass that visits nodes of given op types in every (sub)graph and rewrites some.

    Subclasses set ``ops`` and implement :meth:`rewrite` (return True when
    they changed the graph; detached nodes go to ``dead``).
    """

    ops: ClassVar[frozenset[str]] = frozenset()
    _hints = Hints(adds_bodies=False)  # rewrites build no graph attribute

    def run(self, graph: Graph, ctx: PassContext) -> int:
        total = 0
        for g, candidates in self._candidates(graph, ctx):
            dead: list[Node] = []
            for node in candidates:  # re-checked: an earlier rewrite may have detached or changed it
                if node.op in self.ops and (node.domain or "") in ("", "ai.onnx") and node.outputs:
                    total += bool(self.rewrite(g, node, ctx, dead))
            remove(g, dead)
        return total

    def _candidates(self, graph: Graph, ctx: PassContext) -> list[tuple[Graph, list[Node]]]:
        """Each graph (``all_graphs`` order) with its nodes of the pass's op types, all found before any
        rewrite: from the census ``ctx`` shares at this graph version (a scan when it has none).
        """
        return [(g, ctx.nodes_of(g, self.ops)) for g in ctx.graphs(graph)]

    def rewrite(self, graph: Graph, node: Node, ctx: PassContext, dead: list[Node]) -> bool:  # pragma: no cover
        raise NotImplementedError


class ChainPass(NodeRewritePass):
    """Merges ``op(op(x))`` pairs: :meth:`merge` sees both nodes when the inner result has no other reader."""

    def rewrite(self, graph: Graph, node: Node, ctx: PassContext, dead: list[Node]) -> bool:
        first = chain_producer(graph, node, node.op, ctx)
        return first is not None and self.merge(graph, first, node, dead)

    def merge(self, graph: Graph, first: Node, second: Node, dead: list[Node]) -> bool:  # pragma: no cover
        raise NotImplementedError
