"""The MoE-block recogniser shared by the MoE lowerings: transformers' exportable experts (``batched_mm``).

transformers (5.x) computes a routed-experts block, for tokens ``x`` (T, H) and the router's top-k expert
indices ``idx`` and weights ``w`` (T, k), as one row per (token, slot), ``r = t * k + j``::

    rows = Flatten|Reshape(Tile|Expand(Unsqueeze(x, 1), [1, k, 1]))       # rows[r] = x[t]
    e    = Reshape(idx, [-1])                                             # e[r] = idx[t, j]
    y    = FFN(rows, Gather(W, e), ...)                                   # row r by expert e[r] alone
    out  = ReduceSum(Reshape(y * Unsqueeze(Reshape(w, [-1]), -1), [-1, k, H]), axes=[1])

(TorchScript and dynamo alike; dynamo gathers with ``GatherND(W, Unsqueeze(e, -1))``.) The block is proved
exact for a row permutation -- what Ascend's MoeInitRouting / MoeFinalizeRouting do -- when every node from
``rows`` and ``e`` to ``y`` works row by row (:func:`_row_region`): ``y``'s row r then depends on ``rows[r]``
and ``e[r]`` only, so the expert FFN computes the same rows in any order. The gate is classified from what
feeds ``w``: ``softmax`` (``TopK(Softmax(logits))``: Mixtral renormalised, Qwen2/3-MoE with or without),
``sigmoid-group`` (DeepSeek-V3/Kimi: the weights gathered from sigmoid scores at indices chosen on
group-masked, bias-corrected scores, renormalised, scaled), or ``other``.

A block the recogniser cannot prove is reported with the reason (:class:`MoeScan`'s ``declined``).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from ...graph.ir import Graph, Node, Tensor, const_shape, const_value, int_list, is_const, is_graph_output, producer

#: Ops computing each output element from the same element of each input (broadcast aside).
_ELEMENTWISE = frozenset({
    "Abs", "Add", "Cast", "Cos", "Div", "Elu", "Erf", "Exp", "Gelu", "HardSigmoid", "HardSwish", "Identity",
    "LeakyRelu", "Log", "Max", "Min", "Mish", "Mul", "Neg", "Pow", "Reciprocal", "Relu", "Selu", "Sigmoid",
    "Sin", "Softplus", "Sqrt", "Sub", "Tanh", "Where",
})
#: Producers the weights path looks through to find the TopK (Cast, scaling by a constant, renormalising).
_WEIGHT_PATH = frozenset({"Cast", "Mul", "Div", "Identity"})


@dataclasses.dataclass
class MoeBlock:
    """One recognised routed-experts block (module doc): tensors by their role."""

    where: str
    combine: Node          # the ReduceSum over the k slots
    topk: Node
    k: int
    experts: int
    hidden: int
    gate: str              # "softmax", "sigmoid-group" or "other"
    renormalised: bool
    softmax: Optional[Node]
    x: Tensor              # (T, H) tokens
    rows: Tensor           # (T*k, H) token rows, r = t*k + j
    flat_idx: Tensor       # (T*k,) expert index per row
    weights: Tensor        # (T, k) combine weights
    expert_rows: Tensor    # (T*k, H) expert outputs, before weighting
    region: list[Node]     # the nodes from rows/flat_idx to expert_rows
    gate_note: str = ""


@dataclasses.dataclass
class MoeScan:
    """What :func:`find_moe_blocks` found: blocks proved exact, and the reason for each one declined."""

    blocks: list[MoeBlock]
    declined: dict[str, str]


class _Decline(Exception):
    pass


def find_moe_blocks(graph: Graph) -> MoeScan:
    """Every ``batched_mm`` MoE block of ``graph`` (its main graph), anchored at the combine's ReduceSum."""
    blocks, declined = [], {}
    for node in list(graph.nodes):
        if node.op != "ReduceSum" or not node.outputs or not node.outputs[0].outputs or not _is_slot_sum(node):
            continue
        try:
            blocks.append(_block(node, graph))
        except _Decline as why:
            declined[node.name] = str(why)
    return MoeScan(blocks, declined)


