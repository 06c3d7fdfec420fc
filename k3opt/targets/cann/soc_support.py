"""Which NPU ops have a kernel on which Ascend chip family: what ``--soc-version`` lets the cann lowering emit.

ATC maps an NPU node whatever the SoC; the build then fails (EZ3003, "no kernel") on a chip whose op
library lacks it. With the SoC known, k3opt keeps such a site decomposed instead, and says why.

Sources (the products tables of the aclnn pages in cann/ops-transformer, read in the mirror
``yuanfang-chen/ops-transformer``; see docs/cann.md):

- ``posembedding/rotary_position_embedding/docs/aclnnRotaryPositionEmbedding.md`` ([RoPE-doc]): Atlas A2
  training/inference (Ascend910B*), Atlas A3 (Ascend910_93*) and Ascend 910_95; NOT Atlas inference
  (Ascend310P*), Atlas 200I/500 A2 (Ascend310B*) or Atlas training (Ascend910, Ascend910A/ProA/ProB/PremiumA).

An op not in :data:`NO_KERNEL` is not restricted here (its page lists the chip, or k3opt has not read it):
ATC remains the judge.
"""
from __future__ import annotations

import re
from typing import Optional

#: Chip family of a ``--soc-version`` value, by prefix (longest first where they overlap).
_FAMILIES = (
    (re.compile(r"^Ascend910_93"), "Atlas A3 (Ascend910_93)"),
    (re.compile(r"^Ascend910_95"), "Ascend 910_95"),
    (re.compile(r"^Ascend910B"), "Atlas A2 (Ascend910B)"),
    (re.compile(r"^Ascend910(A|ProA|ProB|PremiumA)?$"), "Atlas training (Ascend910)"),
    (re.compile(r"^Ascend310P"), "Atlas inference (Ascend310P)"),
    (re.compile(r"^Ascend310B"), "Atlas 200I/500 A2 (Ascend310B)"),
    (re.compile(r"^Ascend310$"), "Ascend310"),
)

#: NPU op -> the chip families whose op library has no kernel for it, with the source.
NO_KERNEL: dict[str, tuple[frozenset[str], str]] = {
    "NPURotaryPositionEmbedding": (frozenset({"Atlas inference (Ascend310P)", "Atlas 200I/500 A2 (Ascend310B)",
                                              "Atlas training (Ascend910)", "Ascend310"}),
                                   "aclnnRotaryPositionEmbedding's products table"),
}


def family(soc_version: str) -> Optional[str]:
    """The chip family of ``soc_version`` (e.g. ``Ascend310P3`` -> Atlas inference), None when unknown."""
    return next((name for pattern, name in _FAMILIES if pattern.match(soc_version)), None)


def missing_kernel(op: str, soc_version: Optional[str]) -> Optional[str]:
    """Why ``op`` must not be emitted for ``soc_version`` (no kernel there), or None (allowed, or no SoC given)."""
    if not soc_version or op not in NO_KERNEL:
        return None
    chips, source = NO_KERNEL[op]
    fam = family(str(soc_version))
    if fam in chips:
        return f"{op} has no kernel on {soc_version} ({fam}; {source})"
    return None
