"""Grouping consecutive blocks: under a memory budget (verification), or into balanced stages (split)."""
from __future__ import annotations

from typing import Sequence


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


def balanced(sizes: Sequence[int], parts: int) -> list[range]:
    """``sizes`` cut into ``parts`` non-empty consecutive ranges minimizing the largest range's total.

    Exact (dynamic programming over cut positions, O(parts * n^2)): no other cut at these boundaries has
    a smaller largest stage. Among the cuts reaching that optimum it takes the one with the largest
    smallest stage, so the stages are as even as the boundaries allow.
    """
    n = len(sizes)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut {n} blocks into {parts} parts")
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    # best[k][i]: (largest, -smallest) over the first i blocks cut into k parts; cut[k][i] its last cut
    inf = (float("inf"), 0)
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = (0, -float("inf"))
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                prev = best[k - 1][j]
                if prev == inf:
                    continue
                total = prefix[i] - prefix[j]
                cand = (max(prev[0], total), max(prev[1], -total))
                if cand < best[k][i]:
                    best[k][i], cut[k][i] = cand, j
    ranges, i = [], n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        ranges.append(range(j, i))
        i = j
    return ranges[::-1]