def find_unrolled_blocks(graph: Graph) -> dict[str, str]:
    """The statically unrolled all-experts form, by its dense routing matrix: ``ScatterElements(zeros (T, E),
    TopK indices, weights, axis=-1)`` read one expert column at a time (``Slice``/``Gather`` on axis 1), every
    expert computed on every token and masked by its column. Returns where -> why it stays decomposed."""
    found = {}
    for node in list(graph.nodes):
        if node.op != "ScatterElements" or len(node.inputs) != 3 or int(node.attrs.get("axis", 0)) not in (-1, 1):
            continue
        idx = producer(node.inputs[1])
        dense = node.outputs[0]
        if idx is None or idx.op != "TopK" or node.inputs[1] is not idx.outputs[1] or dense.shape is None or \
                len(dense.shape) != 2 or not _zeros(node.inputs[0]):
            continue
        columns = [c for c in dense.outputs if c.op in ("Slice", "Gather")]
        experts = _static(dense, 1)
        if experts and len(columns) == experts:
            found[node.name] = (f"all {experts} experts computed on every token and masked by a dense routing matrix "
                                "(the unrolled form): Ascend's routing ops need the experts batched (stacked weights), "
                                "which k3opt does not build from per-expert subgraphs")
    return found


def _zeros(t: Tensor) -> bool:
    """A tensor of zeros: a constant, ``ConstantOfShape`` with a zero (or no) value, or ``Expand`` of a zero."""
    value = const_value(t)
    if value is not None:
        return not np.any(value)
    n = producer(t)
    if n is None:
        return False
    if n.op == "ConstantOfShape":
        v = n.attrs.get("value")
        return v is None or not np.any(np.asarray(getattr(v, "values", v)))
    if n.op in ("Expand", "Cast"):
        return _zeros(n.inputs[0])
    return False


def _is_slot_sum(node: Node) -> bool:
    """``ReduceSum(Reshape(Mul(a, b), [*, k, H]), axes=[1], keepdims=0)``: the shape of a top-k combine."""
    axes = int_list(node.inputs[1]) if len(node.inputs) > 1 else node.attrs.get("axes")
    if axes not in ([1], [-2]) or node.attrs.get("keepdims", 1) != 0:
        return False
    r = producer(node.inputs[0])
    if r is None or r.op != "Reshape" or node.inputs[0].shape is None or len(node.inputs[0].shape) != 3:
        return False
    m = producer(r.inputs[0])
    return m is not None and m.op == "Mul"


def _static(t: Tensor, axis: int) -> Optional[int]:
    shape = t.shape
    if shape is None or axis >= len(shape) or axis < -len(shape):
        return None
    d = shape[axis]
    return int(d) if isinstance(d, (int, np.integer)) and d >= 0 else None


def _block(combine: Node, graph: Graph) -> MoeBlock:
    reshaped = combine.inputs[0]
    k, hidden = _static(reshaped, 1), _static(reshaped, 2)
    if k is None or hidden is None:
        raise _Decline("the top-k and hidden sizes of the combine are not static")
    mul = producer(producer(reshaped).inputs[0])
    weights = expert_rows = None
    for a, b in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
        w = _flat_weights(a)
        if w is not None:
            weights, expert_rows = w, b
            break
    if weights is None:
        raise _Decline("the combine does not weight the expert rows by the flattened (tokens, k) weights")
    if len(expert_rows.outputs) != 1 or is_graph_output(graph, expert_rows):
        raise _Decline("the expert rows are read outside the combine")
    if expert_rows.shape is None or len(expert_rows.shape) != 2 or _static(expert_rows, 1) != hidden:
        raise _Decline("the weighted expert rows are not (rows, hidden)")
    topk, gate, renorm, softmax, note = _gate(weights)
    if int_list(topk.inputs[1]) != [k]:
        raise _Decline(f"the combine sums {k} slots, the router's TopK keeps {int_list(topk.inputs[1])}")
    experts = _static(topk.inputs[0], -1)
    if experts is None:
        raise _Decline("the number of experts (the router's last dim) is not static")
    rows, flat_idx, region = _row_region(graph, expert_rows, topk, k)
    x = _tokens(rows, k, hidden)
    return MoeBlock(combine.name, combine, topk, k, experts, hidden, gate, renorm, softmax, x, rows, flat_idx,
                    weights, expert_rows, region, note)


