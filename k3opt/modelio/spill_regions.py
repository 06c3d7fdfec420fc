"""Spill-file regions reserved but written only on demand (save writes them straight into the output)."""
from __future__ import annotations

import threading
from typing import BinaryIO, Callable, Optional

Writer = Callable[[BinaryIO], None]
Region = tuple[str, int]


class DeferredRegions:
    """Spill-file regions reserved but not written yet: (path, offset) -> a writer of their bytes at a
    file's current position, and the thread of the run that reserved them.

    :func:`save` has the writer produce them straight into the output's data file (no spill write and
    copy back); any reader of the region writes them into the spill file first. A run sees (and writes,
    and forgets) only the regions its own thread reserved: k3opt starts no threads, so every region a
    run reserves is reserved on the thread the run is on.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._writers: dict[Region, tuple[int, Writer]] = {}

    def defer(self, region: Region, writer: Writer) -> None:
        with self._lock:
            self._writers[region] = (threading.get_ident(), writer)

    def writer(self, region: Region) -> Optional[Writer]:
        """The region's writer (kept: a save may be retried), else None: its bytes are in the spill file."""
        with self._lock:
            entry = self._writers.get(region)
        return None if entry is None else entry[1]

    def take(self, region: Region) -> Optional[Writer]:
        """The region's writer, forgotten: whoever takes it writes the bytes into the spill file."""
        with self._lock:
            entry = self._writers.pop(region, None)
        return None if entry is None else entry[1]

    def mine(self) -> set[Region]:
        """The regions this thread reserved and nobody wrote yet."""
        me = threading.get_ident()
        with self._lock:
            return {region for region, (owner, _) in self._writers.items() if owner == me}

    def forget(self, regions: set[Region]) -> None:
        with self._lock:
            for region in regions:
                self._writers.pop(region, None)


#: The process's deferred regions. Shared on purpose and safe: a region's key is unique in the process
#: (``SpillFile.allocate`` hands each offset of the one spill file out once, under its lock), every access
#: holds the table's lock, and a run only lists, writes and forgets its own thread's regions
#: (:func:`deferred_regions`, :func:`materialize_all`), so concurrent runs in threads never touch each
#: other's (tests/test_api.py runs two ``optimize_file`` calls at once).
_DEFERRED = DeferredRegions()


def defer_spill(location: str, offset: int, writer: Writer) -> None:
    """Register the bytes of spill-file region ``(location, offset)`` as written on demand by ``writer``."""
    _DEFERRED.defer((location, offset), writer)


def deferred_writer(location: str, offset: int) -> Optional[Writer]:
    """The writer of deferred region ``(location, offset)`` (see :func:`defer_spill`), else None."""
    return _DEFERRED.writer((location, offset))


def materialize(location: str, offset: int) -> None:
    """Write a deferred spill region into its spill file (no-op for any other region)."""
    writer = _DEFERRED.take((location, offset))
    if writer is not None:
        with open(location, "r+b") as f:
            f.seek(offset)
            writer(f)


def materialize_all() -> None:
    """Write every deferred spill region of this thread's runs: protos that leave k3opt must point at real
    bytes."""
    for key in _DEFERRED.mine():
        materialize(*key)


def deferred_regions() -> set[Region]:
    """The deferred spill regions this thread's runs registered and nobody wrote yet, as (path, offset)."""
    return _DEFERRED.mine()


def forget_deferred(regions: set[Region]) -> None:
    """Drop deferred regions no proto refers to any more (their bytes are saved), releasing their sources."""
    _DEFERRED.forget(regions)
