"""Opset 23's ``Attention``, ``RMSNormalization`` and ``RotaryEmbedding`` written in the ops of any opset.

A model that holds them (k3opt's own ``--opset 23`` output, or an exporter that emits them) must reach an
output opset below 23 (``--target cann`` is 17), where they do not exist. Before the passes run, each is
written as the decomposed form the exporters emit and k3opt's recognisers read (fuse-rmsnorm, fuse-rotary,
fuse-attention and the cann lowerings): the run then lowers or re-fuses them exactly as it would the
export they came from. onnx's own function bodies are not used: they write the heads axis through
Reshapes of 3-D layouts the recognisers do not follow.

The decomposed forms lose what onnx's inference knew of their outputs: a broadcast of a symbolic dim with an
unknown one (a rotary cache's positions from a ``Range``, a mask built from the attention mask) is unknown,
and so is every dim after it, where the op's own inference gave the output the input's dims (the op's
definition fixes them). Those shapes are returned with the decomposition (:class:`Decomposed`) for the run
to keep giving onnx's inference (:class:`k3opt.pipeline.shapes.ShapeRefresher`): later layers keep their
batch and sequence symbols, which the recognisers compare (a rotary cache's positions against the rotated
tensor's).

What has no such form here is left as it is (the opset conversion then names it): ``RotaryEmbedding`` whose
input is not BNSD or (B, S, heads * D) with ``num_heads`` and a static head size; ``Attention`` with
``is_causal``, ``softcap``, or its fourth output (3-D q/k/v are split into heads by
``q_num_heads``/``kv_num_heads``).
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .opset_nodes import ModelScope, all_graphs

_DEFAULT = ("", "ai.onnx")
OPSET23_OPS = ("Attention", "RMSNormalization", "RotaryEmbedding")


class Decomposed(NamedTuple):
    """What :func:`decompose_opset23` did."""

    #: How many nodes were written decomposed.
    done: int
    #: A note for each node left (why).
    kept: list[str]
    #: The main graph's decomposed outputs and their types as the ops define them (onnx's inference of the op):
    #: numbers and the symbols the graph's inputs and outputs declare, other dims unknown.
    shapes: dict[str, onnx.TypeProto]


def decompose_opset23(model: onnx.ModelProto) -> Decomposed:
    """Rewrite, in place, the opset-23 nodes of ``model`` that have a decomposed form."""
    if not any(n.op_type in OPSET23_OPS and n.domain in _DEFAULT for g in all_graphs(model.graph) for n in g.node):
        return Decomposed(0, [], {})
    scope = ModelScope(model)
    done, kept, shapes = 0, [], {}
    declared = {d.dim_param for vi in [*model.graph.input, *model.graph.output]
                for d in vi.type.tensor_type.shape.dim if d.dim_param}
    for graph in all_graphs(model.graph):
        nodes: list[onnx.NodeProto] = []
        for node in graph.node:
            rule = _RULES.get(node.op_type) if node.domain in _DEFAULT else None
            if rule is None:
                nodes.append(node)
                continue
            form = _Form(graph, scope, node)
            why = rule(node, form)
            if why is None:
                nodes.extend(form.nodes)
                done += 1
                if graph is model.graph:
                    shapes.update(_defined_types(scope, node, declared))
            else:
                nodes.append(node)
                kept.append(f"{node.op_type} '{node.name}' kept: {why}")
        del graph.node[:]
        graph.node.extend(nodes)
    return Decomposed(done, kept, shapes)


def _defined_types(scope: ModelScope, node: onnx.NodeProto, declared: set[str]) -> dict[str, onnx.TypeProto]:
    """The types of (opset-23) ``node``'s outputs as onnx's inference of the op gives them (the model as it was
    read: ``scope`` infers it once), dims other than numbers and ``declared`` symbols unknown; outputs of
    unknown rank are left out (nothing to keep)."""
    scope.infer_types()
    out = {}
    for name in node.output:
        t = scope.types.get(name) if name else None
        if t is None or not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
            continue
        kept = onnx.TypeProto()
        kept.CopyFrom(t)
        for d in kept.tensor_type.shape.dim:
            if d.HasField("dim_param") and d.dim_param not in declared:
                d.Clear()
        out[name] = kept
    return out


class _Form:
    """The nodes written for one opset-23 node, with fresh names and constants."""

    def __init__(self, graph: onnx.GraphProto, scope: ModelScope, node: onnx.NodeProto):
        self.graph, self.scope = graph, scope
        self.tag = node.name or node.op_type
        self.nodes: list[onnx.NodeProto] = []

    def add(self, op: str, inputs: list[str], out: Optional[str] = None, **attrs) -> str:
        out = out or self.scope.fresh(f"{self.tag}/{op}")
        self.nodes.append(helper.make_node(op, inputs, [out], name=self.scope.fresh(f"{self.tag}/{op}_node"), **attrs))
        return out

    def const(self, value: np.ndarray, what: str) -> str:
        name = self.scope.fresh(f"{self.tag}/{what}")
        self.graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def dtype(self, name: str) -> Optional[int]:
        t = self.scope.types.get(name)
        if t is None:
            self.scope.infer_types()
            t = self.scope.types.get(name)
        return t.tensor_type.elem_type if t is not None and t.HasField("tensor_type") else None

    def shape(self, name: str) -> Optional[list]:
        if self.scope.rank(name) is None:
            self.scope.infer_types()
        if self.scope.rank(name) is None:
            return None
        return [d.dim_value if d.HasField("dim_value") else None for d in self.scope.types[name].tensor_type.shape.dim]


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _np_type(onnx_type: int):
    return helper.tensor_dtype_to_np_dtype(onnx_type)


def _rmsnorm(node: onnx.NodeProto, f: _Form) -> Optional[str]:
    """``x * 1/sqrt(mean(x^2) + eps) * scale``, statistics in the stash type (Llama's form)."""
    a = _attrs(node)
    axis, eps, stash = int(a.get("axis", -1)), float(a.get("epsilon", 1e-5)), int(a.get("stash_type", 1))
    x, scale = node.input[0], node.input[1]
    xtype = f.dtype(x)
    if xtype is None:
        return "the input's type is unknown"
    if axis < 0:
        axes = list(range(axis, 0))
    else:
        shape = f.shape(x)
        if shape is None:
            return "the input's rank is unknown"
        axes = list(range(axis, len(shape)))
    compute = TensorProto.FLOAT if stash == 1 else xtype
    src = x if compute == xtype else f.add("Cast", [x], to=compute)
    sq = f.add("Pow", [src, f.const(np.array(2.0, _np_type(compute)), "two")])
    mean = f.add("ReduceMean", [sq, f.const(np.array(axes, np.int64), "axes")], keepdims=1)
    var = f.add("Add", [mean, f.const(np.array(eps, _np_type(compute)), "eps")])
    rstd = f.add("Reciprocal", [f.add("Sqrt", [var])])
    normed = f.add("Mul", [src, rstd])
    if compute != xtype:
        normed = f.add("Cast", [normed], to=xtype)
    f.add("Mul", [normed, scale], out=node.output[0])
    return None


def _rotary(node: onnx.NodeProto, f: _Form) -> Optional[str]:
    """RotaryEmbedding-23's definition in the layout of the transformers export, over BNSD ``x`` (a 3-D
    (B, S, heads * D) input split into heads by ``num_heads`` and merged back) with half-width caches broadcast
    over the heads: ``Concat(x1*cos - x2*sin, x2*cos + x1*sin)`` of the halves, or GPT-J's ``x * cos2 +
    rotate_every_two(x) * sin2`` with ``repeat_interleave(2)`` caches when ``interleaved``; a rotation over
    part of the head (``rotary_embedding_dim``) is concatenated with the rest."""
    a = _attrs(node)
    x, cos, sin = node.input[0], node.input[1], node.input[2]
    shape = f.shape(x)
    if shape is None or len(shape) not in (3, 4) or shape[-1] is None:
        return "the input is neither 4-D (BNSD) nor 3-D with a static last dim"
    heads = int(a.get("num_heads", 0))
    if len(shape) == 3 and (not heads or shape[2] % heads):
        return "a 3-D input whose width num_heads does not divide"
    head = shape[3] if len(shape) == 4 else shape[2] // heads
    rot = int(a.get("rotary_embedding_dim", 0)) or head
    if rot > head or rot % 2:
        return f"rotary_embedding_dim {rot} is not an even number up to the head size {head}"
    if len(node.input) > 3 and node.input[3]:  # caches indexed by position: (max_pos, D/2) -> (B, S, D/2)
        cos, sin = f.add("Gather", [cos, node.input[3]], axis=0), f.add("Gather", [sin, node.input[3]], axis=0)
    else:  # (B, S, D/2) by the op's definition: an Expand to that broadcasts the same in x1 * cos
        cos, sin = _through_expand(f, cos, rank=3), _through_expand(f, sin, rank=3)
    axis1 = f.const(np.array([1], np.int64), "heads_axis")
    cos, sin = f.add("Unsqueeze", [cos, axis1]), f.add("Unsqueeze", [sin, axis1])
    bnsd = x if len(shape) == 4 else f.add(
        "Transpose", [f.add("Reshape", [x, f.const(np.array([0, 0, heads, head], np.int64), "heads")])],
        perm=[0, 2, 1, 3])
    whole, rest = bnsd, None
    if rot < head:
        whole, rest = _last_slice(f, bnsd, 0, rot), _last_slice(f, bnsd, rot, head)
    out = node.output[0] if rest is None and len(shape) == 4 else None
    rotate = _rotate_pairs if a.get("interleaved", 0) else _rotate_halves
    y = rotate(f, whole, cos, sin, rot, out)
    if rest is not None:
        y = f.add("Concat", [y, rest], out=node.output[0] if len(shape) == 4 else None, axis=-1)
    if len(shape) == 3:
        merged = f.add("Transpose", [y], perm=[0, 2, 1, 3])
        f.add("Reshape", [merged, f.const(np.array([0, 0, -1], np.int64), "merged_heads")], out=node.output[0])
    return None


def _last_slice(f: _Form, x: str, start: int, end: int, step: int = 1) -> str:
    """``x[..., start:end:step]``."""
    ints = [f.const(np.array([v], np.int64), what) for v, what in
            ((start, "start"), (end, "end"), (-1, "last_axis"), (step, "step"))]
    return f.add("Slice", [x, *ints])


def _rotate_halves(f: _Form, x: str, cos: str, sin: str, d: int, out: Optional[str]) -> str:
    """``Concat(x1*cos - x2*sin, x2*cos + x1*sin)`` of the halves of ``x``'s last ``d`` (the explicit halves
    form of the recognisers)."""
    x1, x2 = _last_slice(f, x, 0, d // 2), _last_slice(f, x, d // 2, d)
    real = f.add("Sub", [f.add("Mul", [x1, cos]), f.add("Mul", [x2, sin])])
    imag = f.add("Add", [f.add("Mul", [x2, cos]), f.add("Mul", [x1, sin])])
    return f.add("Concat", [real, imag], out=out, axis=-1)


def _rotate_pairs(f: _Form, x: str, cos: str, sin: str, d: int, out: Optional[str]) -> str:
    """GPT-J's ``x * cos2 + stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2) * sin2`` with ``cos2``, ``sin2``
    the caches repeated pairwise (``repeat_interleave(2)``): the pairs ``(2i, 2i+1)`` rotated in place."""
    last, flat = f.const(np.array([-1], np.int64), "pair_axis"), f.const(np.array([0, 0, 0, d], np.int64), "flat")
    even, odd = _last_slice(f, x, 0, d, 2), _last_slice(f, x, 1, d, 2)
    stacked = f.add("Concat", [f.add("Unsqueeze", [f.add("Neg", [odd]), last]), f.add("Unsqueeze", [even, last])],
                    axis=-1)
    rotated = f.add("Reshape", [stacked, flat])
    twice = f.const(np.array([1, 1, 1, 1, 2], np.int64), "pairs")
    cos2, sin2 = (f.add("Reshape", [f.add("Tile", [f.add("Unsqueeze", [t, last]), twice]), flat]) for t in (cos, sin))
    return f.add("Add", [f.add("Mul", [x, cos2]), f.add("Mul", [rotated, sin2])], out=out)


def _attention(node: onnx.NodeProto, f: _Form) -> Optional[str]:
    """``softmax(q k^T * scale + mask) v`` over BNSD q/k/v, past concatenated on the sequence axis and GQA's
    keys repeated per head group (transformers' repeat_kv)."""
    a = _attrs(node)
    if a.get("is_causal", 0):
        return "is_causal has no decomposed form here"
    if a.get("softcap", 0.0):
        return "softcap has no decomposed form here"
    if len(node.output) > 3 and node.output[3]:
        return "its qk_matmul_output has no decomposed form here"
    ins = list(node.input) + [""] * (6 - len(node.input))
    q, k, v, mask, past_k, past_v = ins[:6]
    qs, ks, vs = f.shape(q), f.shape(k), f.shape(v)
    dtype = f.dtype(q)
    three_d = qs is not None and ks is not None and vs is not None and len(qs) == len(ks) == len(vs) == 3
    if three_d:  # (B, S, heads * D) with the head counts as attributes: split into BNSD
        nq, nkv = int(a.get("q_num_heads", 0)), int(a.get("kv_num_heads", 0))
        if not nq or not nkv or qs[2] is None or ks[2] is None or qs[2] % nq or ks[2] % nkv:
            return "3-D q/k/v without static widths divisible by q_num_heads/kv_num_heads"
        q, k, v = (_heads_split(f, t, n) for t, n in ((q, nq), (k, nkv), (v, nkv)))
        qs, ks = [qs[0], nq, qs[1], qs[2] // nq], [ks[0], nkv, ks[1], ks[2] // nkv]
    if qs is None or ks is None or len(qs) != 4 or len(ks) != 4 or qs[3] is None:
        return "q and k are neither 4-D (BNSD) with a static head size nor 3-D with the head counts"
    if dtype is None:
        return "the query's type is unknown"
    heads, kv_heads, head = qs[1], ks[1], qs[3]
    if heads is not None and kv_heads is not None and heads % kv_heads:
        return f"{heads} query heads do not group over {kv_heads} key/value heads"
    if bool(past_k) != bool(past_v):
        return "past_key and past_value come one without the other"
    outs = list(node.output) + [""] * (3 - len(node.output))
    if past_k:
        k = f.add("Concat", [past_k, k], out=outs[1] or None, axis=2)
        v = f.add("Concat", [past_v, v], out=outs[2] or None, axis=2)
    else:
        for name, src in ((outs[1], k), (outs[2], v)):
            if name:
                f.add("Identity", [src], out=name)
    if heads is None or kv_heads is None:
        # The op ignores q_num_heads/kv_num_heads on 4-D inputs: equal ones only choose the form without a
        # repeat, which MatMul's broadcast makes the op's for any valid model (equal heads, or one kv head);
        # otherwise the group size is read from the run's shapes (the passes fold what they know).
        if not a.get("q_num_heads") or a.get("q_num_heads") != a.get("kv_num_heads"):
            k, v = (_repeat_kv(f, t, q) for t in (k, v))
    elif heads != kv_heads:
        k, v = (_repeat_kv(f, t, q, kv_heads, heads // kv_heads) for t in (k, v))
    scale = float(a.get("scale", 0.0)) or 1.0 / float(np.sqrt(head))
    kt = f.add("Transpose", [k], perm=[0, 1, 3, 2])
    scores = f.add("Mul", [f.add("MatMul", [q, kt]), f.const(np.array(scale, _np_type(dtype)), "scale")])
    if mask:
        mask = _through_expand(f, mask)
        if f.dtype(mask) == TensorProto.BOOL:
            fill = f.const(np.array(-np.inf, _np_type(dtype)), "masked")
            mask = f.add("Where", [mask, f.const(np.array(0, _np_type(dtype)), "kept"), fill])
        scores = f.add("Add", [scores, mask])
    probs = f.add("Softmax", [scores], axis=-1)
    if mask:  # a query row with every key masked (-inf) gives 0, as Attention-23 defines (torch sdpa's guard)
        zero = f.const(np.array(0, _np_type(dtype)), "zero_probs")
        probs = f.add("Where", [f.add("IsNaN", [probs]), zero, probs])
    if not three_d:
        f.add("MatMul", [probs, v], out=outs[0])
        return None
    y = f.add("Transpose", [f.add("MatMul", [probs, v])], perm=[0, 2, 1, 3])  # BNSD -> (B, S, heads * Dv)
    f.add("Reshape", [y, f.const(np.array([0, 0, -1], np.int64), "merged_heads")], out=outs[0])
    return None


def _heads_split(f: _Form, t: str, heads: int) -> str:
    """(B, S, heads * D) -> (B, heads, S, D), as Attention-23 reads a 3-D input."""
    split = f.add("Reshape", [t, f.const(np.array([0, 0, heads, -1], np.int64), "heads")])
    return f.add("Transpose", [split], perm=[0, 2, 1, 3])


def _through_expand(f: _Form, t: str, rank: Optional[int] = None) -> str:
    """The input of an Expand that makes ``t`` (an attention mask, a rotary cache): broadcast into what it is
    added to or multiplied with, it gives the same (the ops' definitions fix the expanded shape to that one),
    and the recognisers read the tensor's own form. ``rank``: only when the input has that rank (known)."""
    for node in f.graph.node:
        if t in node.output:
            if node.op_type != "Expand" or node.domain not in _DEFAULT:
                return t
            src = node.input[0]
            shape = f.shape(src) if rank is not None else None
            return src if rank is None or (shape is not None and len(shape) == rank) else t
    return t


def _repeat_kv(f: _Form, t: str, q: str, kv_heads: Optional[int] = None, rep: Optional[int] = None) -> str:
    """``Reshape(Expand(Unsqueeze(t, 2), [B, Nkv, rep, S, D]), [B, Nkv*rep, S, D])`` (transformers' repeat_kv);
    without the static head counts, ``Nkv`` is t's and ``rep`` q's heads over it, read from the shapes
    (Attention-23 requires the query heads to be a multiple of the key/value heads)."""
    shape = f.add("Shape", [t])
    b = f.add("Slice", [shape, f.const(np.array([0], np.int64), "b0"), f.const(np.array([1], np.int64), "b1")])
    s_d = f.add("Slice", [shape, f.const(np.array([2], np.int64), "s0"), f.const(np.array([4], np.int64), "s1")])
    if kv_heads is None or rep is None:
        groups = f.add("Slice", [shape, f.const(np.array([1], np.int64), "h0"), f.const(np.array([2], np.int64), "h1")])
        heads = f.add("Shape", [q], start=1, end=2)
        groups = f.add("Concat", [groups, f.add("Div", [heads, groups])], axis=0)
    else:
        groups = f.const(np.array([kv_heads, rep], np.int64), "groups")
        heads = f.const(np.array([kv_heads * rep], np.int64), "heads")
    expand_to = f.add("Concat", [b, groups, s_d], axis=0)
    reshape_to = f.add("Concat", [b, heads, s_d], axis=0)
    expanded = f.add("Expand", [f.add("Unsqueeze", [t, f.const(np.array([2], np.int64), "group_axis")]), expand_to])
    return f.add("Reshape", [expanded, reshape_to])


_RULES: dict[str, Callable[[onnx.NodeProto, _Form], Optional[str]]] = {
    "RMSNormalization": _rmsnorm, "RotaryEmbedding": _rotary, "Attention": _attention,
}
