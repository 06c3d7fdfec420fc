"""Folding ``y = op(x, W, b) * scale + shift`` (per output channel, constants) into W and b.

Shared by fold-batchnorm (BatchNormalization, per-channel Mul) and merge-conv-bias (per-channel Add).
The producer ``op`` is a Conv, a ConvTranspose, a Gemm or a 2-D MatMul with constant weights; its
output has exactly one reader (the node folded away) and is not a graph output, so changing its
value in place is invisible elsewhere. The new weights are computed in float64 and cast to the
weights' dtype; the fold is refused when that cast overflows or puts a nonzero value below the
dtype's smallest normal number, or when the weights are not float16/float32/float64.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from ...graph.ir import Graph, Node, Tensor, as_constant, const_tensor, const_value, is_graph_output, producer, rank, set_input
from ...pipeline.pass_base import PassContext
from .._rewire import bypass, can_replace, is_used

#: Weight dtypes the fold computes for (bfloat16 keeps 8 significant bits: a folded weight could lose
#: more than the decomposed form's rounding of one product).
FOLD_DTYPES = (np.float16, np.float32, np.float64)
#: Producers whose output channel the fold can scale; a MatMul's channel is its last axis.
CONVOLUTIONS = frozenset({"Conv", "ConvTranspose"})
PRODUCERS = CONVOLUTIONS | {"Gemm", "MatMul"}
#: ``refuse(node, why) -> False``: records why a node was left (:class:`RefusalNotes`).
Refuse = Callable[[Node, str], bool]
#: Constants bigger than this are not read (a per-channel vector is small).
MAX_CHANNEL_ELEMENTS = 1 << 20


def channel_producer(graph: Graph, t: Tensor, ctx: PassContext) -> Optional[Node]:
    """The Conv/ConvTranspose/Gemm/MatMul (default domain) of ``graph`` computing ``t``, when ``t`` has no
    other reader."""
    p = producer(t)
    if p is None or p.op not in PRODUCERS or (p.domain or "") not in ("", "ai.onnx"):
        return None
    if len(t.outputs) != 1 or is_graph_output(graph, t) or p.outputs[0] is not t or not ctx.owns(graph, p):
        return None
    return p


def out_channels(p: Node) -> Optional[int]:
    """How many output channels ``p`` computes (None when its weight is not a constant of known shape)."""
    w = const_tensor(p.inputs[1]) if len(p.inputs) > 1 else None
    if w is None or len(w.shape) < 2:
        return None
    if p.op == "ConvTranspose":
        return int(w.shape[1]) * int(p.attrs.get("group", 1))
    if p.op == "Gemm":
        return int(w.shape[0] if p.attrs.get("transB", 0) else w.shape[1])
    return int(w.shape[0] if p.op == "Conv" else w.shape[1])


def out_rank(p: Node) -> Optional[int]:
    """The rank of ``p``'s output: the weight's for a convolution, 2 for Gemm, x's for a 2-D-weight MatMul."""
    if p.op in ("Conv", "ConvTranspose"):
        w = const_tensor(p.inputs[1])
        return None if w is None else len(w.shape)
    if p.op == "Gemm":
        return 2
    return rank(p.inputs[0])


def channel_axis(p: Node) -> int:
    """The axis of ``p``'s output that holds the output channels (1, or the last for MatMul)."""
    return -1 if p.op == "MatMul" else 1


def per_channel(value: np.ndarray, p: Node) -> Optional[np.ndarray]:
    """A constant operand of an elementwise op on ``p``'s output as a per-channel vector, or None.

    It must broadcast over exactly the channel axis: of rank at most the output's, every dim 1
    except the channel's (the channel count or 1). A scalar applies to every channel alike.
    """
    r, c = out_rank(p), out_channels(p)
    if r is None or c is None or value.ndim > r or value.size > MAX_CHANNEL_ELEMENTS:
        return None
    shape = (1,) * (r - value.ndim) + value.shape
    axis = channel_axis(p) % r
    if any(d != 1 for i, d in enumerate(shape) if i != axis) or shape[axis] not in (1, c):
        return None
    return np.broadcast_to(value.astype(np.float64).reshape(-1), (c,))


def _cast(value: np.ndarray, dtype: np.dtype) -> Optional[np.ndarray]:
    """``value`` (float64) in ``dtype``, or None when that overflows or a nonzero value lands below the
    dtype's smallest normal number (flushed to zero, or subnormal: fewer significant bits than the
    decomposed form keeps)."""
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        out = value.astype(dtype)
    if not np.isfinite(out).all() or ((np.abs(out) < np.finfo(dtype).tiny) & (value != 0)).any():
        return None
    return out


