"""conv1d-to-conv2d (``--target cann`` only): a 1-D Conv becomes ``Unsqueeze -> 2-D Conv -> Squeeze``.

ATC's convolution kernels are 2-D; Ascend's own msit tool (Conv1d2Conv2d) rewrites Conv1d the same
way. The input ``(N, C, L)`` gets a unit height, ``(N, C, 1, L)``; the constant weight
``(M, C/g, k)`` becomes ``(M, C/g, 1, k)``; the attributes gain a leading unit axis (kernel 1,
stride 1, dilation 1, no padding on the height); the result ``(N, M, 1, L')`` loses the height
again. A height of 1 convolved by a kernel of height 1 is the 1-D convolution, so the rewrite is exact
(``auto_pad`` SAME_* pads the height by 0).

Refused: a non-constant weight (it would need its own Unsqueeze at run time), a weight that is not
3-D.
"""
from __future__ import annotations

import numpy as np
from .... import graph as gs

from ....graph.ir import Graph, Node, as_constant, const_tensor, const_value, new_variable, set_input
from ....pipeline.pass_base import PassContext
from ....passes._rewire import NodeRewritePass


def _axes_node(op: str, x, out, ctx: PassContext, base: str) -> Node:
    """``op(x, axes=[2]) -> out`` in the form the emitted opset takes (input from 13, attribute before)."""
    name = ctx.fresh_name(f"{base}_{op.lower()}")
    if ctx.emit_opset >= 13:
        axes = as_constant(ctx.fresh_name(f"{base}_height_axis"), np.array([2], np.int64))
        return gs.Node(op, name, inputs=[x, axes], outputs=[out])
    return gs.Node(op, name, attrs={"axes": [2]}, inputs=[x], outputs=[out])


class Conv1dToConv2d(NodeRewritePass):
    name = "conv1d-to-conv2d"
    description = "For Ascend: a 1-D Conv becomes Unsqueeze, 2-D Conv (height 1), Squeeze (as msit's Conv1d2Conv2d)."
    order = 168
    targets = ("cann",)
    ops = frozenset({"Conv"})

    def rewrite(self, graph: Graph, node: Node, ctx: PassContext, dead: list[Node]) -> bool:
        w = const_tensor(node.inputs[1]) if len(node.inputs) > 1 else None
        if w is None or len(w.shape) != 3:
            return False
        weight = const_value(node.inputs[1])
        base = node.name or "conv1d"
        set_input(node, 1, as_constant(ctx.fresh_name(f"{base}_weight_2d"), weight[:, :, None, :]))
        attrs = node.attrs
        attrs["kernel_shape"] = [1, int(attrs.get("kernel_shape", [weight.shape[2]])[0])]
        attrs["strides"] = [1] + [int(s) for s in attrs.get("strides", [1])]
        attrs["dilations"] = [1] + [int(d) for d in attrs.get("dilations", [1])]
        auto_pad = attrs.get("auto_pad", "NOTSET")
        if (auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad) == "NOTSET":  # else no pads allowed
            pads = [int(p) for p in attrs.get("pads", [0, 0])]
            attrs["pads"] = [0, pads[0], 0, pads[1]]
        x, y = node.inputs[0], node.outputs[0]
        x4, y4 = new_variable(ctx.fresh_name(f"{base}_in_2d")), new_variable(ctx.fresh_name(f"{base}_out_2d"))
        x4.dtype = y4.dtype = y.dtype
        unsqueeze = _axes_node("Unsqueeze", x, x4, ctx, base)
        set_input(node, 0, x4)
        list.__setitem__(node.outputs, 0, y4)  # relinked by identity
        list.__setitem__(y.inputs, slice(None), [n for n in y.inputs if n is not node])
        list.append(y4.inputs, node)
        squeeze = _axes_node("Squeeze", y4, y, ctx, base)
        at = next(i for i, n in enumerate(graph.nodes) if n is node)
        graph.nodes[at:at + 1] = [unsqueeze, node, squeeze]
        return True