def _flat_weights(t: Tensor) -> Optional[Tensor]:
    """``w`` (T, k) when ``t`` is ``Unsqueeze(Reshape(w, [-1]), [-1])`` (one weight per row, as a column)."""
    u = producer(t)
    if u is None or u.op != "Unsqueeze" or len(u.inputs) < 2 or int_list(u.inputs[1]) not in ([-1], [1]):
        return None
    r = producer(u.inputs[0])
    if r is None or r.op != "Reshape" or int_list(r.inputs[1]) != [-1]:
        return None
    w = r.inputs[0]
    return w if w.shape is not None and len(w.shape) == 2 else None


def _gate(weights: Tensor) -> tuple[Node, str, bool, Optional[Node], str]:
    """(TopK, gate kind, renormalised, the Softmax of a softmax gate, a note) from the weights' producers."""
    t, renorm, depth = weights, False, 0
    while depth < 8:
        depth += 1
        n = producer(t)
        if n is None:
            break
        if n.op == "TopK" and t is n.outputs[0]:
            return _topk_gate(n, renorm)
        if n.op == "GatherElements" and producer(n.inputs[1]) is not None and producer(n.inputs[1]).op == "TopK":
            topk = producer(n.inputs[1])
            _check_topk(topk)
            scores = producer(n.inputs[0])
            if scores is not None and scores.op == "Sigmoid" and topk.inputs[0] is not n.inputs[0]:
                return (topk, "sigmoid-group", renorm, None,
                        "sigmoid scores, experts chosen on other (group-limited, bias-corrected) scores")
            return topk, "other", renorm, None, "weights gathered from scores at the chosen experts"
        if n.op == "Div" and _sums_itself(n):
            renorm = True
        elif n.op not in _WEIGHT_PATH or (n.op in ("Mul", "Div") and not is_const(n.inputs[1]) and
                                          not (n.op == "Div" and _sums_itself(n))):
            break
        t = n.inputs[0]
    raise _Decline("the combine weights do not come from the router's TopK")


def _sums_itself(div: Node) -> bool:
    """``Div(a, ReduceSum(a, [-1], keepdims=1) [+ eps])``: renormalising over the k slots."""
    s = producer(div.inputs[1])
    if s is not None and s.op == "Add" and is_const(s.inputs[1]):
        s = producer(s.inputs[0])
    if s is None or s.op != "ReduceSum" or s.attrs.get("keepdims", 1) != 1:
        return False
    axes = int_list(s.inputs[1]) if len(s.inputs) > 1 else s.attrs.get("axes")
    return s.inputs[0] is div.inputs[0] and axes in ([-1], [1])


def _check_topk(topk: Node) -> None:
    if int(topk.attrs.get("largest", 1)) != 1:
        raise _Decline("the router's TopK takes the smallest scores")
    data = topk.inputs[0]
    if data.shape is None or len(data.shape) != 2 or int(topk.attrs.get("axis", -1)) not in (-1, 1):
        raise _Decline("the router's TopK is not over the experts of (tokens, experts) scores")


