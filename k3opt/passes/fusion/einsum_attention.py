"""einsum-attention: the two Einsums of an attention (Keras MultiHeadAttention as tf2onnx writes it) become
Transposes and MatMuls, for fuse-attention and the cann lowering.

Keras computes ``einsum("aecd,abcd->acbe", key, query)`` for the scores and ``einsum("acbe,aecd->abcd",
probs, value)`` for the context. A two-operand Einsum with one contracted letter, one free letter per operand
and the rest batch letters (in both operands and the output) is a batched matrix product: each operand is
transposed to ``[batch..., free, contracted]`` / ``[batch..., contracted, free]``, multiplied, and the result
transposed to the equation's output order (identity permutations are left out). The sums are the same;
only their order may differ in the last bits, which the verification bounds.

Only the Einsums on either side of a Softmax are rewritten, and only where an attention op may come of it
(``--opset 23`` and up on the onnx target, or the cann target): elsewhere an Einsum stays one node.
"""
from __future__ import annotations

from typing import Optional

from ... import graph as gs
from ...graph.ir import Graph, Node, Tensor, producer, replace_uses
from ...pipeline.pass_base import Hints, Pass, PassContext
from .._rewire import detach, remove

ATTENTION_OPSET = 23


def _parse(equation: str) -> Optional[tuple[str, str, str]]:
    eq = equation.replace(" ", "")
    if "->" not in eq or "..." in eq:
        return None
    ins, out = eq.split("->")
    parts = ins.split(",")
    if len(parts) != 2:
        return None
    a, b = parts
    if any(len(set(x)) != len(x) for x in (a, b, out)) or not set(out) <= set(a) | set(b):
        return None
    return a, b, out


def matmul_plan(equation: str) -> Optional[tuple[bool, list[int], list[int], list[int]]]:
    """(operands swapped, perm of the left operand, perm of the right one, perm of their product to the output)
    of a batched-matmul equation, else None; the operand order whose product is already in the output's order
    is preferred (``k q^T`` transposed is ``q k^T``: the recogniser wants the latter)."""
    parsed = _parse(equation)
    if parsed is None:
        return None
    plans = []
    for swapped, (a, b) in ((False, parsed[:2]), (True, parsed[1::-1])):
        out = parsed[2]
        batch = [c for c in out if c in a and c in b]
        contracted = [c for c in a if c in b and c not in out]
        free_a = [c for c in a if c not in b]
        free_b = [c for c in b if c not in a]
        if len(contracted) != 1 or len(free_a) != 1 or len(free_b) != 1 or len(batch) + 2 != len(a) \
                or len(batch) + 2 != len(b) or len(out) != len(batch) + 2:
            return None
        product = batch + free_a + free_b
        plans.append((swapped, [a.index(c) for c in batch + free_a + contracted],
                      [b.index(c) for c in batch + contracted + free_b], [product.index(c) for c in out]))
    return min(plans, key=lambda p: p[3] != sorted(p[3]))


def _rewrite(graph: Graph, node: Node, ctx: PassContext, dead: list[Node]) -> bool:
    plan = matmul_plan(str(node.attrs.get("equation", "")))
    if plan is None or len(node.inputs) != 2:
        return False
    base = node.name or "einsum"
    new: list[Node] = []

    def transposed(t: Tensor, perm: list[int]) -> Tensor:
        if perm == sorted(perm):
            return t
        out = gs.Variable(ctx.fresh_name(f"{base}_t"), dtype=t.dtype,
                          shape=None if t.shape is None else [t.shape[p] for p in perm])
        new.append(gs.Node("Transpose", ctx.fresh_name(f"{base}_Transpose"), attrs={"perm": perm}, inputs=[t],
                           outputs=[out]))
        return out

    swapped, pa, pb, pout = plan
    left, right = (node.inputs[1], node.inputs[0]) if swapped else (node.inputs[0], node.inputs[1])
    x, y = transposed(left, pa), transposed(right, pb)
    old = node.outputs[0]
    if pout == sorted(pout):
        product = gs.Variable(ctx.fresh_name(f"{base}_matmul"), dtype=old.dtype, shape=old.shape)
        new.append(gs.Node("MatMul", ctx.fresh_name(f"{base}_MatMul"), inputs=[x, y], outputs=[product]))
        result = product
    else:
        product = gs.Variable(ctx.fresh_name(f"{base}_matmul"), dtype=old.dtype)
        new.append(gs.Node("MatMul", ctx.fresh_name(f"{base}_MatMul"), inputs=[x, y], outputs=[product]))
        result = transposed(product, pout)
    replace_uses(graph, old, result)
    detach(node, dead)
    graph.nodes.extend(new)
    ctx.count("attention_einsums_rewritten")
    return True


class EinsumAttention(Pass):
    """The Einsums around an attention's Softmax -> Transpose + MatMul (where an attention op can follow)."""

    name = "einsum-attention"
    description = ("the two Einsums of an attention (Keras/tf2onnx) -> Transposes and MatMuls, where fuse-attention "
                   "(opset >= 23) or the cann lowering can then take it")
    order = 517
    _hints = Hints(adds_bodies=False)
    anchor_ops = frozenset({"Einsum"})

    def run(self, graph: Graph, ctx: PassContext) -> int:
        if not (ctx.target.lowers_attention or ctx.emit_opset >= ATTENTION_OPSET):
            return 0
        dead: list[Node] = []
        done = 0
        for sm in [n for n in graph.nodes if n.op == "Softmax" and (n.domain or "") in ("", "ai.onnx")]:
            up = producer(sm.inputs[0]) if sm.inputs else None
            downs = [n for n in sm.outputs[0].outputs] if sm.outputs else []
            pair = [up] + downs if len(downs) == 1 else []
            if len(pair) == 2 and all(n is not None and n.op == "Einsum" and matmul_plan(
                    str(n.attrs.get("equation", ""))) is not None for n in pair) and len(sm.inputs[0].outputs) == 1:
                done += sum(_rewrite(graph, n, ctx, dead) for n in pair)
        remove(graph, dead)
        return done
