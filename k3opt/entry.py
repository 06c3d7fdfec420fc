"""The ``k3opt`` console command: signal handlers first, then the (heavy) command line.

SIGINT, SIGTERM or SIGHUP while Python imports onnx, onnxruntime and numpy ends the run with one line
and exit status 2, as it does later. Any failure of those imports is one line too, never a traceback:
under ``ulimit -v`` a native extension fails in many ways (ImportError, MemoryError, SystemError from
numpy's initialisation, OSError, a half-initialised module's AttributeError), and which one depends on
where the limit falls, which varies with the machine's load.
"""
from __future__ import annotations

import os
import sys

from .interrupts import Interrupted, install


def main() -> None:
    install()
    _load_unwinder()
    try:
        from .cli import main as cli
    except KeyboardInterrupt as exc:
        name = exc.name if isinstance(exc, Interrupted) else "SIGINT"
        _fail(f"interrupted ({name}) while starting; nothing was written")
    except Exception as exc:  # noqa: BLE001 - whatever an import raises, start-up failed: one line
        _fail(f"cannot start: {_describe(exc)} (out of memory, or a broken install)")
    cli(prog_name="k3opt")


def _load_unwinder() -> None:
    """Load libgcc_s now, while memory is plenty: glibc loads it on first use, when a thread exits or a C++
    error unwinds (onnxruntime out of memory), and aborts the process when that load fails under ``ulimit -v``
    (\"libgcc_s.so.1 must be installed for unwinding to work\") instead of letting the error reach Python."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libgcc_s.so.1")
        except (ImportError, OSError):  # not there (musl, static builds): nothing to preload
            pass


def _describe(exc: BaseException) -> str:
    """``Type: first line`` of ``exc``, at most 300 characters; never raises (memory may be short)."""
    try:
        text = str(exc).strip()
        why = text.splitlines()[0] if text else type(exc).__name__
        return f"{type(exc).__name__}: {why[:300]}"
    except Exception:  # noqa: BLE001 - a MemoryError while formatting: the type is enough
        return type(exc).__name__


#: The line written when even formatting the error fails (a constant: it needs no memory to exist).
_NO_MEMORY = b"k3opt: error: cannot start: out of memory\n"


def _fail(message: str) -> None:
    """The one line, and exit status 2. Nothing has been done yet, so the process ends at once: under
    ``ulimit -v`` raising SystemExit (or printing) may itself fail, and the interpreter's report of that
    is a traceback."""
    try:
        line = f"k3opt: error: {message}\n".encode("utf-8", "replace")
    except BaseException:  # noqa: BLE001 - MemoryError
        line = _NO_MEMORY
    try:
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001 - nothing of ours is buffered there anyway
        pass
    os.write(2, line)
    os._exit(2)
