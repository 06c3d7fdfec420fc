"""The process's spill file: big weights created by passes live there instead of in memory."""
from __future__ import annotations

import atexit
import os
import tempfile
from pathlib import Path

import numpy as np

from .. import graph as gs
from ..graph import dtypes
from .external import ExternalValues, external_tensor

#: Prefix of the spill files k3opt writes to keep merged weights out of memory.
SPILL_PREFIX = "k3opt-spill-"


_SPILL: dict[str, object] = {}


def spill_constant(name: str, values: np.ndarray) -> gs.Constant:
    """A gs Constant whose data is written to this process's spill file instead of memory.

    Passes that create big weights (e.g. merged sibling MatMuls) use this so
    memory stays flat; :func:`save` copies the bytes into the output's data
    file, and the spill file is removed when the process exits.
    """
    arr = np.ascontiguousarray(values)
    if "file" not in _SPILL:
        fd, path = tempfile.mkstemp(prefix=SPILL_PREFIX, suffix=".data")
        _SPILL["file"] = os.fdopen(fd, "r+b")
        _SPILL["path"] = path
        atexit.register(_remove_spill)
    f = _SPILL["file"]
    f.seek(0, os.SEEK_END)
    offset = f.tell()
    f.write(arr.tobytes())
    f.flush()
    dtype = dtypes.onnx_type(arr.dtype)
    tensor = external_tensor(name, dtype, arr.shape, str(_SPILL["path"]), offset, arr.nbytes)
    return gs.Constant(name, ExternalValues(tensor))


def _remove_spill() -> None:
    f = _SPILL.pop("file", None)
    if f is not None:
        f.close()
        Path(str(_SPILL.pop("path"))).unlink(missing_ok=True)


def is_spill_file(location: str) -> bool:
    p = Path(location)
    return p.name.startswith(SPILL_PREFIX) and p.parent == Path(tempfile.gettempdir())
