"""Importing into and exporting from onnx-graphsurgeon without changing the model's interface.

gs gets two things wrong at the edges of a graph:

- a graph input that also has an initializer (a default value the user may
  override) is imported as a plain constant and dropped from the graph's
  inputs: the exported model loses that input, and passes would fold the
  default as if it could never change. :func:`import_onnx` makes it a graph
  input again (a variable, so no pass treats its value as known) and keeps
  the default's TensorProto, untouched, for :func:`export_onnx` to write back.
- a tensor of optional type (a graph input, output or value_info entry)
  makes ``gs.export_onnx`` crash (``UnboundLocalError``): gs writes only
  tensor, sequence and sparse types. :func:`export_onnx` exports such
  tensors untyped and then writes their real type (:func:`value_info_proto`).

And onnxruntime refuses a graph with two nodes of one name (exporters and
hand edits make such graphs): :func:`export_onnx` renames the later ones.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter

from . import dtypes, gs_export, gs_import
from .ir import Graph, Tensor, all_graphs, set_input, tensor_map
from .lifetime import note_graph

#: Tensor kinds gs's exporter can write.
_GS_TYPES = frozenset({"tensor_type", "sequence_type", "sparse_tensor_type"})
#: Graph attribute holding ``{input name: default TensorProto}`` between import and export.
_DEFAULTS = "k3opt_input_defaults"


def import_onnx(model: onnx.ModelProto) -> Graph:
    """``gs.import_onnx(model)`` (built by :mod:`k3opt.graph.gs_import`), keeping graph inputs that
    have a default initializer and node attributes of the kinds gs skips."""
    graph, handed = gs_import.import_noting_handoffs(model)
    note_graph(graph)
    restore_default_inputs(model, graph)
    for node_proto, node in handed:  # attributes of the kinds gs skips are only on nodes whose attributes gs imported
        _restore_node_attributes(node_proto, node)
    return graph


#: Attribute kinds gs's importer skips with a warning (and exports nothing for).
_SKIPPED_KINDS = frozenset({onnx.AttributeProto.TYPE_PROTO, onnx.AttributeProto.TYPE_PROTOS,
                            onnx.AttributeProto.SPARSE_TENSOR, onnx.AttributeProto.SPARSE_TENSORS,
                            onnx.AttributeProto.TENSORS, onnx.AttributeProto.GRAPHS})


def restore_skipped_attributes(proto: onnx.GraphProto, graph: Graph) -> None:
    """Give back the attributes gs dropped on import (e.g. ``Optional``'s ``type``).

    gs imports a graph's nodes in proto order, so the i-th node of each graph
    and body corresponds to the i-th NodeProto. The values are kept as onnx
    protos, which gs's exporter writes back through ``onnx.helper.make_attribute``,
    and which CSE compares like any other attribute value.
    """
    for node_proto, node in zip(proto.node, graph.nodes):
        _restore_node_attributes(node_proto, node)


def _restore_node_attributes(proto: onnx.NodeProto, node: gs.Node) -> None:
    for attr in proto.attribute:
        if attr.type in _SKIPPED_KINDS and not attr.ref_attr_name and attr.name not in node.attrs:
            node.attrs[attr.name] = onnx.helper.get_attribute_value(attr)
        elif attr.type == onnx.AttributeProto.GRAPH and isinstance(node.attrs.get(attr.name), gs.Graph):
            restore_skipped_attributes(attr.g, node.attrs[attr.name])


def restore_default_inputs(model: onnx.ModelProto, graph: Graph) -> None:
    """Put back the graph inputs gs dropped because an initializer gives them a default.

    Each becomes a variable with the input's declared type, read by the
    constant's former readers; the initializer is remembered on ``graph``
    (shared with ``model``, never loaded).
    """
    inits = {t.name: t for t in model.graph.initializer}
    by_name = {t.name: t for t in graph.inputs}
    if not any(vi.name in inits and vi.name not in by_name for vi in model.graph.input):
        return  # the usual case: no walk over the graph
    tensors: dict[str, Tensor] = {}
    for g in all_graphs(graph):  # a default read only inside an If/Loop body too
        for name, t in g.tensors().items():
            tensors.setdefault(name, t)
    defaults = {}
    for vi in model.graph.input:
        if vi.name not in inits or vi.name in by_name:
            continue
        var = gs.Variable(vi.name, dtype=_elem_dtype(vi), shape=_shape(vi))
        old = tensors.get(vi.name)
        if old is not None:
            for node in list(old.outputs):
                for i, t in enumerate(node.inputs):
                    if t is old:
                        set_input(node, i, var)
            graph.outputs = [var if t is old else t for t in graph.outputs]
        by_name[vi.name] = var
        defaults[vi.name] = inits[vi.name]
    graph.inputs = [by_name[vi.name] for vi in model.graph.input if vi.name in by_name]
    setattr(graph, _DEFAULTS, defaults)


def _elem_dtype(vi: onnx.ValueInfoProto):
    elem = vi.type.tensor_type.elem_type
    return dtypes.numpy_dtype(elem) if elem else None


def _shape(vi: onnx.ValueInfoProto):
    tt = vi.type.tensor_type
    if not tt.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim]


def export_onnx(graph: Graph) -> onnx.ModelProto:
    """``gs.export_onnx(graph, do_type_check=False)`` (built by :mod:`k3opt.graph.gs_export`) that writes
    optional types and input defaults."""
    _unique_node_names(graph)
    maps = [tensor_map(g) for g in all_graphs(graph)]
    odd = [t for tensors in maps for t in tensors.values()
           if getattr(t, "type", "tensor_type") not in _GS_TYPES and t.dtype is not None]
    saved = [(t, t.dtype) for t in odd]
    for t in odd:
        t.dtype = None  # gs writes an untyped entry instead of crashing
    try:
        model = gs_export.export_onnx(graph, maps[0])
    finally:
        for t, dtype in saved:
            t.dtype = dtype
    if odd:
        real = {t.name: value_info_proto(t) for t in odd}
        for vi in _value_infos(model.graph):
            if vi.name in real:
                vi.type.CopyFrom(real[vi.name].type)
    defaults = vars(graph).get(_DEFAULTS, {})  # not getattr: gs.Graph looks unknown names up as ops
    inputs = {vi.name for vi in model.graph.input}
    have = {t.name for t in model.graph.initializer}
    model.graph.initializer.extend(t for name, t in defaults.items() if name in inputs and name not in have)
    return model


def _unique_node_names(graph: Graph) -> None:
    """Within each graph, rename the second and later nodes of a (non-empty) name to ``NAME_k``, unused."""
    for g in all_graphs(graph):
        for node, name in zip(g.nodes, unique_names([n.name for n in g.nodes])):
            node.name = name


def unique_names(names: Sequence[str]) -> list[str]:
    """``names`` with the second and later uses of a (non-empty) name made ``NAME_k``, k the first unused."""
    if len(set(names)) == len(names):
        return list(names)
    taken, seen, out = set(names), set(), []
    for name in names:
        if name and name in seen:
            k = 1
            while f"{name}_{k}" in taken:
                k += 1
            name = f"{name}_{k}"
            taken.add(name)
        seen.add(name)
        out.append(name)
    return out


def value_info_proto(t: Tensor) -> onnx.ValueInfoProto:
    """``t``'s ValueInfoProto, optional types included (gs keeps their element type as a TypeProto)."""
    kind = getattr(t, "type", "tensor_type")
    if kind == "optional_type" and isinstance(t.dtype, onnx.TypeProto):
        return onnx.helper.make_value_info(t.name, onnx.helper.make_optional_type_proto(t.dtype))
    if kind not in ("tensor_type", "sequence_type", "sparse_tensor_type"):  # a TypeProto with no kind set, as read
        return onnx.helper.make_value_info(t.name, onnx.TypeProto())  # (gs's exporter fails on it)
    return OnnxExporter.export_value_info_proto(t, False)


def _value_infos(g: onnx.GraphProto) -> Iterator[onnx.ValueInfoProto]:
    yield from g.input
    yield from g.output
    yield from g.value_info
    for node in g.node:
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from _value_infos(sub)