def fold(graph: Graph, p: Node, scale: Optional[np.ndarray], shift: Optional[np.ndarray], ctx: PassContext) -> Optional[str]:
    """Make ``p`` compute ``p(x) * scale + shift`` (per-channel float64 vectors, None = 1 / 0) in place.

    Returns None when done, else why it was refused (nothing changed then).
    """
    w_const = const_tensor(p.inputs[1])
    w = const_value(p.inputs[1])
    if w_const is None or w is None:
        return "weight is not a constant"
    if w.dtype.type not in FOLD_DTYPES:
        return f"weight dtype {w.dtype} is not float16/float32/float64"
    c = out_channels(p)
    if p.op == "MatMul" and (w.ndim != 2 or out_rank(p) is None):
        return "MatMul weight is not 2-D or the activation's rank is unknown"
    if p.op == "MatMul" and shift is not None and out_rank(p) != 2:
        return "a shift after a MatMul of rank > 2 needs an Add (no node saved)"
    bias_at = 2
    bias = const_value(p.inputs[bias_at]) if len(p.inputs) > bias_at and p.inputs[bias_at].name else None
    if len(p.inputs) > bias_at and p.inputs[bias_at].name and bias is None:
        return "bias is not a constant"
    s = np.ones(c) if scale is None else scale
    new_w = _scaled_weight(p, w.astype(np.float64), s)
    new_b = None
    if shift is not None or bias is not None:
        b = np.zeros(c) if bias is None else bias.astype(np.float64)
        if p.op == "Gemm":
            b = b * float(p.attrs.get("beta", 1.0))
        new_b = b * s + (0.0 if shift is None else shift)
    new_w = _cast(new_w, w.dtype)
    if new_b is not None:
        new_b = _cast(new_b, w.dtype)
    if new_w is None or (new_b is None and (shift is not None or bias is not None)):
        return f"folded values do not fit {w.dtype} (overflow, or a nonzero value below the smallest normal)"
    set_input(p, 1, as_constant(ctx.fresh_name(f"{p.name}_folded_weight"), new_w))
    if new_b is not None:
        b_const = as_constant(ctx.fresh_name(f"{p.name}_folded_bias"), new_b)
        if len(p.inputs) > bias_at:
            set_input(p, bias_at, b_const)
        else:
            if p.op == "MatMul":
                p.op = "Gemm"
            p.inputs.append(b_const)
        if p.op == "Gemm":
            p.attrs["beta"] = 1.0
    return None


def _scaled_weight(p: Node, w: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The weight that makes ``p`` compute its output times ``s`` per output channel."""
    if p.op == "Conv":
        return w * s.reshape((-1,) + (1,) * (w.ndim - 1))
    if p.op == "ConvTranspose":  # (C_in, C_out/group, k...): output channel g*(C_out/group)+j
        g = int(p.attrs.get("group", 1))
        cin, cog = w.shape[0], w.shape[1]
        grouped = w.reshape((g, cin // g, cog) + w.shape[2:]) * s.reshape((g, 1, cog) + (1,) * (w.ndim - 2))
        return grouped.reshape(w.shape)
    if p.op == "Gemm" and p.attrs.get("transB", 0):
        return w * s[:, None]
    return w * s[None, :]


def channel_operand(graph: Graph, node: Node, ops: frozenset[str], refuse: Refuse,
                    ctx: PassContext) -> Optional[tuple[Node, np.ndarray]]:
    """For a binary elementwise ``node`` reading one of ``ops``'s output and a constant: that producer and the
    constant as a per-channel float64 vector (None when there is none, or the constant does not fit, noted)."""
    for i in (0, 1):
        p = channel_producer(graph, node.inputs[i], ctx)
        if p is None or p.op not in ops:
            continue
        c = const_tensor(node.inputs[1 - i])
        small = c is not None and int(np.prod(c.shape)) <= MAX_CHANNEL_ELEMENTS  # a big one is no channel vector
        v = const_value(node.inputs[1 - i]) if small else None
        vector = None if v is None else per_channel(v, p)
        if v is not None and vector is None:
            refuse(node, "the constant does not broadcast over exactly the channel axis")
        return None if vector is None else (p, vector)
    return None


def fold_into(graph: Graph, node: Node, p: Node, scale: Optional[np.ndarray], shift: Optional[np.ndarray],
              ctx: PassContext, dead: list[Node], refuse: Refuse) -> bool:
    """Fold the elementwise ``node`` (``p(x) * scale + shift``) into ``p`` and bypass it; False if refused."""
    out = p.outputs[0]
    used = [t for t in node.outputs if is_used(graph, t)]
    if len(used) != 1 or used[0] is not node.outputs[0] or not can_replace(graph, node.outputs[0], out):
        return False
    why = fold(graph, p, scale, shift, ctx)
    if why is not None:
        return refuse(node, why)
    return bypass(graph, node, out, dead)


class RefusalNotes:
    """Why a pass left nodes, as report notes for those still in the graph after the fixed point: a refusal
    in an early round is often lifted by a later fold (a bias computed by a CastLike, say)."""

    def __init__(self) -> None:
        self.refusals: dict[int, tuple[Node, str]] = {}

    def refuse(self, node: Node, why: str) -> bool:
        """Remember why ``node`` was left (the latest reason wins) and decline."""
        self.refusals[id(node)] = (node, why)
        return False

    def finish(self, graph: Graph, ctx: PassContext) -> None:
        if not self.refusals:
            return
        alive = {id(n) for g in ctx.graphs(graph) for n in g.nodes}
        for key, (node, why) in self.refusals.items():
            if key in alive:
                ctx.note(f"{getattr(self, 'name', '')}: left {node.op} {node.name}: {why}")
