"""Facts about ONNX op types that several passes act on."""
from __future__ import annotations

from typing import Optional

from ...graph.ir import Node, rank
from ...pipeline.random_outputs import RANDOM_OPS

__all__ = ["RANDOM_OPS", "perm_of"]


def perm_of(node: Node) -> Optional[list[int]]:
    """The permutation of a Transpose (its default reverses the axes); None when unknown, or when ``perm`` is no
    permutation of the axes (an invalid model: nothing may be computed from it)."""
    perm = node.attrs.get("perm")
    if perm is not None:
        try:
            values = [int(p) for p in perm]
        except (TypeError, ValueError):
            return None
        r = rank(node.inputs[0])
        valid = sorted(values) == list(range(len(values))) and r in (None, len(values))
        return values if valid else None
    r = rank(node.inputs[0])
    return None if r is None else list(reversed(range(r)))
