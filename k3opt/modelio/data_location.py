"""Where a model may have k3opt read its external data from: regular files inside the model's folder.

A model file can come from anywhere, and whatever its tensors' external-data
locations name, k3opt copies into the output (or its ``.data`` file). So a
location must be relative, stay inside the model's folder after
normalization, and name a regular file reached through no symbolic link
(neither the file nor a folder between it and the model's folder), with
one hard link only: a link, a device or a FIFO could pull in a file from
elsewhere on the machine, or never end. onnx's own loader refuses the same.
The bytes a tensor claims (its dims and type, and the ``length`` entry when
there is one) must lie within the file.

Checked once, when the model is read; a folder changed while k3opt runs is
not watched.
"""
from __future__ import annotations

import math
import os
import stat
from pathlib import Path
from typing import Optional

from onnx import TensorProto

from ..errors import InputError
from ..graph import dtypes

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))
_ONLY = "external data is read only from regular files inside the model's folder"


def resolve(t: TensorProto, base: Path, source: str, absolute_ok: bool) -> Path:
    """The checked file of external tensor ``t`` (location relative to ``base``); raises InputError.

    ``absolute_ok`` accepts an absolute location (as for k3opt's own spill
    files in a model proto built in this process); a model read from a file
    never has one.
    """
    info = {e.key: e.value for e in t.external_data}
    location = info.get("location", "")
    if not location:
        raise InputError(f"{source}: tensor '{t.name}' has external data without a location")
    if "\0" in location:  # no file is named so (os.stat raises ValueError)
        raise InputError(f"{source}: tensor '{t.name}' has an external-data location with a NUL character")
    if os.path.isabs(location):
        if not absolute_ok:
            raise InputError(f"{source}: tensor '{t.name}' has an absolute external-data path {location}")
        path = Path(location)
    else:
        path = Path(os.path.normpath(base / location))
        if base not in path.parents:
            raise InputError(f"{source}: external data of tensor '{t.name}' points outside the model folder")
        _refuse_links(path, base, t.name, source)
    try:
        st = os.lstat(path)
    except OSError:
        raise InputError(f"{source}: missing external-data file {path} (tensor '{t.name}')") from None
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
        raise InputError(f"{source}: external data of tensor '{t.name}' is {kind} ({location}); {_ONLY}")
    if st.st_nlink > 1 and not absolute_ok:
        raise InputError(f"{source}: external data of tensor '{t.name}' has {st.st_nlink} hard links ({location}), "
                         f"so it may be any file of this machine; {_ONLY}")
    _check_span(t, info, st.st_size, path, source)
    return path


def _refuse_links(path: Path, base: Path, name: str, source: str) -> None:
    """Refuse a symbolic link as ``path`` or as any folder between ``base`` and it."""
    current = base
    for part in path.relative_to(base).parts:
        current = current / part
        if os.path.islink(current):
            what = "is" if current == path else "lies in"
            raise InputError(f"{source}: external data of tensor '{name}' {what} a symbolic link "
                             f"({current.relative_to(base)}); {_ONLY}")


def _check_span(t: TensorProto, info: dict[str, str], size: int, path: Path, source: str) -> None:
    """``offset`` and ``length`` are non-negative integers, ``length`` is what dims and type take, and the
    bytes lie within the file (``size`` bytes)."""
    try:
        offset = int(info.get("offset", 0))
        length = int(info["length"]) if "length" in info else None
    except ValueError:
        raise InputError(f"{source}: tensor '{t.name}' has a malformed external-data offset/length") from None
    if offset < 0 or (length is not None and length < 0):
        raise InputError(f"{source}: tensor '{t.name}' has a negative external-data offset/length")
    claimed = claimed_bytes(t)
    if claimed is None:
        raise InputError(f"{source}: tensor '{t.name}' has a negative dimension {list(t.dims)}")
    if length is not None and claimed != length and t.data_type != TensorProto.STRING:
        raise InputError(f"{source}: tensor '{t.name}' has {length} bytes of external data, but its type and shape "
                         f"{list(t.dims)} take {claimed}")
    if offset + (claimed if length is None else length) > size:
        raise InputError(f"{source}: external-data file {path} is too short for tensor '{t.name}'")


def claimed_bytes(t: TensorProto) -> Optional[int]:
    """The bytes ``t``'s dims and type take in raw form (exact: no int64 overflow); None for a negative dim,
    0 for strings (they have no fixed size)."""
    dims = t.dims[:]  # one list from upb, read once
    if dims and min(dims) < 0:
        return None
    return -(-math.prod(dims) * dtypes.bits(t.data_type) // 8)
