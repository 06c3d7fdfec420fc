"""unflatten-matmul: ``Reshape(MatMul(Reshape(x, [-1, K]), W), T)`` becomes ``Reshape(MatMul(x, W), T)``.

tf2onnx and Keras export a Dense layer on a rank-3 tensor as a flatten to 2-D, the MatMul, and a Reshape
back (often through a Split of merged projections): ``MatMul`` broadcasts over the leading dims itself, so
the flatten goes, and a Reshape back to ``x``'s leading dims then reshapes a tensor that already has that
shape (remove-noop-ops drops it). Exact: a Reshape depends only on its input's elements in order and the
target, and ``MatMul(x, W)`` holds the elements of ``MatMul(flat(x), W)`` in the same order; a target with
a 0 (a copy of the input's dim, which changes) or computed at run time is refused.

Applies when ``x`` has rank 3 or more and its last dim is ``K``, the flatten's target is 2-D with ``K``
last, ``W`` is a 2-D constant, and every reader of the MatMul's result is such a Reshape, or a ``Split``
on the last axis whose every output is read by such Reshapes only (and none is a graph output). Not for
``--target cann``: ATC fuses 2-D MatMuls with their bias (the flatten form fuse-matmul-add makes there).
"""
from __future__ import annotations

from typing import Optional

from ...graph.ir import Graph, Node, Tensor, const_tensor, is_graph_output, producer, rank, set_input
from ...graph.small_constants import small_int_list
from ...graph.symbolic.dims import Dims
from ...pipeline.pass_base import PassContext
from .._rewire import NodeRewritePass


def _reshape_readers_only(graph: Graph, t: Tensor) -> bool:
    """Every reader of ``t`` is a Reshape of it to a constant target without a 0 copy; ``t`` no graph output."""
    if is_graph_output(graph, t) or not t.outputs:
        return False
    for r in t.outputs:
        if r.op != "Reshape" or (r.domain or "") not in ("", "ai.onnx") or r.inputs[0] is not t or len(r.inputs) < 2:
            return False
        target = small_int_list(r.inputs[1])
        if target is None or (0 in target and not r.attrs.get("allowzero", 0)):
            return False
    return True


def _split_on_last(node: Node) -> bool:
    return node.op == "Split" and (node.domain or "") in ("", "ai.onnx") and int(node.attrs.get("axis", 0)) in (1, -1)


class UnflattenMatMul(NodeRewritePass):
    name = "unflatten-matmul"
    description = "Reshape(x, [-1, K]) -> MatMul(W) -> Reshape: the MatMul reads x (rank >= 3) itself."
    order = 266
    ops = frozenset({"MatMul"})

    def run(self, graph: Graph, ctx: PassContext) -> int:
        if ctx.target.prefers_2d_matmuls:  # cann: ATC's MatMul/Gemm on the flattened 2-D form
            return 0
        return super().run(graph, ctx)

    def rewrite(self, graph: Graph, node: Node, ctx: PassContext, dead: list[Node]) -> bool:
        x = self._flattened(ctx.dims(graph), node)
        if x is None:
            return False
        y = node.outputs[0]
        splits = [r for r in y.outputs if _split_on_last(r)]
        if splits and (len(splits) != len(y.outputs) or is_graph_output(graph, y)
                       or not all(_reshape_readers_only(graph, o) for s in splits for o in s.outputs)):
            return False
        if not splits and not _reshape_readers_only(graph, y):
            return False
        set_input(node, 0, x)
        for s in splits:
            s.attrs["axis"] = -1
        return True

    @staticmethod
    def _flattened(dims: Dims, node: Node) -> Optional[Tensor]:
        """``x`` when the MatMul reads ``Reshape(x, [-1, K])`` (rank(x) >= 3, x's last dim K) and a 2-D constant W."""
        if len(node.inputs) != 2:
            return None
        w = const_tensor(node.inputs[1])
        flat = producer(node.inputs[0])
        if w is None or len(w.shape) != 2 or flat is None or flat.op != "Reshape" or len(flat.inputs) < 2:
            return None
        if (flat.domain or "") not in ("", "ai.onnx"):
            return None
        x, target = flat.inputs[0], small_int_list(flat.inputs[1])
        r = rank(x)
        if target is None or len(target) != 2 or r is None or r < 3:
            return None
        k = int(w.shape[0])
        return x if target[1] == k and dims.at(x, r - 1) == k else None
