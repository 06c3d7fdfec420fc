"""Repairing what onnxruntime runs but onnx's checker rejects, in memory, with a note per repair.

Exporters of the opset-11..16 era wrote graphs onnxruntime accepts and onnx's
checker does not; k3opt's output must pass the checker, so each such fault is
repaired where the repair is exact, and said in the report:

- ``LayerNormalization`` in the default domain below opset 17 (onnxruntime's
  contrib op, registered there for opsets 1-16) becomes the standard
  decomposition of opset 17's LayerNormalization (the same definition); the
  layer-norm fusion folds it back where the output opset has the op;
- ``SimplifiedLayerNormalization`` in the default domain (onnxruntime's RMS
  normalization, never an onnx op) becomes ``x / sqrt(mean(x^2) + eps) * scale``;
- ``value_info`` entries without a tensor type are dropped (they say nothing);
- at IR version < 4, initializers not listed as graph inputs are constants to
  onnxruntime; the IR version is raised to 4, where that is what they mean;
- a name defined in two sibling bodies (If branches) is renamed in the later one.

What cannot be repaired stays; :func:`input_checker_fault` names it when the
output then fails the checker, so the input is blamed and not the output.
"""
from __future__ import annotations

import os
from typing import Iterator, Optional

import onnx
from onnx import TensorProto, helper

from ..errors import InputError

_DEFAULT = ("", "ai.onnx")


def repair(model: onnx.ModelProto, bodies: bool = True) -> list[str]:
    """Repair ``model`` in place; returns one report note per kind of repair made.

    ``bodies=False``: no node holds a body (validation saw none), so no body is walked.
    """
    notes = []
    dropped = _drop_untyped_value_info(model.graph, bodies)
    if dropped:
        notes.append(f"input repaired: {dropped} value_info entr{'y' if dropped == 1 else 'ies'} without a type "
                     f"dropped")
    if model.ir_version < 4 and _initializers_not_inputs(model.graph):
        notes.append(f"input repaired: IR version raised from {model.ir_version} to 4 (its initializers not "
                     f"listed as graph inputs are constants, as onnxruntime reads them)")
        model.ir_version = 4
    for op, count in _decompose_contrib_norms(model).items():
        notes.append(f"input repaired: {count} {op} node{'s' if count > 1 else ''} of the default domain "
                     f"(onnxruntime's contrib op, not onnx's at this opset) written in standard ops, as defined")
    if bodies:
        renamed = _rename_sibling_names(model.graph)
        if renamed:
            notes.append(f"input repaired: {renamed} tensor name{'s' if renamed > 1 else ''} defined in two bodies "
                         f"renamed in the later one")
    return notes


def input_checker_fault(path: Optional[os.PathLike]) -> Optional[str]:
    """onnx's checker's first complaint about the model file ``path`` once repaired (None: it passes).

    Used when an output fails the checker, to tell a fault of the input
    (refused, exit 2) from one of k3opt (exit 1). Only runs on that failure.
    """
    if path is None:
        return None
    from .loading import read_model

    try:
        loaded = read_model(path)
        repair(loaded.model, loaded.bodies)
        data = loaded.model.SerializeToString()
    except (InputError, ValueError):
        return None
    try:
        onnx.checker.check_model(data)
    except Exception as exc:  # noqa: BLE001 - ValidationError, or onnx's C++ errors
        text = str(exc).strip()
        return (text.splitlines()[0].rstrip(".") if text else type(exc).__name__)[:300]
    return None


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("g"):
                yield from _graphs(attr.g)
            for sub in attr.graphs:
                yield from _graphs(sub)


def _drop_untyped_value_info(graph: onnx.GraphProto, bodies: bool) -> int:
    dropped = 0
    for g in _graphs(graph) if bodies else (graph,):
        keep = [vi for vi in g.value_info if _typed(vi)]
        if len(keep) != len(g.value_info):
            dropped += len(g.value_info) - len(keep)
            del g.value_info[:]
            g.value_info.extend(keep)
    return dropped


def _typed(vi: onnx.ValueInfoProto) -> bool:
    kind = vi.type.WhichOneof("value")
    if kind is None:
        return False
    return kind != "tensor_type" or vi.type.tensor_type.elem_type != TensorProto.UNDEFINED


