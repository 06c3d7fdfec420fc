"""fold-pad: a constant-mode Pad before a Conv, AveragePool or MaxPool becomes the reader's own ``pads``.

A convolution or pool with ``pads`` computes over its input with those borders added (zeros for
Conv, counted zeros for AveragePool with ``count_include_pad=1``, ignored (-inf) cells for
MaxPool), so ``Pad`` then the op is the op with the two paddings summed. Exact only when:

* the Pad is constant mode with constant, non-negative pads on the spatial axes only (axes 0 and 1
  unpadded; the opset-18 ``axes`` input is honoured);
* its value is 0 for Conv and AveragePool, -inf for MaxPool, or 0 for a MaxPool (``ceil_mode=0``) of a
  tensor that is never negative (a Relu, Sigmoid, Softmax, Exp, Abs, Softplus or a Clip with a min of at
  least 0: TensorFlow pads before its pools so): a window that holds a real cell then has a max of at least
  0, which a zero padding cell never exceeds;
* AveragePool counts its pads (``count_include_pad=1``, or becomes so when it has no pads of its
  own) and has ``ceil_mode=0``;
* MaxPool's Indices output is unused (indices would be those of the unpadded tensor), and every
  summed pad is below the kernel extent (a window wholly in padding would give the lowest float,
  not -inf);
* the reader's ``auto_pad`` is NOTSET or VALID (no padding of its own to recompute);
* the Pad's output has no other reader and is not a graph output.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ...graph.ir import Graph, Node, const_tensor, const_value, int_list, producer, set_input
from ...pipeline.analyses import Shapes
from ...pipeline.pass_base import PassContext
from ..fold._channel_affine import RefusalNotes
from .._rewire import NodeRewritePass, detach, is_used, single_use

READERS = frozenset({"Conv", "AveragePool", "MaxPool"})


def spatial_rank(node: Node) -> Optional[int]:
    """How many spatial axes ``node`` works over (its weight's rank - 2, or its kernel's length)."""
    if node.op == "Conv":
        w = const_tensor(node.inputs[1])
        kernel = node.attrs.get("kernel_shape")
        return len(kernel) if kernel else (None if w is None else len(w.shape) - 2)
    kernel = node.attrs.get("kernel_shape")
    return len(kernel) if kernel else None


def pad_amounts(pad: Node, data_rank: int) -> Optional[list[int]]:
    """The Pad's begin+end pads over all ``data_rank`` axes (``[b0, b1, ..., e0, e1, ...]``), or None."""
    if "pads" in pad.attrs:
        pads = [int(p) for p in pad.attrs["pads"]]
        axes = list(range(data_rank))
    else:
        pads = int_list(pad.inputs[1]) if len(pad.inputs) > 1 else None
        axes_in = pad.inputs[3] if len(pad.inputs) > 3 and pad.inputs[3].name else None
        axes = list(range(data_rank)) if axes_in is None else int_list(axes_in)
    if pads is None or axes is None or len(pads) != 2 * len(axes):
        return None
    axes = [a + data_rank if a < 0 else a for a in axes]
    if sorted(set(axes)) != sorted(axes) or not all(0 <= a < data_rank for a in axes):
        return None
    full = [0] * (2 * data_rank)
    for i, a in enumerate(axes):
        full[a], full[a + data_rank] = pads[i], pads[i + len(axes)]
    return full


def pad_value(pad: Node) -> Optional[float]:
    """The Pad's constant value (0 when absent), None when not a constant scalar."""
    if "value" in pad.attrs:
        return float(pad.attrs["value"])
    if len(pad.inputs) < 3 or not pad.inputs[2].name:
        return 0.0
    v = const_value(pad.inputs[2])
    return None if v is None or v.size != 1 else float(np.asarray(v).ravel()[0])


#: Ops whose output is never negative (nor NaN from a non-NaN input).
NON_NEGATIVE = frozenset({"Relu", "Sigmoid", "Softmax", "Exp", "Abs", "Softplus"})


