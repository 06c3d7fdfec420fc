"""Signals: SIGTERM and SIGHUP end a command run as SIGINT does, and a few steps are never cut in half.

The command line (k3opt/entry.py) calls :func:`install` first thing: the three signals then raise
:class:`Interrupted` (a KeyboardInterrupt) in the main thread, so every ``finally`` runs, the save's
temporary folder is removed and the CLI prints one line and exits 2. :func:`deferred_signals` holds a
signal back over a short critical step (the renames that put an output in place) and delivers it after.
Imports only the standard library: it is loaded before anything heavy.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator

#: The signals a command run treats as "stop now, leave nothing behind".
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


class Interrupted(KeyboardInterrupt):
    """The run was stopped by ``signum`` (SIGINT, SIGTERM or SIGHUP)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def _raise(signum: int, frame: Any) -> None:
    raise Interrupted(signum)


def install() -> dict[int, Any]:
    """Make SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted` (main thread only; the CLI's first step).

    Returns the handlers replaced, for :func:`restore` (a command run inside a Python process, e.g. a test
    or a benchmark calling the CLI, leaves the process's handlers as it found them).
    """
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in STOP_SIGNALS:
        signal.signal(sig, _raise)
    return previous


def restore(previous: dict[int, Any]) -> None:
    """Put back the handlers :func:`install` replaced."""
    for sig, handler in previous.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


@contextlib.contextmanager
def deferred_signals() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP back while the block runs, then deliver the first one that came.

    Delivered to the handler that was in place (the CLI's, Python's KeyboardInterrupt, or the default
    action), so a library caller sees what it would have seen, only after the block. Outside the main
    thread signals cannot be caught there anyway: the block just runs.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

    def hold(signum: int, frame: Any) -> None:
        pending.append(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, hold)
    try:
        yield
    finally:
        restore(previous)
        if pending:
            signal.raise_signal(pending[0])
