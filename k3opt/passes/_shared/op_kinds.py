"""Facts about ONNX op types that several passes act on."""
from __future__ import annotations

from typing import Optional

from ...graph.ir import Node, rank
from ...pipeline.random_outputs import RANDOM_OPS

__all__ = ["RANDOM_OPS", "perm_of"]


def perm_of(node: Node) -> Optional[list[int]]:
    """The permutation of a Transpose (its default reverses the axes)."""
    perm = node.attrs.get("perm")
    if perm is not None:
        return [int(p) for p in perm]
    r = rank(node.inputs[0])
    return None if r is None else list(reversed(range(r)))
