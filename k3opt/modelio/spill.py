"""The process's spill file: big weights created by passes live there instead of in memory."""
from __future__ import annotations

import atexit
import os
import tempfile
import threading
from pathlib import Path
from typing import Optional

import numpy as np

from .. import graph as gs
from ..graph import dtypes
from .external import ExternalValues, external_tensor

#: Prefix of the spill files k3opt writes to keep merged weights out of memory.
SPILL_PREFIX = "k3opt-spill-"
#: Regions start at page boundaries so readers can memory-map them.
_ALIGN = 4096


class SpillFile:
    """This process's append-only scratch file for materialised weights, removed at exit.

    One per process, not per run: the protos a run returns point into it (absolute external-data
    locations), so it must outlive the run; a run only appends to it, and never reads what another wrote.
    Runs in threads share it: creating it and reserving a region hold :attr:`_lock`, so each region is
    handed out once.
    """

    #: The process's spill file (shared on purpose, see above), and the lock of its creation and regions.
    _current: Optional["SpillFile"] = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        fd, self.path = tempfile.mkstemp(prefix=SPILL_PREFIX, suffix=".data")
        os.close(fd)
        self.size = 0
        atexit.register(self.remove)

    @classmethod
    def get(cls) -> "SpillFile":
        """The process's spill file, created on first use."""
        with cls._lock:
            if cls._current is None or not os.path.exists(cls._current.path):
                cls._current = cls()
            return cls._current

    def allocate(self, nbytes: int) -> int:
        """Reserve ``nbytes`` at the end of the file; returns the region's offset."""
        with self._lock:
            offset = -(-self.size // _ALIGN) * _ALIGN
            self.size = offset + nbytes
            with open(self.path, "r+b") as f:
                f.truncate(self.size)
        return offset

    def remove(self) -> None:
        if os.path.exists(self.path):
            os.remove(self.path)


def spill_constant(name: str, values: np.ndarray) -> gs.Constant:
    """A gs Constant whose data is written to this process's spill file instead of memory.

    Passes that create big weights use this so memory stays flat; :func:`save` copies the bytes into the
    output's data file, and the spill file is removed when the process exits.
    """
    arr = np.ascontiguousarray(values)
    spill = SpillFile.get()
    offset = spill.allocate(arr.nbytes)
    with open(spill.path, "r+b") as f:
        f.seek(offset)
        f.write(arr.tobytes())
    tensor = external_tensor(name, dtypes.onnx_type(arr.dtype), arr.shape, spill.path, offset, arr.nbytes)
    return gs.Constant(name, ExternalValues(tensor))


def is_spill_file(location: str) -> bool:
    p = Path(location)
    return p.name.startswith(SPILL_PREFIX) and p.parent == Path(tempfile.gettempdir())
