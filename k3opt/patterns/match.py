"""The :class:`Match` a rule's check and rewrite receive."""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from ..graph import ir
from ..graph.ir import Graph, Node, Tensor
from ..graph.symbolic.dims import Dims
from ..pipeline.pass_base import PassContext
from .matcher import State


class Match:
    """One structural match: bound tensors by name, matched nodes by label.

    ``m["x"]`` is the tensor bound to pattern variable (or labelled
    constant/alternative/output) ``x``; ``m.node("mm")`` the node matched by
    ``op.MatMul(..., _name="mm")`` (``m.get_node`` when it may be absent); ``m.nodes`` every matched node; ``m.outputs``
    the tensors the rewrite replaces. ``m.fail(reason)`` records why a check
    declined (shown by the debug mode) and returns False; ``m.memo`` carries what
    the check computed to the rewrite.
    """

    def __init__(self, state: State, outputs: list[Tensor], graph: Graph, ctx: Optional[PassContext],
                 owns: Optional[Callable[[Node], bool]] = None):
        self._values = {key[1]: t for key, t in state.values.items()}
        self._labels = {p.label: n for p, n in state.nodes.values() if p.label}
        self._which = dict(state.which)
        self.nodes: list[Node] = [n for _, n in state.nodes.values()]
        self.outputs = outputs
        self.graph = graph
        self.ctx = ctx
        self.failure: Optional[str] = None
        #: What the check computed for the rewrite (it gets this same match), e.g. an analysis it need not redo.
        self.memo: dict[str, Any] = {}
        self._owns = owns

    def owns(self, node: Node) -> bool:
        """``node`` is one of the matched graph's own nodes: in an If/Loop/Scan body, a check that walks beyond the
        pattern may reach the enclosing graph's nodes, which a rewrite must not take (the pattern's own nodes are
        checked before the check runs)."""
        if self._owns is not None:
            return self._owns(node)
        return self.ctx.owns(self.graph, node) if self.ctx is not None else any(n is node for n in self.graph.nodes)

    def __getitem__(self, name: str) -> Tensor:
        try:
            return self._values[name]
        except KeyError:
            raise KeyError(f"no value named '{name}' in the match; bound: {sorted(self._values)}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._values

    def get(self, name: str, default: Any = None) -> Any:
        return self._values.get(name, default)

    def node(self, label: str) -> Node:
        """The graph node matched by the pattern node labelled ``label`` (``_name=``)."""
        try:
            return self._labels[label]
        except KeyError:
            raise KeyError(f"no node labelled '{label}' in the match; labels: {sorted(self._labels)}") from None

    @property
    def dims(self) -> Dims:
        """The run's traced dims of the graph matched in (``ctx.dims(graph)``); a fresh :class:`Dims` without
        a context."""
        return self.ctx.dims(self.graph) if self.ctx is not None else Dims(self.graph)

    def get_node(self, label: str) -> Optional[Node]:
        """The graph node matched by the pattern node labelled ``label``, or None when that node is not part of
        this match (it sits in an ``op.Or`` alternative that did not match)."""
        return self._labels.get(label)

    def which(self, name: str) -> "int | str":
        """The alternative that matched in ``op.Or(..., _name=name)``: its name when the alternatives are named,
        else its index."""
        return self._which[name]

    def const(self, name: str) -> Optional[np.ndarray]:
        """Value of the bound tensor if it is a constant (initializer or Constant node), else None."""
        return ir.const_value(self[name]) if ir.is_const(self[name]) else None

    def is_const(self, name: str) -> bool:
        return ir.is_const(self[name])

    def shape(self, name: str) -> Optional[tuple]:
        """Static shape of the bound tensor (every dim a known int), else None."""
        return ir.const_shape(self[name])

    def rank(self, name: str) -> Optional[int]:
        return ir.rank(self[name])

    def fail(self, reason: str) -> bool:
        """Record why the check declines; returns False so a check can ``return m.fail(...)``."""
        self.failure = reason
        return False
