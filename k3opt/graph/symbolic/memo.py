"""The memo of dim tracing: what a walk found, per tensor and slot, valid at which depths, and which results read
which tensors (so an edit forgets exactly what it may change)."""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Iterable

from ..ir import Tensor

#: A slack no walk reaches (:attr:`DimMemo.slack`: a walk that tests no depth holds at every depth).
_UNBOUNDED = 1 << 30


class DimMemo:
    """What tracing found, kept by a :class:`~k3opt.graph.symbolic.dims.Dims`, and which results read which tensors.

    Tracing re-walks the same producers for every Shape of a deep model. A
    result is remembered per tensor and slot (slot: the dim, -1 for shape
    elements, -2 for a constant's value). When no branch was cut short by the
    depth limit it holds at every depth from the least one its walk needed
    (its depth less its :attr:`slack`) up: more depth walks the same path, and
    so does less as long as every depth test the walk made still passes. A
    result that was cut short is valid at its own depth only (any less depth
    cuts the walk elsewhere). Results read other tensors' results, producers,
    constant values or unknown shapes (a known shape changes only when shapes
    are inferred again, which drops the analysis); :meth:`forget` drops the
    results of changed tensors and, transitively, of the tensors whose results
    read them.
    """

    def __init__(self) -> None:
        #: ``id(t) -> (t, results)``; results: ``slot -> (value, depth)`` when complete (valid at ``depth`` and
        #: deeper: the least depth its walk needed), ``(slot, depth) -> value`` when cut short by the depth limit.
        self._results: dict[int, tuple[Tensor, dict]] = {}
        #: ``id(tensor) -> ids of the tensors whose results read it`` (a defaultdict: ``setdefault(k, set())``
        #: would build a set on every read, the memo's hottest path).
        self._readers: defaultdict[int, set[int]] = defaultdict(set)
        #: Ids of the tensors whose results are being computed (innermost last).
        self._computing: list[int] = []
        #: True once the result being computed depends on a cut-short branch.
        self.cut = False
        #: How much less depth the result being computed could have been asked at and still walk the same path
        #: (every depth test it made, and every remembered result it read, holding at that depth too).
        self.slack = _UNBOUNDED

    def get(self, t: Tensor, slot: int, depth: int, compute: Callable[[], object]) -> object:
        """``compute()`` for ``(t, slot)`` at ``depth``, remembered.

        A dim (``slot >= 0``) is asked for only once :meth:`Dims.at`'s depth test passed (``depth > 0``): the
        asking walk's path holds down to depth 1 there."""
        tid = id(t)
        computing = self._computing
        if computing and computing[-1] != tid:  # self.read(t), inlined: the memo's hottest path
            self._readers[tid].add(computing[-1])
        own = self._results.get(tid)
        if own is None or own[0] is not t:
            own = self._results[tid] = (t, {})
        results = own[1]
        if slot >= 0 and depth <= self.slack:  # self.tested(depth), inlined
            self.slack = depth - 1
        hit = results.get(slot)
        if hit is not None and hit[1] <= depth:
            if depth - hit[1] < self.slack:
                self.slack = depth - hit[1]
            return hit[0]
        key = (slot, depth)
        if key in results:
            self.cut = True
            return results[key]
        outer, outer_slack = self.cut, self.slack
        self.cut, self.slack = False, _UNBOUNDED
        computing.append(tid)
        try:
            value = compute()
        finally:
            computing.pop()
        if self.cut:
            results[key] = value
        else:
            results[slot] = (value, depth - self.slack)
        self.cut = self.cut or outer
        if outer_slack < self.slack:
            self.slack = outer_slack
        return value

    def tested(self, depth: int) -> None:
        """Note a depth test the walk passed at ``depth`` (``depth > 0``): it passes down to depth 1."""
        if depth <= self.slack:
            self.slack = depth - 1

    def read(self, t: Tensor) -> None:
        """Note that the result being computed read ``t``'s result, producer, value or unknown shape."""
        computing = self._computing
        if computing and computing[-1] != id(t):
            self._readers[id(t)].add(computing[-1])

    def forget(self, tensors: Iterable[Tensor]) -> None:
        """Drop the results of ``tensors`` (their producer, its inputs, their name or shape changed) and of
        every tensor whose results read a dropped one."""
        if not self._results:  # nothing to drop (every run starts so): reader links lead nowhere
            self._readers.clear()
            return
        todo = [id(t) for t in tensors]
        while todo:
            tid = todo.pop()
            self._results.pop(tid, None)
            todo.extend(self._readers.pop(tid, ()))
