"""Every file a command will write, checked before any work: the promises of docs/cli.md "Guarantees".

One function, :func:`check_outputs`, used by ``optimize``, ``compile``, ``export`` and any new command:
an output (a model, its ``.data`` beside it, a report, an ``.om``...) must be a regular file or not
exist yet (a device, FIFO, socket or folder is refused and never replaced), its folder must exist and be
writable, and no two of them, nor any of them and an input, may be the same file.
"""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import Iterable, Optional, Sequence

from ..errors import OutputError
from ..interrupts import deferred_signals
from .external import PathLike

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def data_path(dst: PathLike) -> Path:
    """Where the external data of output ``dst`` goes: ``DST.data`` next to it."""
    return Path(str(dst) + ".data")


def not_regular(path: PathLike, follow: bool = True) -> Optional[str]:
    """What ``path`` is when it exists and is not a regular file ("a FIFO"...), else None.

    ``follow``: judge a symbolic link's target (the pre-flight check: a link to a device is refused too);
    False judges the link itself (what a rename would replace).
    """
    try:
        mode = os.stat(path).st_mode if follow else os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError:  # a dangling link, a loop, no permission: a rename replaces the name itself
        return None
    return next((what for test, what in _KINDS if test(mode)), None)


def refuse_non_regular(path: PathLike, follow: bool = True) -> None:
    """OutputError when ``path`` exists and is not a regular file: k3opt never replaces one."""
    what = not_regular(path, follow)
    if what is not None:
        raise OutputError(f"{path}: is {what}, not a regular file; k3opt writes only regular files "
                          "and never replaces anything else")


def check_outputs(models: Sequence[Optional[PathLike]] = (), others: Sequence[Optional[PathLike]] = (),
                  inputs: Iterable[Optional[PathLike]] = (), *, overwrite: bool = False,
                  make_folders: bool = False) -> None:
    """Refuse, before any work, outputs that cannot or must not be written (OutputError, exit status 2).

    ``models``: model files, each with its ``.data`` beside it; ``others``: further files (``--report``,
    ``.om``); ``inputs``: files the command reads. ``overwrite`` lets a model replace an input (the input
    is read in full before the save), never a report or another output. ``make_folders``: the command
    creates missing folders (``compile``), so the nearest existing one must be writable. None entries
    are ignored.
    """
    named: list[tuple[Path, str]] = []  # (path, what it is)
    for m in models:
        if m is not None:
            named += [(_file_name(m), "the output model"), (data_path(_file_name(m)), "the output's data file")]
    named += [(_file_name(o), "another output") for o in others if o is not None]
    sources = [Path(i) for i in inputs if i is not None]
    for i, (path, what) in enumerate(named):
        refuse_non_regular(path)
        _check_folder(path, make_folders)
        for src in sources:
            if _same(path, src) and what == "the output model" and not overwrite:
                raise OutputError(f"{path}: output is the input model; pass --overwrite to replace it")
            if _same(path, src) and what != "the output model":
                raise OutputError(f"{path}: is the input {src}; an output never replaces an input")
        for other, other_what in named[:i]:
            if _same(path, other):
                raise OutputError(f"{path}: is also {other_what} of this run; give each output its own file")


def check_output_path(dst: PathLike, src: Optional[PathLike] = None, overwrite: bool = False) -> Path:
    """:func:`check_outputs` for one model file ``dst`` read from ``src``; returns ``dst`` as a Path."""
    check_outputs([dst], inputs=[src], overwrite=overwrite)
    return Path(dst)


def write_text(path: PathLike, text: str) -> None:
    """Write a small text file (a report) atomically: a temporary file beside it, renamed into place.

    A run stopped or failing midway leaves the old file or none, never half of one; a path that has
    become a device, FIFO... since the run's checks is refused. Raises OSError.
    """
    out = Path(path)
    refuse_non_regular(out)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent if str(out.parent) else ".")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # as open() would make it, not mkstemp's 0600
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        refuse_non_regular(out, follow=False)
        with deferred_signals():
            os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _file_name(path: PathLike) -> Path:
    """``path`` as a Path, refused when its spelling names a folder (``out/x.onnx/``, ``.``)."""
    text = os.fspath(path)
    if not text or text.endswith(os.sep) or (os.altsep and text.endswith(os.altsep)) or Path(text).name in ("", ".", ".."):
        raise OutputError(f"{text or repr(text)}: names a folder, not a file; give a file name")
    return Path(text)


def _check_folder(path: Path, make_folders: bool) -> None:
    folder = path.parent if str(path.parent) else Path(".")
    if make_folders:
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
    if not folder.is_dir():
        missing = "is not a folder" if folder.exists() else "does not exist"
        raise OutputError(f"{path}: folder {folder} {missing} (k3opt creates no folders here: create it first)")
    if not os.access(folder, os.W_OK):
        raise OutputError(f"{path}: folder {folder} is not writable")


def _same(a: Path, b: Path) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return a.samefile(b)
    except OSError:
        return False
