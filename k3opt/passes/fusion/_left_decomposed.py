"""The report of a fusion that leaves its sites decomposed (below the opset of its op, or for another target).

fuse-rmsnorm, fuse-rotary and fuse-attention count what they found on the final graph (their ``finish``) and
say why it stays decomposed; one note per pass, the final graph's, however many rounds ran.
"""
from __future__ import annotations

import re

from ...pipeline.pass_base import PassContext


def note_left_decomposed(ctx: PassContext, counter: str, found: int, note: "re.Pattern[str]", label: str,
                         min_opset: int, lowered_by_target: bool = False) -> None:
    """Set ``ctx.counters[counter]`` to ``found`` and replace any earlier note matching ``note`` with
    ``"{found} {label} found, left decomposed: {why}"`` (none when nothing was found).

    ``lowered_by_target``: the target has lowering passes for these sites (the note points at their lines).
    """
    ctx.count(counter, found - ctx.counters.get(counter, 0))
    ctx.notes[:] = [n for n in ctx.notes if not note.match(n)]  # the final graph's count only
    if found:
        if ctx.target.fuses_to_standard_ops:
            why = f"opset < {min_opset}"
        else:
            why = f"target {ctx.target}" + (" (its lowering passes decide, see the lowering lines)"
                                            if lowered_by_target else "")
        ctx.note(f"{found} {label} found, left decomposed: {why}")
