"""unfold-head-batch: attention computed with the heads folded into the batch (rank-3 scores ``[B*H, S, T]``)
is rewritten over the rank-4 ``[B, H, S, T]`` tensors it was folded from, for the attention recogniser.

Megatron, 3-D BMM exports (``torch.bmm`` of ``view(B*H, S, D)``) and some vision models compute
``softmax(q k^T * scale + mask) v`` on rank-3 tensors whose first dim is batch and heads flattened. The
rank-4 form computes the same numbers element for element: ``q3[b*H + h] == q4[b, h]`` by how a Reshape
flattens two leading dims. So where q, k^T and v are each provably such a flattening of a rank-4 tensor
(one head count H, static, for the three), the core is rebuilt on those tensors and its rank-3 output is
a Reshape of the rank-4 one; fuse-attention and the cann lowering then see the form they know.

A flattening is proved, for ``t3`` read as ``[B*H, a, b]``, when ``t3`` is

- ``Reshape(X, [*, a, b])`` of a rank-4 ``X = [B, H, a, b]`` (the target's last two elements provably
  X's last two dims: then the first is B*H, in X's order);
- ``Transpose(Y, [0, 2, 1])`` of such a ``Y`` (k^T of a flattened k): ``Transpose(X, [0, 1, 3, 2])``;
- ``Transpose(Reshape(X, [a, *, b]), [1, 0, 2])`` of a rank-4 ``X = [a, B, H, b]`` (Megatron's
  ``[S, B, H, D] -> view(S, B*H, D) -> transpose(0, 1)``): ``Transpose(X, [1, 2, 0, 3])``.

Between the two MatMuls only what keeps its meaning over the extra axis is taken: Mul/Div by a constant
scalar, one additive mask (of rank <= 2, or rank 3 with a first dim of 1, which broadcast the same; or
``[B*H, S, T]`` with S and T static, reshaped to ``[-1, H, S, T]``), the Softmax over the last axis and
torch's ``Where(IsNaN(p), 0, p)`` guard. Every intermediate must be read by the chain alone. Anything else
is left as it is, and fuse-attention records why the rank-3 site was declined.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ... import graph as gs
from ...graph.ir import (Graph, Node, Tensor, as_constant, const_scalar, disconnect, is_graph_output, producer,
                         replace_uses)
from ...patterns.schema import attr_value
from ...pipeline.pass_base import Hints, Pass, PassContext
from .._rewire import detach, remove
from .._shared.attention_sites import attention_sites, site_name

_DEFAULT = ("", "ai.onnx")


def _op(t: Tensor, *ops: str) -> Optional[Node]:
    n = producer(t)
    return n if n is not None and n.op in ops and (n.domain or "") in _DEFAULT else None


def _same(a: object, b: object) -> bool:
    return a is not None and a == b


class _Builder:
    """New nodes of one rewrite, named after the site; the run's dims of the graph (``dims``)."""

    def __init__(self, graph: Graph, ctx: PassContext, base: str):
        self.graph, self.ctx, self.base, self.nodes = graph, ctx, base, []
        self.dims = ctx.dims(graph)

    def node(self, op: str, inputs: list, attrs: Optional[dict] = None, like: Optional[Tensor] = None,
             shape: Optional[list] = None) -> Tensor:
        if op == "Transpose" and inputs[0].shape is not None:  # the heads dim is read off the new tensor
            shape = [inputs[0].shape[p] for p in attrs["perm"]]
        out = gs.Variable(self.ctx.fresh_name(f"{self.base}_{op.lower()}4"), dtype=like.dtype if like else None,
                          shape=shape)
        self.nodes.append(gs.Node(op, self.ctx.fresh_name(f"{self.base}_{op}4"), attrs=attrs or {}, inputs=inputs,
                                  outputs=[out]))
        return out

    def const(self, values: list) -> Tensor:
        return as_constant(self.ctx.fresh_name(f"{self.base}_shape4"), np.array(values, np.int64))