def non_negative(t) -> bool:
    """``t`` is the output of an op that never gives a negative value (a Relu, a Clip with a constant
    min of at least 0...): a MaxPool window over it that holds a real cell has a max of at least 0, so zero
    padding cells never win."""
    p = producer(t)
    if p is None or (p.domain or "") not in ("", "ai.onnx"):
        return False
    if p.op in NON_NEGATIVE:
        return True
    if p.op == "Clip":
        low = p.attrs.get("min") if "min" in p.attrs else (const_value(p.inputs[1]) if len(p.inputs) > 1
                                                             and p.inputs[1].name else None)
        return low is not None and np.asarray(low).size == 1 and float(np.asarray(low).ravel()[0]) >= 0
    return False


class FoldPad(RefusalNotes, NodeRewritePass):
    name = "fold-pad"
    description = "Fold a constant-mode Pad of the spatial axes into the Conv/AveragePool/MaxPool reading it."
    order = 160
    preserves = frozenset({Shapes})
    ops = READERS

    def rewrite(self, graph: Graph, node: Node, ctx: PassContext, dead: list[Node]) -> bool:
        pad = producer(node.inputs[0])
        if pad is None or pad.op != "Pad" or (pad.domain or "") not in ("", "ai.onnx"):
            return False
        if not single_use(graph, node.inputs[0]) or not ctx.owns(graph, pad):
            return False
        why = self._refusal(graph, node, pad)
        if why is not None:
            return self.refuse(node, why)
        r = spatial_rank(node)
        pads = pad_amounts(pad, r + 2)
        own = [int(p) for p in node.attrs.get("pads", [0] * (2 * r))]
        summed = [own[i] + pads[2 + i] for i in range(r)] + [own[r + i] + pads[r + 4 + i] for i in range(r)]
        if node.op == "MaxPool":
            extent = [(k - 1) * d + 1 for k, d in zip(node.attrs["kernel_shape"], node.attrs.get("dilations", [1] * r))]
            if any(p >= extent[i % r] for i, p in enumerate(summed)):
                return self.refuse(node, "a summed pad reaches the kernel extent")
        if node.op == "AveragePool":
            node.attrs["count_include_pad"] = 1
        node.attrs["auto_pad"] = "NOTSET"
        node.attrs["pads"] = summed
        set_input(node, 0, pad.inputs[0])
        detach(pad, dead)
        return True

    def _refusal(self, graph: Graph, node: Node, pad: Node) -> Optional[str]:
        """Why the Pad cannot fold into ``node``, or None."""
        mode = pad.attrs.get("mode", "constant")
        if (mode.decode() if isinstance(mode, bytes) else mode) != "constant":
            return f"Pad mode {mode!r} is not constant"
        auto_pad = node.attrs.get("auto_pad", "NOTSET")
        if (auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad) not in ("NOTSET", "VALID"):
            return f"auto_pad {auto_pad} pads by itself"
        r = spatial_rank(node)
        pads = None if r is None else pad_amounts(pad, r + 2)
        if pads is None:
            return "pads, axes or the reader's rank are not constant/known"
        if any(p < 0 for p in pads) or any(pads[i] or pads[i + r + 2] for i in (0, 1)):
            return "pads are negative or touch the batch/channel axes"
        value = pad_value(pad)
        want = -np.inf if node.op == "MaxPool" else 0.0
        if node.op == "MaxPool" and value == 0.0 and non_negative(pad.inputs[0]):
            if int(node.attrs.get("ceil_mode", 0)):
                return "MaxPool with ceil_mode=1 over zero padding"
        elif value is None or value != want:
            return f"pad value {value} is not {want} for {node.op}"
        if node.op == "AveragePool":
            if int(node.attrs.get("ceil_mode", 0)):
                return "AveragePool with ceil_mode=1"
            if not int(node.attrs.get("count_include_pad", 0)) and any(node.attrs.get("pads", [])):
                return "AveragePool excludes its own pads from the count"
        if node.op == "MaxPool" and len(node.outputs) > 1 and is_used(graph, node.outputs[1]):
            return "MaxPool's Indices output is used"
        return None
