"""The private folder a save writes into, next to its output, and the removal of those left by dead runs.

A save writes ``.OUT.<random>.tmp/`` beside ``OUT`` (same file system, so its files rename into place)
and removes it at the end, whatever happens. Only SIGKILL (a CI timeout, the OOM killer) or a power
loss can leave one behind. So each folder is locked while its writer lives: the writer makes it as
``.OUT.<random>.new``, takes an exclusive ``flock`` on it, and only then renames it to its ``.tmp``
name (same inode, so the lock stays); it lets the lock go after it removed the folder. The next save
of the same output removes every ``.tmp`` folder whose lock it can take, i.e. whose writer is gone; a
live concurrent writer's folder is locked and left alone.
"""
from __future__ import annotations

import glob
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no locks, so dead runs' folders are left alone
    fcntl = None  # type: ignore[assignment]

class TempFolder:
    """A new private folder next to an output, locked for this process until :meth:`remove`."""

    def __init__(self, path: Path, lock_fd: Optional[int]):
        self.path = path
        self._fd = lock_fd
        self._files: list[str] = []  # paths of the files the writer said it makes, for :meth:`remove`

    def expect(self, *names: str) -> None:
        """The writer will make files ``names`` in the folder: :meth:`remove` unlinks them by name, with no
        directory listing (which needs memory: under ``ulimit -v`` ``scandir`` fails with ENOMEM)."""
        self._files += [os.path.join(self.path, name) for name in names]

    @classmethod
    def next_to(cls, out: Path) -> "TempFolder":
        """Remove dead runs' folders for ``out``, then make and lock a new one."""
        remove_dead(out)
        parent = out.parent if str(out.parent) else Path(".")
        if fcntl is None:
            return cls(Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=parent)), None)
        new = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".new", dir=parent))
        fd = os.open(new, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            path = new.with_name(new.name[: -len(".new")] + ".tmp")
            os.rename(new, path)  # visible to cleaners only now, locked
        except BaseException:
            os.close(fd)
            shutil.rmtree(new, ignore_errors=True)
            raise
        return cls(path, fd)

    def remove(self) -> None:
        """Delete the folder, then let the lock go (a cleaner never sees it marked and unlocked)."""
        for path in self._files:
            try:
                os.unlink(path)
            except OSError:
                pass
        try:
            os.rmdir(self.path)
        except OSError:  # files the writer did not name
            shutil.rmtree(self.path, ignore_errors=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def temp_folders(out: Path) -> list[Path]:
    """The private folders of saves of ``out`` present now (live or dead)."""
    parent = out.parent if str(out.parent) else Path(".")
    pattern = os.path.join(glob.escape(str(parent)), glob.escape(f".{out.name}.") + "*.tmp")
    return [Path(p) for p in glob.glob(pattern) if os.path.isdir(p) and not os.path.islink(p)]


def remove_dead(out: Path) -> list[Path]:
    """Remove the folders of saves of ``out`` whose writer is gone (their lock is free); returns them."""
    if fcntl is None:
        return []
    removed = []
    for folder in temp_folders(out):
        try:
            fd = os.open(folder, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its writer lives
            os.close(fd)
            continue
        try:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        finally:
            os.close(fd)
    return removed