def _initializers_not_inputs(graph: onnx.GraphProto) -> bool:
    inputs = {i.name for i in graph.input}
    return any(t.name not in inputs for t in graph.initializer)


def _default_opset(model: onnx.ModelProto) -> int:
    return max((o.version for o in model.opset_import if o.domain in _DEFAULT), default=1)


#: onnxruntime's ops registered in the default domain that onnx's schemas lack there: op -> the opsets below which
#: they are contrib ops (None: at every opset; LayerNormalization is standard from 17).
_CONTRIB_NORMS = {"LayerNormalization": 17, "SimplifiedLayerNormalization": None}


def _decompose_contrib_norms(model: onnx.ModelProto) -> dict[str, int]:
    """Write each default-domain LayerNormalization of a model below opset 17, and SimplifiedLayerNormalization
    (RMS normalization; never an onnx op) at any opset, as their definitions in standard ops (statistics in
    float32 for narrower inputs, as onnxruntime stashes them); returns how many of each."""
    opset = _default_opset(model)
    wanted = {op for op, below in _CONTRIB_NORMS.items() if below is None or opset < below}
    counts: dict[str, int] = {}
    for g in _graphs(model.graph):
        if not any(n.op_type in wanted and n.domain in _DEFAULT for n in g.node):
            continue
        ranks, types = _known_types(g)
        nodes: list[onnx.NodeProto] = []
        for i, node in enumerate(g.node):
            if node.op_type not in wanted or node.domain not in _DEFAULT:
                nodes.append(node)
                continue
            centered = node.op_type == "LayerNormalization"
            nodes.extend(_layernorm_nodes(node, f"{node.name or node.op_type}_{i}", ranks, types, centered, opset))
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
        del g.node[:]
        g.node.extend(nodes)
    return counts


def _known_types(graph: onnx.GraphProto) -> tuple[dict[str, int], dict[str, int]]:
    ranks, types = {}, {}
    for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
        if vi.type.HasField("tensor_type"):
            t = vi.type.tensor_type
            types[vi.name] = t.elem_type
            if t.HasField("shape"):
                ranks[vi.name] = len(t.shape.dim)
    for t in graph.initializer:
        ranks[t.name], types[t.name] = len(t.dims), t.data_type
    return ranks, types


