"""Analyses: facts about a graph that passes ask the run for, computed on demand and kept while they hold.

MLIR's analysis manager, in small. A pass asks ``ctx.analysis(DimAnalysis, graph)`` (``ctx.dims(graph)``):
the first ask computes (or starts) the analysis, later asks get the same object, in this pass and in the
next ones, until the graph changes. After a pass that rewrote, the pass manager drops every analysis the pass does
not list in ``Pass.preserves`` (MLIR's preserved set; empty, the safe default, drops them all). While a
pass runs, the graph-editing helpers of :mod:`k3opt.graph.ir` report what they change (:meth:`edited`):
an analysis that can follow such edits forgets only what read the changed tensors, the others go.

:class:`Shapes` stands for the tensors' inferred shapes, kept on the tensors themselves: the pass manager
re-infers them before a pass that ``needs_shapes`` when they were dropped.
"""
from __future__ import annotations

from typing import ClassVar, Collection, Sequence, TypeVar

from ..graph.ir import Graph, Tensor
from ..graph.symbolic.dims import Dims

#: An analysis class's instances (what ``get`` returns for it).
A = TypeVar("A", bound="Analysis")


class Analysis:
    """Something known about ``graph`` that holds until the graph changes. Subclasses compute in
    ``__init__`` or on demand."""

    #: Holds whatever single edits a pass makes (only the pass's ``preserves`` decides): not told of them.
    edit_proof: ClassVar[bool] = False

    def __init__(self, graph: Graph) -> None:
        self.graph = graph

    def edited(self, tensors: Sequence[Tensor]) -> bool:
        """``tensors`` changed (another producer, or one reading other values, another name or shape):
        return True when the analysis still holds after forgetting what read them, False to be dropped."""
        return False


class Shapes(Analysis):
    """The tensors' shapes and dtypes are what shape inference gives for the graph as it is.

    Not dropped by single edits while a pass runs: whether a pass's rewrites keep every shape is what it
    declares (``preserves = frozenset({Shapes})``: every tensor it keeps has its value, so its shape,
    unchanged, and tensors it creates carry their dtype/shape or none).

    Kept shapes are then right, but inference may know more than they say once a rewrite spells a shape
    computation so that its data propagation reads it (merge-equal-dims, copy-reshape-dims): such a pass
    marks them :attr:`sharpened`, and the pass manager infers again before it calls a fixed point reached
    (else a second run, inferring afresh, would still rewrite).
    """

    edit_proof = True

    def __init__(self, graph: Graph) -> None:
        super().__init__(graph)
        #: A rewrite since inference may let a fresh inference know more (see the class docstring).
        self.sharpened = False


class DimAnalysis(Dims, Analysis):
    """The run's :class:`~k3opt.graph.symbolic.dims.Dims` of a graph: traced dims and shape values, remembered
    across passes until one rewrites (unless it lists ``DimAnalysis`` in ``preserves``).

    A pass asks ``ctx.dims(graph)`` (``ctx.analysis(DimAnalysis, graph)``) and calls its methods
    (``dims.at(t, i)``, ``dims.of(t)``, ``dims.elements(t)``, ``dims.fold(node)``): each traced dim is
    computed once per run, not once per question. What a pass changes through the graph-editing helpers is
    forgotten as it happens (:meth:`edited`).
    """

    def edited(self, tensors: Sequence[Tensor]) -> bool:
        self.forget(tensors)
        return True


class AnalysisManager:
    """The analyses one run computed, per analysis class and graph (a model's bodies have their own)."""

    def __init__(self) -> None:
        self._cache: dict[tuple[type, int], Analysis] = {}
        #: The analyses kept that are not :attr:`Analysis.edit_proof` (edits must be told to them).
        self._told: list[Analysis] = []

    def get(self, cls: type[A], graph: Graph) -> A:
        """The ``cls`` analysis of ``graph``: the one kept, else a new one (kept)."""
        found = self._cache.get((cls, id(graph)))
        if found is None or found.graph is not graph:
            found = cls(graph)
            self.put(found)
        return found  # type: ignore[return-value]

    def holds(self, cls: type[Analysis], graph: Graph) -> bool:
        """Is a ``cls`` analysis of ``graph`` kept (computed, and not dropped since)?"""
        found = self._cache.get((cls, id(graph)))
        return found is not None and found.graph is graph

    def put(self, analysis: Analysis) -> None:
        """Keep ``analysis`` (one computed outside the manager: shape inference)."""
        self._cache[type(analysis), id(analysis.graph)] = analysis
        self._listen()

    def sharpen_shapes(self, graph: Graph) -> None:
        """Mark the kept :class:`Shapes` of ``graph`` :attr:`~Shapes.sharpened` (nothing when none is kept)."""
        found = self._cache.get((Shapes, id(graph)))
        if isinstance(found, Shapes) and found.graph is graph:
            found.sharpened = True

    def invalidate(self, preserved: Collection[type] = ()) -> None:
        """Drop every analysis whose class is not in ``preserved``."""
        self._cache = {key: a for key, a in self._cache.items() if key[0] in preserved}
        self._listen()

    def _listen(self) -> None:
        """Note which kept analyses :meth:`edited` tells (the cache changed)."""
        self._told = [a for a in self._cache.values() if not a.edit_proof]

    def edited(self, tensors: Sequence[Tensor]) -> None:
        """A graph-editing helper changed ``tensors`` (see :func:`k3opt.graph.ir.watching_edits`)."""
        for a in self._told:  # called for every edit a pass makes: no analysis to tell costs the loop's test only
            if not a.edited(tensors):
                self._cache = {key: kept for key, kept in self._cache.items() if kept is not a}
                self._listen()
