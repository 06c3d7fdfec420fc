"""Spill-file regions reserved but written only on demand (save writes them straight into the output)."""
from __future__ import annotations

from typing import BinaryIO, Callable

#: Spill-file regions reserved but not written yet: (path, offset) -> a writer of their bytes at a
#: file's current position. :func:`save` has the writer produce them straight into the output's data
#: file (no spill write and copy back); any reader of the region writes them into the spill file first.
PENDING: dict[tuple[str, int], Callable[[BinaryIO], None]] = {}


def defer_spill(location: str, offset: int, writer: Callable[[BinaryIO], None]) -> None:
    """Register the bytes of spill-file region ``(location, offset)`` as written on demand by ``writer``."""
    PENDING[(location, offset)] = writer


def materialize(location: str, offset: int) -> None:
    """Write a deferred spill region into its spill file (no-op for any other region)."""
    writer = PENDING.pop((location, offset), None)
    if writer is not None:
        with open(location, "r+b") as f:
            f.seek(offset)
            writer(f)


def materialize_all() -> None:
    """Write every deferred spill region: protos that leave k3opt must point at real bytes."""
    for key in list(PENDING):
        materialize(*key)


def deferred_regions() -> set[tuple[str, int]]:
    """The deferred spill regions now registered, as (path, offset)."""
    return set(PENDING)


def forget_deferred(regions: set[tuple[str, int]]) -> None:
    """Drop deferred regions no proto refers to any more (their bytes are saved), releasing their sources."""
    for key in regions:
        PENDING.pop(key, None)
