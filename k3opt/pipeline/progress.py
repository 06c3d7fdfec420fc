"""Progress lines on stderr for steps that take more than about a second.

A step is announced by calling the :class:`Progress` object with its name;
the line is printed only if the step is still running after ``delay``
seconds, so fast runs stay silent. The current step is kept even when
printing is off, to name it in "internal error" messages.
"""
from __future__ import annotations

import sys
import threading
from typing import Optional, TextIO


class Progress:
    """Callable progress sink (``progress(message)``) that prints slow steps only."""

    def __init__(self, enabled: bool = True, delay: float = 1.0, stream: Optional[TextIO] = None):
        self.enabled = enabled
        self.delay = delay
        self.stream = stream
        self.current: Optional[str] = None
        self._timer: Optional[threading.Timer] = None
        self._lock = threading.Lock()

    def __call__(self, message: str) -> None:
        with self._lock:
            self._cancel()
            self.current = message
            if self.enabled:
                self._timer = threading.Timer(self.delay, self._show, (message,))
                self._timer.daemon = True
                self._timer.start()

    def _show(self, message: str) -> None:
        with self._lock:
            if message == self.current:
                print(f"k3opt: {message}...", file=self.stream or sys.stderr, flush=True)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def close(self) -> None:
        """Stop any pending line (call at the end of a run)."""
        with self._lock:
            self._cancel()
