"""Facts about ONNX op types that several passes act on."""
from __future__ import annotations

from typing import Optional

from ...graph.ir import Node, rank

#: Ops whose result is not a function of their inputs: never folded, never merged as common subexpressions.
RANDOM_OPS = frozenset(
    {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli"}
)


def perm_of(node: Node) -> Optional[list[int]]:
    """The permutation of a Transpose (its default reverses the axes)."""
    perm = node.attrs.get("perm")
    if perm is not None:
        return [int(p) for p in perm]
    r = rank(node.inputs[0])
    return None if r is None else list(reversed(range(r)))