def _topk_gate(topk: Node, renorm: bool) -> tuple[Node, str, bool, Optional[Node], str]:
    _check_topk(topk)
    sm = producer(topk.inputs[0])
    if sm is not None and sm.op == "Softmax" and int(sm.attrs.get("axis", -1)) in (-1, 1):
        return topk, "softmax", renorm, sm, ""
    return topk, "other", renorm, None, f"top-k of {sm.op if sm else 'an input'}, not of a softmax"


def _row_region(graph: Graph, expert_rows: Tensor, topk: Node, k: int) -> tuple[Tensor, Tensor, list[Node]]:
    """(rows, flat_idx, region): walking up from the expert rows, every node must work row by row, and the
    walk must end at constants, shape-only values, the token rows and the flattened TopK indices."""
    leaves: dict[str, Tensor] = {}  # "flattened index" and "token-row" tensor, each found once
    region: list[Node] = []
    row_tensors: set[int] = set()
    todo, seen = [expert_rows], set()
    while todo:
        t = todo.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        kind = "flattened index" if _is_flat_idx(t, topk) else "token-row" if _is_token_rows(t, k) else None
        if kind is not None:
            if leaves.setdefault(kind, t) is not t:
                raise _Decline(f"the experts read two different {kind} tensors")
            row_tensors.add(id(t))
            continue
        if _shape_only(t):  # constants and values computed from shapes: a row permutation keeps them
            continue
        n = producer(t)
        if n is None:
            raise _Decline(f"the experts read '{t.name}', neither the routed rows nor a constant")
        region.append(n)
        row_tensors.update(id(o) for o in n.outputs)
        todo.extend(i for i in n.inputs if i is not None and i.name != "")
    if len(leaves) != 2:
        raise _Decline("the experts do not read both the token rows and the flattened TopK indices")
    rows, flat_idx = leaves["token-row"], leaves["flattened index"]
    for n in region:
        why = _not_row_wise(n, row_tensors)
        if why:
            raise _Decline(f"{n.op} '{n.name}' in the experts does not work row by row: {why}")
    inside = {id(n) for n in region}
    for n in region:
        for o in n.outputs:
            if o is not expert_rows and (is_graph_output(graph, o) or
                                         any(id(c) not in inside and c.op not in ("Shape", "Size") for c in o.outputs)):
                raise _Decline(f"'{o.name}' in the experts is read outside them")
    return rows, flat_idx, region


def _shape_only(t: Tensor, depth: int = 8) -> bool:
    """Whether ``t`` is a constant or is computed from constants and shapes only."""
    if is_const(t):
        return True
    n = producer(t)
    if n is None or depth == 0:
        return False
    if n.op in ("Shape", "Size"):
        return True
    return all(i is None or i.name == "" or _shape_only(i, depth - 1) for i in n.inputs)


def _is_flat_idx(t: Tensor, topk: Node) -> bool:
    n = producer(t)
    return n is not None and n.op == "Reshape" and n.inputs[0] is topk.outputs[1] and int_list(n.inputs[1]) == [-1]


def _is_token_rows(t: Tensor, k: int) -> bool:
    """``t`` is ``(T*k, H)``: each token row repeated k times in a row (``rows[t*k + j] = x[t]``)."""
    n = producer(t)
    if n is None or t.shape is None or len(t.shape) != 2:
        return False
    if n.op == "Flatten" and int(n.attrs.get("axis", 1)) == 2:
        tiled = n.inputs[0]
    elif n.op == "Reshape" and (int_list(n.inputs[1]) or [None])[0] == -1 and len(int_list(n.inputs[1])) == 2:
        tiled = n.inputs[0]
        if _static(tiled, -1) is None or int_list(n.inputs[1])[1] != _static(tiled, -1):
            return False
    else:
        return False
    rep = producer(tiled)
    if rep is None or rep.op not in ("Tile", "Expand") or int_list(rep.inputs[1]) != [1, k, 1]:
        return False
    u = producer(rep.inputs[0])
    return (u is not None and u.op == "Unsqueeze" and len(u.inputs) > 1 and int_list(u.inputs[1]) == [1] and
            u.inputs[0].shape is not None and len(u.inputs[0].shape) == 2)