def _flattening(t3: Tensor, b: _Builder) -> Optional[tuple[Tensor, int]]:
    """``(X, k)`` when ``t3`` is a Reshape of a rank-4 ``X`` merging X's axes k and k+1 into its axis k (k is 0
    or 1): the target's other two elements are provably X's other two dims. A rank-3 ``X = [a, B, H*b]`` read
    as ``[a, B*H, b]`` (the head split merged into the flattening Reshape) is split into ``[a, B, H, b]``."""
    reshape = _op(t3, "Reshape")
    if reshape is None or len(reshape.inputs) != 2:
        return None
    x = reshape.inputs[0]
    dims, target = b.dims.of(x), b.dims.elements(reshape.inputs[1])
    if dims is None or target is None or len(target[0]) != 3:
        return None
    e = target[0]
    if 0 in e:  # a 0 copies the input's dim at its own index, which is not the one compared below
        return None
    if len(dims) == 4 and _same(e[1], dims[2]) and _same(e[2], dims[3]):
        return x, 0
    if len(dims) == 4 and _same(e[0], dims[0]) and _same(e[2], dims[3]):
        return x, 1
    width, head = dims[2] if len(dims) == 3 else None, e[2]
    if _same(e[0], dims[0]) and isinstance(width, int) and isinstance(head, int) and head > 0 and width % head == 0:
        shape = None if x.shape is None else list(x.shape[:2]) + [width // head, head]
        return b.node("Reshape", [x, b.const([0, 0, width // head, head])], like=x, shape=shape), 1
    return None


def _lifted(perm: list[int], k: int) -> list[int]:
    """A rank-3 permutation as the rank-4 one of the tensor whose axes k, k+1 the rank-3 axis k merges."""
    return [j for i in perm for j in ([k, k + 1] if i == k else [i] if i < k else [i + 1])]


def _unfold(t3: Tensor, b: _Builder) -> Optional[Tensor]:
    """The rank-4 ``[B, H, a, b]`` tensor whose first two dims ``t3`` flattens, or None when not proven."""
    scaled = _op(t3, "Mul", "Div")  # q scaled before q @ k^T (sdpa's d^-1/4): the same scalar on the rank-4 q
    if scaled is not None and len(scaled.inputs) == 2 and const_scalar(scaled.inputs[1]) is not None:
        inner = _unfold(scaled.inputs[0], b)
        return None if inner is None else b.node(scaled.op, [inner, scaled.inputs[1]], like=inner, shape=inner.shape)
    cache = _op(t3, "Concat")
    if cache is not None:
        return _unfold_cache(cache, b)
    flat = _flattening(t3, b)
    if flat is not None:
        return flat[0] if flat[1] == 0 else None
    transpose = _op(t3, "Transpose")
    perm = None if transpose is None else [int(p) for p in transpose.attrs.get("perm", [])]
    if perm is None or sorted(perm) != [0, 1, 2]:
        return None
    flat = _flattening(transpose.inputs[0], b)
    if flat is not None and perm[0] == flat[1]:  # Megatron: [S, B*H, D] -> transpose(0, 1)
        return b.node("Transpose", [flat[0]], {"perm": _lifted(perm, flat[1])}, like=flat[0])
    if perm[0] == 0:  # k^T of a flattened k
        inner = _unfold(transpose.inputs[0], b)
        return None if inner is None else b.node("Transpose", [inner], {"perm": _lifted(perm, 0)}, like=inner)
    return None


def _unfold_cache(concat: Node, b: _Builder) -> Optional[Tensor]:
    """A KV cache ``Concat(past, new)`` of rank-3 ``[B*H, T, D]`` parts along the sequence axis, one of them
    (the new keys or values) proven a flattening of ``[B, H, T, D]``: the Concat of the rank-4 parts, each other
    part (the cache input) read as ``Reshape(part, [-1, H, T', D])``, exact since the Concat makes its first dim
    the proven part's ``B*H``."""
    rank = None if concat.outputs[0].shape is None else len(concat.outputs[0].shape)
    if rank != 3 or int(concat.attrs.get("axis", 0)) not in (1, -2) or len(concat.inputs) < 2:
        return None
    parts = [_unfold(x, b) for x in concat.inputs]
    heads = {_heads(p, b) for p in parts if p is not None}
    if len(heads) != 1 or None in heads:
        return None
    h = heads.pop()
    proven = next(p for p in parts if p is not None)
    out = concat.outputs[0].shape
    shape = None if proven.shape is None else [proven.shape[0], h, out[1], out[2]]
    parts = [p if p is not None else _split_heads(x, h, b) for x, p in zip(concat.inputs, parts)]
    return b.node("Concat", parts, {"axis": 2}, like=concat.outputs[0], shape=shape)


def _split_heads(t3: Tensor, heads: int, b: _Builder) -> Tensor:
    """``Reshape(t3, [-1, heads, a, b])`` of a rank-3 ``[B*heads, a, b]`` (a and b read off its shape)."""
    tail = b.node("Shape", [t3], {"start": 1}) if b.ctx.opset >= 15 else \
        b.node("Slice", [b.node("Shape", [t3]), b.const([1]), b.const([3])])
    shape = None if t3.shape is None else [None, heads, *t3.shape[1:]]
    return b.node("Reshape", [t3, b.node("Concat", [b.const([-1, heads]), tail], {"axis": 0})], like=t3, shape=shape)


def _heads(t4: Tensor, b: _Builder) -> Optional[int]:
    dims = b.dims.of(t4)
    return dims[1] if dims is not None and isinstance(dims[1], int) else None


def _chain(graph: Graph, softmax: Node) -> "tuple[Node, list[Node], Node] | str":
    """(the q·k^T MatMul, the nodes from it to the probabilities in order, the probs·v MatMul), or why not."""
    nodes = [softmax]
    probs = softmax.outputs[0]
    readers = probs.outputs
    guard = next((n for n in readers if n.op == "IsNaN"), None)
    if guard is not None:
        where = [n for n in guard.outputs[0].outputs if n.op == "Where"]
        if len(where) != 1 or len(readers) != 2:
            return "the probabilities are read by more than the IsNaN guard and its Where"
        nodes = [softmax, guard, where[0]]
        probs = where[0].outputs[0]
    if len(probs.outputs) != 1 or is_graph_output(graph, probs) or probs.outputs[0].op != "MatMul" \
            or probs.outputs[0].inputs[0] is not probs:
        return "the probabilities are not read by probs @ v alone"
    pv = probs.outputs[0]
    t = softmax.inputs[0]
    while True:
        n = producer(t)
        if n is None or (n.domain or "") not in _DEFAULT:
            return "the scores are not computed by a MatMul"
        if len(t.outputs) != 1 or is_graph_output(graph, t):
            return f"'{t.name}' between the scores and the Softmax is also read elsewhere"
        if n.op == "MatMul":
            return n, nodes, pv
        if n.op in ("Mul", "Div", "Add") and len(n.inputs) == 2:
            nodes.insert(0, n)
            on_path = [x for x in n.inputs if _reaches_scores(x)]
            if len(on_path) != 1:
                return f"the {n.op} '{n.name}' before the Softmax does not combine the scores with one other operand"
            t = on_path[0]
            continue
        return f"a {n.op} stands between the scores and the Softmax"


def _reaches_scores(t: Tensor, depth: int = 4) -> bool:
    """``t`` is a rank-3 MatMul, or Mul/Div/Add of one, a few steps up (the scores' side of a binary op)."""
    n = producer(t)
    if n is None or depth == 0 or t.shape is None or len(t.shape) != 3:
        return False
    return n.op == "MatMul" or (n.op in ("Mul", "Div", "Add") and any(_reaches_scores(x, depth - 1) for x in n.inputs))


def _mask4(mask: Tensor, heads: int, b: _Builder, rows: object) -> Optional[Tensor]:
    """The mask operand of a rank-3 score whose first dim is ``rows`` (B*H), as it broadcasts against the rank-4
    scores (None: not proven)."""
    dims = b.dims.of(mask)
    if dims is None:
        return None
    if len(dims) <= 2 or (len(dims) == 3 and dims[0] == 1):
        return mask  # aligned right, it broadcasts over (B, H) as it did over B*H
    if len(dims) == 3 and isinstance(dims[1], int) and isinstance(dims[2], int):
        return b.node("Reshape", [mask, b.const([-1, heads, dims[1], dims[2]])], like=mask)
    if len(dims) == 3 and _same(dims[0], rows) and rows != 1:  # one row per batch*head: split like the scores
        return _split_heads(mask, heads, b)
    return None


def _rewrite(graph: Graph, softmax: Node, ctx: PassContext, dead: list[Node]) -> Optional[str]:
    """Unfold the rank-3 attention around ``softmax``; None when done, else why not."""
    found = _chain(graph, softmax)
    if isinstance(found, str):
        return found
    b = _Builder(graph, ctx, softmax.name or "attention")
    why = _rebuild(graph, softmax, ctx, dead, b, *found)
    if why is not None:
        for n in b.nodes:  # a refused attempt's nodes were linked to the tensors they read: unlink them
            disconnect(n)
    return why


#: Why an operand of the core is not unfolded.
_NOT_A_VIEW = ("{} is not a view of a rank-4 (batch, heads, positions, head dim) tensor: a Reshape merging its "
               "first two dims (or a Transpose of one, Megatron's layout), or a KV cache Concat of one")


def _rebuild(graph: Graph, softmax: Node, ctx: PassContext, dead: list[Node], b: _Builder, qk: Node,
             middle: list[Node], pv: Node) -> Optional[str]:
    q4, kt4, v4 = (_unfold(t, b) for t in (qk.inputs[0], qk.inputs[1], pv.inputs[1]))
    for t4, role in ((q4, "q"), (kt4, "k^T"), (v4, "v")):
        if t4 is None:
            return _NOT_A_VIEW.format(role)
    heads = {_heads(t, b) for t in (q4, kt4, v4)}
    if len(heads) != 1 or None in heads:
        return f"q, k and v unfold to different or unknown head counts ({', '.join(map(str, heads))})"
    h = heads.pop()
    scores = b.node("MatMul", [q4, kt4], like=qk.outputs[0])
    prev_old = qk.outputs[0]
    for n in middle:
        if n.op in ("Mul", "Div", "Add"):
            other = n.inputs[1] if n.inputs[0] is prev_old else n.inputs[0]
            if n.op in ("Mul", "Div") and const_scalar(other) is None:
                return f"the scores are scaled by '{other.name}', not a constant scalar"
            if n.op == "Div" and n.inputs[0] is not prev_old:
                return "the scores divide a value (they are the Div's divisor)"
            if n.op == "Add":
                mask = _mask4(other, h, b, (b.dims.of(prev_old) or [None])[0])
                if mask is None:
                    return (f"the mask '{other.name}' ({b.dims.of(other)}) is not proven to broadcast over "
                            "(batch, heads) as over batch*heads")
                other = mask
            inputs = [scores, other] if n.inputs[0] is prev_old else [other, scores]
            scores = b.node(n.op, inputs, like=n.outputs[0])
        elif n.op == "Softmax":
            axis = attr_value(n.attrs, "Softmax", "", ctx.opset, "axis")
            if axis not in (-1, 2):  # below opset 13 axis 2 of rank 3 is the last axis too (rows of [.., T])
                return f"the Softmax is over axis {axis}, not the keys'"
            scores = b.node("Softmax", [scores], {"axis": -1 if ctx.opset >= 13 else 3}, like=n.outputs[0])
        elif n.op == "IsNaN":
            isnan = b.node("IsNaN", [scores])
        elif n.op == "Where":
            if n.inputs[2] is not softmax.outputs[0] or const_scalar(n.inputs[1]) != 0:
                return "the Where after IsNaN is not torch's Where(IsNaN(p), 0, p)"
            scores = b.node("Where", [isnan, n.inputs[1], scores], like=n.outputs[0])
        prev_old = n.outputs[0]
    out4 = b.node("MatMul", [scores, v4], like=pv.outputs[0])
    dims = b.dims.of(pv.outputs[0])
    if dims is None or len(dims) != 3:
        return "the output's rank is not known to be 3"
    if isinstance(dims[1], int) and isinstance(dims[2], int):
        target = b.const([-1, dims[1], dims[2]])
    else:
        tail = b.node("Shape", [out4], {"start": 2}) if ctx.opset >= 15 else \
            b.node("Slice", [b.node("Shape", [out4]), b.const([2]), b.const([4])])
        target = b.node("Concat", [b.const([-1]), tail], {"axis": 0})
    out3 = b.node("Reshape", [out4, target], like=pv.outputs[0])
    old = pv.outputs[0]
    if is_graph_output(graph, old):
        return "probs @ v is a graph output (the Reshape back would have to take its name)"
    replace_uses(graph, old, out3)
    for n in [qk, *middle, pv]:
        detach(n, dead)
    graph.nodes.extend(b.nodes)
    ctx.count("attention_heads_unfolded")
    ctx.site(f"node '{softmax.name}' (Softmax)", "applied")
    return None


class UnfoldHeadBatch(Pass):
    """Rank-3 attention (heads folded into the batch) -> the rank-4 form the attention recogniser reads."""

    name = "unfold-head-batch"
    description = ("attention with heads folded into the batch (rank-3 [B*H, S, T] scores: Megatron, 3-D BMM) "
                   "rewritten over the rank-4 tensors it flattens, for fuse-attention and the cann lowering")
    order = 518
    needs_shapes = True
    _hints = Hints(adds_bodies=False)
    anchor_ops = frozenset({"Softmax"})

    def __init__(self) -> None:
        #: id(softmax) -> (the Softmax, why its rank-3 attention was not unfolded), the last round's word.
        self.declined: dict[int, tuple[Node, str]] = {}

    def run(self, graph: Graph, ctx: PassContext) -> int:
        done = 0
        dead: list[Node] = []
        for softmax in [n for n in graph.nodes if n.op == "Softmax" and (n.domain or "") in _DEFAULT]:
            x = softmax.inputs[0] if softmax.inputs else None
            if x is None or x.shape is None or len(x.shape) != 3 or not softmax.outputs:
                continue
            why = _rewrite(graph, softmax, ctx, dead)
            if why is None:
                done += 1
                self.declined.pop(id(softmax), None)
            else:
                self.declined[id(softmax)] = (softmax, why)
        remove(graph, dead)
        return done

    def finish(self, graph: Graph, ctx: PassContext) -> None:
        """Why each rank-3 attention site of the final graph stayed folded (fuse-attention then declines it for
        its rank), once per reason."""
        reasons: dict[str, list[str]] = {}
        for softmax, _, _, _ in attention_sites(graph):
            if id(softmax) in self.declined and self.declined[id(softmax)][0] is softmax:
                reasons.setdefault(self.declined[id(softmax)][1], []).append(site_name(softmax))
        for why, where in reasons.items():
            names = ", ".join(f"'{w}'" for w in sorted(where)[:3])
            ctx.note(f"{len(where)} rank-3 attention(s) not unfolded to rank 4: {why} (at {names})")