def _layernorm_nodes(node: onnx.NodeProto, tag: str, ranks: dict[str, int], types: dict[str, int],
                     centered: bool = True, opset: int = 16) -> list:
    """opset 17's LayerNormalization function body for ``node`` (outputs Y, Mean, InvStdDev as named); not
    ``centered``: onnxruntime's SimplifiedLayerNormalization (outputs Y, InvStdDev), ``x / sqrt(mean(x^2) + eps)
    * scale``. ReduceMean's axes are an input from opset 18 on."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    axis, eps = int(attrs.get("axis", -1)), float(attrs.get("epsilon", 1e-5))
    x = node.input[0]
    if axis < 0:
        axes = list(range(axis, 0))
    elif x in ranks:
        axes = list(range(axis, ranks[x]))
    else:
        raise InputError(f"{node.op_type} '{node.name}' of the default domain (onnxruntime's contrib op) normalizes "
                         f"from axis {axis} of an input of unknown rank: k3opt cannot write it in standard ONNX")
    for role, name in zip(("scale", "bias"), node.input[1:3]):
        if name and ranks.get(name, len(axes)) < len(axes):  # onnxruntime's kernel reads past its end
            raise InputError(f"{node.op_type} '{node.name}': its {role} '{name}' has rank {ranks[name]}, below the "
                             f"{len(axes)} normalized axes (onnxruntime reads it as the normalized shape: the "
                             "result is undefined)")
    dtype = types.get(x, TensorProto.FLOAT)
    wide = dtype in (TensorProto.FLOAT, TensorProto.DOUBLE)
    n = lambda suffix: f"{tag}/{suffix}"  # noqa: E731
    out = []
    src = x
    if not wide:
        out.append(helper.make_node("Cast", [x], [n("x32")], to=TensorProto.FLOAT))
        src = n("x32")
    stash = TensorProto.FLOAT if not wide else dtype
    eps_name = n("eps")
    out.append(helper.make_node("Constant", [], [eps_name],
                                value=helper.make_tensor(eps_name, stash, [], [eps])))
    outputs = list(node.output) + [""] * (3 - len(node.output))
    if not centered:  # (Y, InvStdDev): no Mean output
        outputs = [outputs[0], "", outputs[1]]
    mean = outputs[1] if outputs[1] and wide else n("mean")
    inv = outputs[2] if outputs[2] and wide else n("inv_std")

    def reduce_mean(x: str, y: str) -> onnx.NodeProto:
        if opset < 18:
            return helper.make_node("ReduceMean", [x], [y], axes=axes, keepdims=1)
        return helper.make_node("ReduceMean", [x, n("axes")], [y], keepdims=1)

    if opset >= 18:
        out.append(helper.make_node("Constant", [], [n("axes")], value=helper.make_tensor(
            n("axes"), TensorProto.INT64, [len(axes)], axes)))
    if centered:
        out += [reduce_mean(src, mean), helper.make_node("Sub", [src, mean], [n("d")])]
    else:
        out.append(helper.make_node("Identity", [src], [n("d")]))
    out += [
        helper.make_node("Mul", [n("d"), n("d")], [n("d2")]),
        reduce_mean(n("d2"), n("var")),
        helper.make_node("Add", [n("var"), eps_name], [n("var_eps")]),
        helper.make_node("Sqrt", [n("var_eps")], [n("std")]),
        helper.make_node("Div", [n("d"), n("std")], [n("norm")]),
    ]
    if outputs[2]:
        one = n("one")
        out.append(helper.make_node("Constant", [], [one], value=helper.make_tensor(one, stash, [], [1.0])))
        out.append(helper.make_node("Div", [one, n("std")], [inv]))
    norm = n("norm")
    if not wide:
        out.append(helper.make_node("Cast", [norm], [n("norm_x")], to=dtype))
        norm = n("norm_x")
        if outputs[1]:  # Mean and InvStdDev keep the stash type in both definitions
            out.append(helper.make_node("Identity", [mean], [outputs[1]]))
        if outputs[2]:
            out.append(helper.make_node("Identity", [inv], [outputs[2]]))
    scale, bias = node.input[1], node.input[2] if len(node.input) > 2 else ""
    if bias:
        out.append(helper.make_node("Mul", [norm, scale], [n("scaled")]))
        out.append(helper.make_node("Add", [n("scaled"), bias], [outputs[0]]))
    else:
        out.append(helper.make_node("Mul", [norm, scale], [outputs[0]]))
    return out


def _rename_sibling_names(graph: onnx.GraphProto) -> int:
    """Rename names a body defines that another body or the outer graph already defines (walk order);
    returns how many names were renamed."""
    seen = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    seen |= {o for n in graph.node for o in n.output if o}
    counter, renamed = [0], [0]

    def fresh(name: str) -> str:
        renamed[0] += 1
        while True:
            counter[0] += 1
            candidate = f"{name}__k3opt{counter[0]}"
            if candidate not in seen:
                return candidate

    def visit(g: onnx.GraphProto) -> None:
        for node in g.node:
            for sub in _bodies(node):
                defined = [i.name for i in sub.input] + [t.name for t in sub.initializer]
                defined += [o for n in sub.node for o in n.output if o]
                clash = {name: fresh(name) for name in defined if name in seen}
                if clash:
                    _rename(sub, clash)
                seen.update(clash.get(name, name) for name in defined)
                visit(sub)

    visit(graph)
    return renamed[0]


def _bodies(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for attr in node.attribute:
        if attr.HasField("g"):
            yield attr.g
        yield from attr.graphs


def _rename(graph: onnx.GraphProto, names: dict[str, str]) -> None:
    """Rename ``names`` in ``graph`` and in the bodies inside it that see them from outside."""
    for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
        vi.name = names.get(vi.name, vi.name)
    for t in graph.initializer:
        t.name = names.get(t.name, t.name)
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in names:
                node.input[i] = names[name]
        for i, name in enumerate(node.output):
            if name in names:
                node.output[i] = names[name]
        for sub in _bodies(node):
            shadowed = {i.name for i in sub.input} | {t.name for t in sub.initializer}
            shadowed |= {o for n in sub.node for o in n.output}
            inner = {k: v for k, v in names.items() if k not in shadowed}
            if inner:
                _rename(sub, inner)