def _tokens(rows: Tensor, k: int, hidden: int) -> Tensor:
    rep = producer(producer(rows).inputs[0])
    x = producer(rep.inputs[0]).inputs[0]
    if _static(x, 1) != hidden:
        raise _Decline(f"the token rows have {_static(x, 1)} columns, the combine {hidden}")
    return x


def _axes_avoid_rows(axes: Optional[list[int]], rank: Optional[int]) -> bool:
    return axes is not None and rank is not None and all(a % rank != 0 for a in axes)


def _not_row_wise(n: Node, rows: set[int]) -> Optional[str]:
    """Why ``n`` (in the experts' region) is not row-wise, or None: each output row r reads input row r only."""
    row_in = [i for i in n.inputs if i is not None and id(i) in rows]
    rank = len(n.inputs[0].shape) if n.inputs and n.inputs[0].shape is not None else None
    if n.op == "Gather":
        return None if (is_const(n.inputs[0]) and id(n.inputs[1]) in rows and int(n.attrs.get("axis", 0)) == 0
                        and id(n.inputs[0]) not in rows) else "not a constant table gathered on axis 0 by row"
    if n.op == "GatherND":
        ok = is_const(n.inputs[0]) and int(n.attrs.get("batch_dims", 0)) == 0 and _static(n.inputs[1], -1) == 1
        return None if ok else "not a constant table gathered by one index per row"
    if n.op in ("Unsqueeze", "Squeeze"):
        out_rank = len(n.outputs[0].shape) if n.outputs[0].shape is not None else None
        r = out_rank if n.op == "Unsqueeze" else rank
        return None if len(n.inputs) > 1 and _axes_avoid_rows(int_list(n.inputs[1]), r) else "its axes include 0"
    if n.op == "Slice":
        axes = int_list(n.inputs[3]) if len(n.inputs) > 3 else None
        return None if _axes_avoid_rows(axes, rank) and not any(id(i) in rows for i in n.inputs[1:]) \
            else "it may slice the rows"
    if n.op == "Split":
        return None if rank and int(n.attrs.get("axis", 0)) % rank != 0 else "it splits the rows"
    if n.op == "MatMul":
        a, b = n.inputs
        ranks = [len(t.shape) if t.shape is not None else None for t in (a, b)]
        if all(id(t) in rows and r is not None and r >= 3 for t, r in zip((a, b), ranks)):
            return None
        if id(a) in rows and ranks[0] is not None and ranks[0] >= 2 and is_const(b) and ranks[1] == 2:
            return None
        return "not a product batched over the rows"
    if n.op == "Expand":  # Expand(a, Shape(a or an element-wise function of a)): the identity
        s = producer(n.inputs[1])
        src = s.inputs[0] if s is not None and s.op == "Shape" and not s.attrs.get("start") and \
            s.attrs.get("end") is None else None
        m = producer(src) if src is not None else None
        same = src is n.inputs[0] or (m is not None and m.op in ("Max", "Min", "Identity") and len(m.inputs) == 1
                                      and m.inputs[0] is n.inputs[0])
        return None if same else "an Expand that may broadcast the rows"
    if n.op in _ELEMENTWISE:
        out_rank = len(n.outputs[0].shape) if n.outputs[0].shape is not None else None
        for i in n.inputs:
            if i is None or id(i) in rows:
                if i is not None and (i.shape is None or len(i.shape) != out_rank):
                    return "a row operand of another rank"
                continue
            shape = const_shape(i) if is_const(i) else None
            if shape is None:
                return "an operand that is neither a row tensor nor a constant"
            if out_rank is not None and len(shape) == out_rank and shape[0] != 1:
                return "a constant operand with rows of its own"
        return None if row_in else "no row operand"
    return "not an op the recogniser proves row-wise"
