"""Parsers for ``--pass-option KEY=VALUE`` values, checked before any work (exit 2 naming what is accepted).

A pass declares one per option in ``Pass.option_values``; :func:`k3opt.pipeline.pass_base.check_pass_options`
runs them and hands the passes the parsed values. Each parser takes the value as given (a string from the
command line, or what a library caller passed) and returns it parsed, or raises ValueError saying what
it accepts.
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable

Parser = Callable[[Any], Any]

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mi": 1024**2, "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gi": 1024**3, "gib": 1024**3}
_AMOUNT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
#: Sizes beyond this are not sizes (int64 holds them, nothing here needs more).
_LIMIT = 2**62


def _amount(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"expected {what}")
    if isinstance(value, int):
        number = value
    elif isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ValueError(f"expected {what}")
        number = int(value)
    else:
        found = _AMOUNT.match(str(value))
        unit = found.group(2).lower() if found else None
        if found is None or unit not in _UNITS:
            raise ValueError(f"expected {what}")
        scaled = float(found.group(1)) * _UNITS[unit]
        if scaled != int(scaled):
            raise ValueError(f"expected {what}: a whole number")
        number = int(scaled)
    if not 0 <= number <= _LIMIT:
        raise ValueError(f"expected {what}, from 0 to 2**62")
    return number


def byte_size(value: Any) -> int:
    """Bytes, >= 0: ``1048576``, ``1MiB``, ``1 MiB``, ``512KiB``, ``1MB`` (10**6)."""
    return _amount(value, "a number of bytes such as 1048576, 1MiB or 512KiB")


def count(value: Any) -> int:
    """A count, >= 0: ``1048576``, ``1Mi``, ``64Ki``, ``1M`` (10**6)."""
    return _amount(value, "a count such as 1048576, 1Mi or 64Ki")


def choice(*values: str) -> Parser:
    """One of ``values`` (as written)."""

    def parse(value: Any) -> str:
        if str(value) not in values:
            raise ValueError(f"expected one of {', '.join(values)}")
        return str(value)

    return parse
