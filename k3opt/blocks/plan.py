"""Grouping consecutive blocks: under a memory budget (verification), or into balanced stages (split)."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np


class TooLarge(Exception):
    """One block alone is over the budget."""

    def __init__(self, index: int, size: int):
        super().__init__(f"block {index} holds {size / 2**20:.1f} MB of weights")
        self.index, self.size = index, size


def group_under(sizes: Sequence[int], limit: int) -> list[range]:
    """Consecutive blocks grouped greedily so that each group's total stays within ``limit``; raises TooLarge."""
    groups: list[range] = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        if size > limit:
            raise TooLarge(i, size)
        if total + size > limit and i > start:
            groups.append(range(start, i))
            start, total = i, 0
        total += size
    if sizes:
        groups.append(range(start, len(sizes)))
    return groups


_INF = np.iinfo(np.int64).max


def balanced(sizes: Sequence[int], parts: int, *, within: Optional[float] = None,
             extra: Optional[Sequence[int]] = None, rank: Optional[Sequence[int]] = None) -> list[range]:
    """``sizes`` (units, in order) cut into ``parts`` non-empty consecutive ranges, as evenly as the cuts allow.

    ``extra[j - 1]`` is what cutting before unit ``j`` costs (activations it hands on besides the residual
    stream; 0 by default). With ``within`` (a largest / smallest ratio), the cut uses the fewest costly cuts
    that bring the parts within it, then has the smallest largest part, then the largest smallest part.
    Without it, or when no cut reaches it, the cut has the smallest largest / smallest ratio (the fewest
    costly cuts among those). Exact: for every candidate smallest part ``m`` (each a sum of consecutive
    units), a dynamic program over the cut positions finds the smallest largest part of the cuts whose
    parts are all at least ``m``; the best ``m`` gives the answer. Among equal cuts, a lower ``rank`` of
    the cut positions (e.g. 0 for a layer boundary) is preferred position by position.
    """
    n = len(sizes)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut {n} blocks into {parts} parts")
    cost = np.zeros(n + 1, dtype=np.int64)
    if extra is not None:
        cost[1:n] = extra
    prefix = np.concatenate([[0], np.cumsum(np.asarray(sizes, dtype=np.int64))])
    seg = prefix[None, :] - prefix[:, None]  # seg[j, i]: the units j..i-1 together
    ahead = np.triu(np.ones((n + 1, n + 1), dtype=bool), 1)
    average = prefix[-1] / parts
    smallest = sorted({int(s) for s in seg[ahead] if s <= average}, reverse=True)
    levels = range(min(parts - 1, int(np.count_nonzero(cost))) + 1)
    if within is not None:
        for level in levels:  # the fewest costly cuts first
            best: Optional[tuple[int, int]] = None
            for m in smallest:
                if m * within < average:  # every part >= m, yet within of m: impossible from here on
                    break
                largest = _min_largest(seg, ahead, cost, parts, level, m)[0]
                if largest <= m * within and (best is None or (largest, -m) < best):
                    best = (largest, -m)
            if best is not None:
                return _cut(seg, ahead, cost, parts, level, -best[1], rank)
    ratio, choice = float("inf"), (0, 0)
    for level in levels:
        for m in smallest:
            if m <= 0 or average / m >= ratio:
                break
            largest = _min_largest(seg, ahead, cost, parts, level, m)[0]
            if largest / m < ratio:
                ratio, choice = largest / m, (level, m)
    return _cut(seg, ahead, cost, parts, *choice, rank)


def _min_largest(seg: np.ndarray, ahead: np.ndarray, cost: np.ndarray, parts: int, level: int,
                 m: int) -> tuple[int, list[np.ndarray]]:
    """The smallest largest part over the cuts into ``parts`` parts, each at least ``m``, with at most ``level``
    costly cuts; and the tables: ``tables[k][u, i]`` the smallest largest part of the first ``i`` units cut into
    ``k`` parts with ``u`` costly cuts."""
    n = seg.shape[0] - 1
    ok = ahead & (seg >= m)
    table = np.full((level + 1, n + 1), _INF, dtype=np.int64)
    table[0, 0] = 0
    tables = [table]
    for _ in range(parts):
        new = np.full_like(table, _INF)
        for u in range(level + 1):
            before = np.full(n + 1, _INF, dtype=np.int64)
            for c in np.unique(cost):  # a part starting at j costs cost[j] (j = 0 starts the first part: free)
                if u - c >= 0:
                    at = cost == c
                    before[at] = table[u - c][at]
            new[u] = np.where(ok, np.maximum(before[:, None], seg), _INF).min(axis=0)
        table = new
        tables.append(table)
    return int(table[:, n].min()), tables


def _cut(seg: np.ndarray, ahead: np.ndarray, cost: np.ndarray, parts: int, level: int, m: int,
         rank: Optional[Sequence[int]]) -> list[range]:
    """The ranges of the optimum :func:`_min_largest` found for (``level``, ``m``), fewest costly cuts first."""
    n = seg.shape[0] - 1
    value, tables = _min_largest(seg, ahead, cost, parts, level, m)
    u = int(np.argmax(tables[parts][:, n] == value))
    ranges, i = [], n
    for k in range(parts, 0, -1):
        table, want = tables[k - 1], tables[k][u, i]
        fits = [j for j in range(i) if seg[j, i] >= m and u - cost[j] >= 0 and table[u - cost[j], j] < _INF
                and max(table[u - cost[j], j], seg[j, i]) == want]
        j = min(fits, key=lambda j: (rank[j - 1] if rank is not None and j > 0 else 0, -j))
        ranges.append(range(j, i))
        u -= int(cost[j])
        i = j
    return ranges[::-1]
