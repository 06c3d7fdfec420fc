"""Which weights of a model are quantized: MatMul/Gemm weights that are constant, the lm_head and the
embedding tables only when asked; each weight left in float gets a reason."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import onnx
from onnx import TensorProto

#: Weight dtypes quantized (DequantizeLinear's scale, and so its output, keeps the weight's dtype).
FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16)
#: Ops a value passes through unchanged in meaning on its way from the lm_head to the logits output.
_TO_OUTPUT = {"Reshape", "Cast", "Identity", "Add", "Mul", "Div", "Tanh", "Transpose", "Squeeze", "Unsqueeze",
              "Flatten", "Softmax", "LogSoftmax", "Slice", "Gather"}


@dataclass
class Site:
    """One weight to quantize: its initializer, the nodes that read it as the ``(k, n)`` right operand,
    whether it is stored transposed (a Gemm with transB=1: ``(n, k)``), and what it is (``matmul``,
    ``lm_head``, ``embedding``)."""

    name: str
    users: list[onnx.NodeProto]
    transposed: bool = False
    kind: str = "matmul"
    #: ``Transpose(W, perm=[1, 0])`` nodes the users read W through (the dynamo exporter's nn.Linear):
    #: removed once the users read the dequantized weight.
    transposes: list[onnx.NodeProto] = field(default_factory=list)

    @property
    def reads(self) -> set[str]:
        """The values the users read the weight as (itself, and its transposes' outputs)."""
        return {self.name, *(t.output[0] for t in self.transposes)}


@dataclass
class Selection:
    sites: list[Site] = field(default_factory=list)
    #: weight or node name -> why it stays float
    kept: dict[str, str] = field(default_factory=dict)


def _gemm_plain(node: onnx.NodeProto) -> Optional[str]:
    """Why a Gemm cannot become ``MatMul(A, dq(B)) [+ C]`` exactly, or None."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if attrs.get("transA", 0):
        return "Gemm with transA=1"
    if attrs.get("alpha", 1.0) != 1.0:
        return f"Gemm with alpha={attrs['alpha']}"
    if len(node.input) > 2 and node.input[2] and attrs.get("beta", 1.0) != 1.0:
        return f"Gemm with beta={attrs['beta']}"
    return None


def _reaches_output(graph: onnx.GraphProto, value: str, consumers: dict[str, list[onnx.NodeProto]]) -> bool:
    """Whether ``value`` flows to the logits (the first graph output, or one named ``*logits*``) through
    pass-through ops only: then its MatMul is the lm_head (a key/value projection may reach a ``present``
    output the same way, which is no lm_head)."""
    outputs = {o.name for i, o in enumerate(graph.output) if i == 0 or "logits" in o.name.lower()}
    seen, todo = set(), [value]
    while todo:
        v = todo.pop()
        if v in outputs:
            return True
        if v in seen:
            continue
        seen.add(v)
        for node in consumers.get(v, []):
            if node.op_type in _TO_OUTPUT:
                todo.extend(node.output)
    return False


def select(model: onnx.ModelProto, *, lm_head: bool = False, embedding: bool = False) -> Selection:
    """The weights of the main graph to quantize, and the reasons for those kept in float."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in g.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    out = Selection()
    for name, t in inits.items():
        users = consumers.get(name, [])
        if not users:
            continue
        flips = [n for n in users if _is_flip(n) and consumers.get(n.output[0])
                 and all(_reads_as_b(u, n.output[0]) and u.op_type == "MatMul" for u in consumers[n.output[0]])]
        if flips:  # read through Transpose(W): only that way (a Gemm's transB is its own way of saying it)
            users = [n for n in users if n not in flips] + [u for f in flips for u in consumers[f.output[0]]]
        weight_uses = [n for n in users if _reads_as_b(n, name) or (flips and n.op_type == "MatMul"
                                                                  and n.input[1] in {f.output[0] for f in flips})]
        gathers = [n for n in users if n.op_type == "Gather" and n.input[0] == name]
        if not weight_uses and not gathers:
            continue
        why = _unquantizable(t)
        if weight_uses and len(weight_uses) + len(gathers) != len(users):
            why = why or "also read by " + ", ".join(sorted({n.op_type for n in users} - {"MatMul", "Gemm"}))
        if gathers and not weight_uses:
            attrs = [onnx.helper.get_attribute_value(a) for n in gathers for a in n.attribute if a.name == "axis"]
            if not embedding:
                out.kept[name] = "embedding table kept in float (--quantize-embedding to include it)"
            elif why or any(a != 0 for a in attrs) or len(gathers) != len(users):
                out.kept[name] = f"embedding table kept in float: {why or 'not a plain Gather over axis 0'}"
            else:
                out.sites.append(Site(name, gathers, kind="embedding"))
            continue
        if gathers:
            why = why or "shared with an embedding Gather (tied)"
        transposed = set()
        for n in weight_uses:
            if n.input[1] != name:  # through one of the flips
                transposed.add(True)
            elif n.op_type == "Gemm":
                why = why or _gemm_plain(n)
                transposed.add(any(a.name == "transB" and a.i for a in n.attribute))
            else:
                transposed.add(False)
        if len(transposed) > 1:
            why = why or "read both transposed and not"
        head = any(_reaches_output(g, n.output[0], consumers) for n in weight_uses)
        if why is None and head and not lm_head:
            why = "lm_head kept in float (--quantize-lm-head to include it)"
        if why is not None:
            out.kept[name] = why
            continue
        out.sites.append(Site(name, weight_uses, transposed=transposed.pop(), kind="lm_head" if head else "matmul",
                              transposes=flips))
    return out


def _reads_as_b(node: onnx.NodeProto, value: str) -> bool:
    return node.op_type in ("MatMul", "Gemm") and len(node.input) > 1 and node.input[1] == value \
        and node.input[0] != value


def _is_flip(node: onnx.NodeProto) -> bool:
    perm = [list(a.ints) for a in node.attribute if a.name == "perm"]
    return node.op_type == "Transpose" and perm == [[1, 0]]


def _unquantizable(t: TensorProto) -> Optional[str]:
    if t.data_type not in FLOAT_TYPES:
        return f"dtype {TensorProto.DataType.Name(t.data_type).lower()} (float32/float16 are quantized)"
    if len(t.dims) != 2:
        return f"a rank-{len(t.dims)} weight (2-D weights are quantized)"
    return None
