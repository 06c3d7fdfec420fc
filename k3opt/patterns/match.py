"""The :class:`Match` a rule's check and rewrite receive."""
from __future__ import annotations

from typing import Any, Optional

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
    ``op.MatMul(..., _name="mm")``; ``m.nodes`` every matched node; ``m.outputs``
    the tensors the rewrite replaces. ``m.fail(reason)`` records why a check
    declined (shown by the debug mode) and returns False; ``m.memo`` carries what
    the check computed to the rewrite.
    """

    def __init__(self, state: State, outputs: list[Tensor], graph: Graph, ctx: Optional[PassContext]):
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

    def which(self, name: str) -> int:
        """Index of the alternative that matched in ``op.Or(..., _name=name)``."""
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
