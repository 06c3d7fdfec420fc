"""What is known of a graph's dims and shape values: :class:`Dims`, one object per graph and run.

A dim shape inference left symbolic or unknown is traced back through its producer (:mod:`.trace`), since
inference often loses what a Reshape target spelled out (``Reshape(x, [b, s, -1, 8])`` of a ``[b, s, 16]``
tensor has 2 at dim 2); small integer tensors computed from shapes are evaluated element by element
(:mod:`.values`). Dims are numbers, symbols (:mod:`.algebra`: equal ``dim_param`` names are equal sizes, as
ONNX defines; sums and products are spelled canonically) or None.

A :class:`Dims` remembers what it traced (a :class:`~.memo.DimMemo`) and forgets what an edit may change
(:meth:`Dims.forget`); the run hands one out per graph (``ctx.dims(graph)``:
:class:`k3opt.pipeline.analyses.DimAnalysis`). What it answers depends only on the graph and on how it was
made (``name_unknown``), never on the context it is asked in.
"""
from __future__ import annotations

from typing import Iterable, Optional

import numpy as np

from ..ir import Graph, Node, Tensor, const_tensor, peek
from ..small_constants import constant_value, is_small
from . import trace, values
from .algebra import Dim, Elements, as_dim
from .memo import DimMemo

#: How many producers deep :meth:`Dims.at` and :meth:`Dims.elements` look.
MAX_SHAPE_DEPTH = 8


def input_symbols(graph: Graph) -> frozenset[str]:
    """The symbols the graph's inputs declare: sizes chosen at run time, which no producer pins.

    An output's dim_param (the TorchScript exporter names a KV cache's
    ``Concatpresent.0.key_dim_2``) is computed by the graph: it is traced.
    """
    return frozenset(d for t in graph.inputs for d in (t.shape or ()) if isinstance(d, str))


class Dims:
    """The dims of ``graph``'s tensors and the elements of its shape values, traced on demand and remembered.

    ``name_unknown``: a dim nothing pins is the symbol ``<tensor id:axis>`` instead of None. The name stands
    for that one size, so two paths that reach the same unknown dim (a Reshape's -1 of a flattened ``x`` and
    a target read from ``Shape(x)``) cancel or compare equal, however far the dim's origin is. The names hold
    only while the graph holds those tensors: such a ``Dims`` is made for one question (a match) and dropped.

    The symbols the graph's inputs declare (:func:`input_symbols`) are sizes chosen at run time: no producer
    pins them to a number (inference would have propagated that number), so they are not traced. Tracing
    every ``batch`` dim of a deep model through its residual stream was most of fold-constants' time.
    """

    def __init__(self, graph: Graph, name_unknown: bool = False) -> None:
        self.graph = graph
        self.name_unknown = name_unknown
        #: Symbols the graph's inputs declare: never traced.
        self.declared = input_symbols(graph)
        self.memo = DimMemo()
        #: Note that the result being remembered read ``t``'s result, producer, value or unknown shape.
        self.read = self.memo.read  # bound once: called on every step of every walk

    def forget(self, tensors: Iterable[Tensor]) -> None:
        """``tensors`` changed (their producer, its inputs, their name or shape): drop what read them."""
        self.memo.forget(tensors)

    def of(self, t: Tensor, depth: int = MAX_SHAPE_DEPTH) -> Optional[list[Dim]]:
        """``t``'s dims (numbers, symbols, None for unknown ones); None when the rank is unknown."""
        shape = t.shape
        if shape is None:
            self.read(t)
            return None
        return [self.at(t, i, depth) for i in range(len(shape))]

    def at(self, t: Tensor, i: int, depth: int = MAX_SHAPE_DEPTH) -> Dim:
        """Dim ``i`` of ``t`` (None when unknown or ``i`` is out of range), tracing only that one: a number
        when inference says so, or a symbol the graph's inputs declare, else what the producer says, else
        inference's symbol (else the dim's name with ``name_unknown``) or None."""
        shape = t.shape
        if shape is None:
            self.read(t)
            return None
        if not 0 <= i < len(shape):
            return None
        d = as_dim(shape[i])
        if isinstance(d, int) or (d is not None and d in self.declared):
            return d
        if depth <= 0:
            self.memo.cut = True
            return d
        return self.memo.get(t, i, depth, lambda: self._traced_or(d, t, i, len(shape), depth))

    def _traced_or(self, d: Dim, t: Tensor, i: int, rank: int, depth: int) -> Dim:
        """The traced dim ``i`` of ``t``, else ``d`` (inference's), else its name with ``name_unknown``."""
        traced = trace.traced_dim(self, t, i, rank, depth - 1)
        # A traced symbol names the same size as an inferred one, and names it as the producers do
        # (inference invents a fresh ``unk__N`` wherever it loses track).
        if traced is None and d is None and self.name_unknown:
            return f"<{id(t)}:{i}>"
        return d if traced is None else traced

    def complete(self, t: Tensor, depth: int) -> Optional[list[Dim]]:
        """:meth:`of` ``t`` when no dim is None, else None: traced only up to the first None."""
        if t.shape is None:
            self.read(t)
            return None
        found = []
        for i in range(len(t.shape)):
            d = self.at(t, i, depth)
            if d is None:
                return None
            found.append(d)
        return found

    def elements(self, t: Tensor, depth: int = MAX_SHAPE_DEPTH) -> Optional[Elements]:
        """What is known of a small integer tensor computed from shapes, element by element, and its shape.

        Known elements are ints; a symbol or None marks a dim of some tensor,
        unknown but never negative. None as a whole when ``t`` is not such a
        computation (:mod:`.values`). Callers must not modify the result (it is remembered).
        """
        return self.memo.get(t, -1, depth, lambda: values.elements(self, t, depth))

    def fold(self, node: Node) -> Optional[np.ndarray]:
        """The constant value of a Shape/Size/Gather-of-Shape/Slice-of-Shape/Equal node (of the standard
        domain), if what it reads is known (:func:`.values.fold`)."""
        return values.fold(self, node, MAX_SHAPE_DEPTH)

    def inferred_picked(self, node: Node) -> Optional[list[Dim]]:
        """The dims a Gather/Slice of a ``Shape`` picks as shape inference gives them (nothing traced)."""
        return values.inferred_picked(self, node)

    def const(self, t: Tensor) -> object:
        """The value of ``t`` when it is a constant (``small_const_value``), noted as read by the result being
        remembered. Only big values are remembered here (decoded once per ``Dims``): a small one is remembered
        per process already, and most constants are read once, where the memo's bookkeeping cost more than
        the read."""
        self.read(t)
        c = const_tensor(t)
        if c is None or is_small(c):
            return constant_value(c)
        return self.memo.get(t, -2, 0, lambda: peek(c))

    def depth_test(self, depth: int) -> None:
        """Note a test of the depth limit at ``depth``: a cut when ``depth <= 0``, else a test passed."""
        if depth <= 0:
            self.memo.cut = True
        else:
            self.memo.tested(depth)
