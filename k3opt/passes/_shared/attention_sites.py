"""Attention-shaped sites the recogniser never looked at: a Softmax between two MatMul-like ops that its
pattern does not reach (an Einsum, a Cast or Reshape in between, a body's softmax between products of the
enclosing graph). fuse-attention records each with the reason, so a miss is never silent.
"""
from __future__ import annotations

from typing import Iterator, Optional

from ...graph.ir import Graph, Node, Tensor, all_graphs, producer

#: Ops that compute q·k^T or probs·v.
PRODUCTS = frozenset({"MatMul", "Einsum", "Gemm", "MatMulInteger", "QLinearMatMul"})
#: Ops that may stand between the products and the Softmax of an attention (scale, mask, casts, views).
_BETWEEN = frozenset({"Mul", "Div", "Add", "Sub", "Where", "Cast", "Reshape", "Transpose", "Squeeze", "Unsqueeze",
                      "IsNaN", "Dropout", "Identity", "Expand", "Tanh", "Max", "Min", "Clip", "Flatten"})
_DEPTH = 4


def _upstream(t: Tensor, depth: int = _DEPTH) -> Optional[Node]:
    """The MatMul-like op a few element-wise/view steps above ``t`` (the scores' product), else None."""
    n = producer(t)
    if n is None or depth == 0:
        return None
    if n.op in PRODUCTS:
        return n
    if n.op not in _BETWEEN:
        return None
    return next((p for x in n.inputs if (p := _upstream(x, depth - 1)) is not None), None)


def _downstream(t: Tensor, depth: int = _DEPTH) -> Optional[Node]:
    """The MatMul-like op a few steps below ``t`` that reads the probabilities, else None."""
    if depth == 0:
        return None
    for n in t.outputs:
        if n.op in PRODUCTS:
            return n
        if n.op in _BETWEEN:
            found = next((d for o in n.outputs if (d := _downstream(o, depth - 1)) is not None), None)
            if found is not None:
                return found
    return None


def attention_sites(graph: Graph) -> Iterator[tuple[Node, Node, Node, bool]]:
    """Each ``(softmax, scores' product, probabilities' reader, all three in the softmax's own graph)`` of
    ``graph`` and its bodies (a body reads the enclosing graph's tensors: its products may stand there)."""
    for g in all_graphs(graph):
        own = {id(n) for n in g.nodes} if g is not graph else None
        for sm in g.nodes:
            if sm.op != "Softmax" or (sm.domain or "") not in ("", "ai.onnx") or not sm.inputs or not sm.outputs:
                continue
            up, down = _upstream(sm.inputs[0]), _downstream(sm.outputs[0])
            if up is not None and down is not None:
                yield sm, up, down, own is None or (id(up) in own and id(down) in own)


def site_name(softmax: Node) -> str:
    """How the report names an attention site: its Softmax's name, else the tensor the Softmax computes."""
    return softmax.name or (softmax.outputs[0].name if softmax.outputs else "")


def why_unrecognised(up: Node, down: Node, local: bool) -> str:
    """The reason the recogniser's pattern did not reach a site (``local``: its products are in the softmax's
    own graph)."""
    if not local:
        return ("a body's softmax between products of the enclosing graph: a fusion does not move the enclosing "
                "graph's work into an If/Loop/Scan body")
    for n, role in ((up, "the scores come from"), (down, "the probabilities are multiplied by")):
        if n.op != "MatMul":
            return f"{role} a {n.op} ('{n.name}'), not a MatMul"
    return ("the ops between the two MatMuls are not the pattern's (scale, one additive mask, Softmax, "
            "the IsNaN guard): a Cast, Reshape or Transpose stands in between")
