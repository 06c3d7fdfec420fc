"""Append-only writing of big data files around the page cache (Linux ``O_DIRECT``).

Why: a buffered write of a multi-GB weights file first allocates and dirties
as much page cache as it writes. Where fresh memory is expensive (a VM whose
guest pages are backed on first touch, a container whose page cache counts
against its memory limit) that costs as much as a slow disk (on the
benchmark machine, direct writes were an order of magnitude faster).
:class:`DirectWriter` writes through one page-aligned buffer
straight to the device instead, and falls back to ordinary writes on a file
system that refuses ``O_DIRECT`` (tmpfs, some FUSE mounts); platforms
without ``O_DIRECT`` get the ordinary buffered file.
"""
from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path
from typing import BinaryIO, Union

ALIGN = 4096  # covers every logical block size up to a page
BUFFER = 8 * 2**20


class DirectWriter:
    """Sequential writer with the small file interface k3opt.io's savers use.

    ``write``, ``tell``, ``flush`` (everything so far is in the file, which has
    exactly ``tell()`` bytes), ``fileno``, ``copy_from`` (bytes of another file,
    read straight into the buffer) and ``close``. Blocks go out whole and
    aligned; the unfinished last block is written zero-padded by ``flush`` and
    the file truncated to its true length, then rewritten in place as it grows.
    ``direct`` says whether the writes still bypass the page cache.
    """

    def __init__(self, path: Union[str, os.PathLike]) -> None:
        self.direct = True
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o666)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self.direct = False
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        self._size = BUFFER
        self._buffer = mmap.mmap(-1, self._size)
        self._view = memoryview(self._buffer)
        self._start = 0  # file offset of the buffer's first byte (a multiple of ALIGN)
        self._fill = 0

    def write(self, data: Union[bytes, bytearray, memoryview]) -> int:
        """Append ``data``; returns its length."""
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        done = 0
        while done < len(view):
            n = min(len(view) - done, self._size - self._fill)
            self._view[self._fill : self._fill + n] = view[done : done + n]
            self._fill += n
            done += n
            self._drain_full()
        return done

    def copy_from(self, src: BinaryIO, offset: int, length: int) -> int:
        """Append ``length`` bytes of ``src`` from ``offset``; returns how many it had (less at its end)."""
        done = 0
        while done < length:
            want = min(length - done, self._size - self._fill)
            n = os.preadv(src.fileno(), [self._view[self._fill : self._fill + want]], offset + done)
            if n == 0:
                break
            self._fill += n
            done += n
            self._drain_full()
        return done

    def tell(self) -> int:
        return self._start + self._fill

    def fileno(self) -> int:
        return self._fd

    def flush(self) -> None:
        """Put every byte written so far in the file; the file's length becomes ``tell()``."""
        padded = -(-self._fill // ALIGN) * ALIGN
        self._view[self._fill : padded] = bytes(padded - self._fill)
        self._pwrite(padded)
        os.ftruncate(self._fd, self.tell())

    def close(self, flush: bool = True) -> None:
        """Flush (unless told not to: the file is being abandoned) and release the file and the buffer."""
        if self._fd < 0:
            return
        try:
            if flush:
                self.flush()
        finally:
            os.close(self._fd)
            self._fd = -1
            self._view.release()
            try:
                self._buffer.close()
            except BufferError:  # a traceback still holds a slice of it; the mapping goes with that
                pass

    def __enter__(self) -> "DirectWriter":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(flush=exc_type is None)  # after an error the temporary file is deleted anyway

    def _drain_full(self) -> None:
        """Write the buffer out once it is full and start it again."""
        if self._fill == self._size:
            self._pwrite(self._size)
            self._start += self._size
            self._fill = 0

    def _pwrite(self, size: int) -> None:
        done = 0
        while done < size:
            try:
                done += os.pwrite(self._fd, self._view[done:size], self._start + done)
            except OSError as exc:  # O_DIRECT accepted at open but not for these writes
                if exc.errno != errno.EINVAL or not self.direct:
                    raise
                import fcntl

                fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                self.direct = False


def direct_writer_or_file(path: Path, direct: bool) -> Union[DirectWriter, BinaryIO]:
    """A :class:`DirectWriter` on ``path`` when ``direct`` and the platform has O_DIRECT, else the buffered file."""
    return DirectWriter(path) if direct and hasattr(os, "O_DIRECT") else open(path, "wb")
