"""The ``k3opt`` console command: signal handlers first, then the (heavy) command line.

SIGINT, SIGTERM or SIGHUP while Python imports onnx, onnxruntime and numpy ends the run with one line
and exit status 2, as it does later; an import that fails (a broken install, ``ulimit -v`` too low)
is one line too, not a traceback.
"""
from __future__ import annotations

import sys

from .interrupts import Interrupted, install


def main() -> None:
    install()
    try:
        from .cli import main as cli
    except KeyboardInterrupt as exc:
        name = exc.name if isinstance(exc, Interrupted) else "SIGINT"
        _fail(f"interrupted ({name}) while starting; nothing was written")
    except (ImportError, MemoryError) as exc:
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        _fail(f"cannot start: {type(exc).__name__}: {why[:300]} (out of memory, or a broken install)")
    cli(prog_name="k3opt")


def _fail(message: str) -> None:
    print(f"k3opt: error: {message}", file=sys.stderr)
    sys.exit(2)
