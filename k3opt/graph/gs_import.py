"""k3opt's import of a model into onnx-graphsurgeon 0.6's graph: what ``gs.import_onnx`` builds, several times
faster (docs/design.md, "In-memory graph", has the figures and why k3opt owns it rather than calling gs's).

gs builds every node and tensor through ``__setattr__`` hooks and
``SynchronizedList.extend`` and converts every Constant node's tensor
through ``onnx.helper.get_all_tensor_dtypes()``: most of the import's time on
a deep model with thousands of Constant nodes. :func:`import_onnx` fills
in the same objects directly: same classes, same attribute values in the
same order, same use-def links, same tensor map. Pieces it does not build
itself are built by gs's own importer methods, called exactly as gs calls
them: a local function (``import_function``), a sparse initializer
(``import_tensor``), and the attributes of any node holding a subgraph, a
reference or a kind gs skips (``import_attributes``).
"""
from __future__ import annotations

import gc
from collections import OrderedDict
from typing import Optional

import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.importers.onnx_importer import (
    OnnxImporter,
    get_itemsize,
    get_numpy_type,
)
from onnx_graphsurgeon.ir.tensor import LazyValues

from .ir import Graph, Node, Tensor, gs_links, new_constant, new_variable

_A = onnx.AttributeProto
#: Attribute kinds converted here; any other kind (or a reference) sends the node's attributes to gs.
_PLAIN = frozenset((_A.FLOAT, _A.INT, _A.STRING, _A.TENSOR, _A.FLOATS, _A.INTS, _A.STRINGS))
_new = object.__new__


#: The main-graph nodes whose attributes gs imported, with their protos.
Handoffs = list[tuple[onnx.NodeProto, Node]]


def import_onnx(model: onnx.ModelProto) -> Graph:
    """Exactly ``gs.import_onnx(model)``, faster."""
    return import_noting_handoffs(model)[0]


def import_noting_handoffs(model: onnx.ModelProto) -> tuple[Graph, Handoffs]:
    """:func:`import_onnx`, and which nodes' attributes went to gs: only those can hold a body
    or lack an attribute gs skips, so a fix-up need not walk every node."""
    collecting = gc.isenabled()
    gc.disable()  # ~270k objects that all live on: the collector would rescan them over and over
    try:
        graph, handed = _import(model)
        if collecting:
            _to_old_generation()
        return graph, handed
    finally:
        if collecting:
            gc.enable()


def _to_old_generation() -> None:
    """Move the new graph's objects to the collector's oldest generation.

    Left in the youngest, they would be traversed by the first young collection,
    then again by every middle-generation collection until promoted: a deep
    model's hundreds of thousands of objects, walked again and again.
    ``gc.freeze()`` then ``gc.unfreeze()`` moves every tracked object to the oldest
    generation without traversing any (a ``collect(1)`` would traverse them); young
    garbage goes along, to be found by the next full collection. When the process
    has frozen objects of its own, unfreezing would release them too: then it is
    one ``collect(1)``. The graph lives until the run ends anyway.
    """
    if gc.get_freeze_count():
        gc.collect(1)
    else:
        gc.freeze()
        gc.unfreeze()


def _import(model: onnx.ModelProto) -> tuple[Graph, list[tuple[onnx.NodeProto, Node]]]:
    g = model.graph
    opset = OnnxImporter.get_opset(model)
    domains = OnnxImporter.get_import_domains(model)
    functions = [OnnxImporter.import_function(f, model_opset=opset, model_import_domains=domains)
                 for f in model.functions]
    tensors: OrderedDict[str, Tensor] = OrderedDict()  # gs's subgraph_tensor_map
    for init in g.initializer:
        if init.name not in tensors:
            tensors[init.name] = _constant(init)
    for sparse in g.sparse_initializer:
        if sparse.values.name not in tensors:
            tensors[sparse.values.name] = OnnxImporter.import_tensor(sparse)
    for vi in g.value_info:  # gs: overwrite=True, filling in what an earlier entry lacked
        known = tensors.get(vi.name)
        if known is None:
            tensors[vi.name] = OnnxImporter.import_tensor(vi)
        else:
            extra = OnnxImporter.import_tensor(vi)
            if isinstance(known, gs.Variable):
                known.dtype = known.dtype or extra.dtype
                known.shape = known.shape or extra.shape
    inits = {t.name for t in g.initializer} | {t.values.name for t in g.sparse_initializer}
    inputs = [_io_tensor(tensors, vi) for vi in g.input if vi.name not in inits]
    outputs = [_io_tensor(tensors, vi) for vi in g.output]
    handed: list[tuple[onnx.NodeProto, Node]] = []
    nodes = [_node(proto, tensors, opset, domains, handed) for proto in g.node]
    # Built empty: gs's constructor walks every node for subgraphs to share the functions list with.
    graph = Graph(nodes=[], inputs=inputs, outputs=outputs, name=g.name, doc_string=g.doc_string,
                  producer_name=model.producer_name, producer_version=model.producer_version, opset=opset,
                  import_domains=domains, functions=functions, ir_version=model.ir_version)
    graph.nodes = nodes
    if any(isinstance(v, gs.Graph) for _, n in handed for v in n.attrs.values()):
        graph._merge_subgraph_functions()
    return graph, handed


def _io_tensor(tensors: OrderedDict, vi: onnx.ValueInfoProto) -> Tensor:
    if vi.name not in tensors:
        tensors[vi.name] = OnnxImporter.import_tensor(vi)
    return tensors[vi.name]


#: onnx data type -> (numpy dtype, item size), for types gs converts without a warning (gs's own answer, which
#: this import must reproduce; a cache of fixed facts, so process-wide).
_DTYPES: dict[int, tuple] = {}


def _dtype(data_type: int) -> Optional[tuple]:
    if data_type not in _DTYPES:
        np_type = get_numpy_type(data_type)
        if np_type is None:
            return None  # gs warns about it: let gs build it
        _DTYPES[data_type] = (np_type, get_itemsize(np_type))
    return _DTYPES[data_type]


def _constant(proto: onnx.TensorProto) -> gs.Constant:
    """``OnnxImporter.import_tensor(proto)`` for a TensorProto: a Constant with lazy values."""
    known = _dtype(proto.data_type)
    if known is None:
        return OnnxImporter.import_tensor(proto)
    values = _new(LazyValues)
    shape = proto.dims
    volume = 1
    for dim in shape[:]:  # upb gives a slice as one list, quicker than iterating the field
        volume *= dim
    values.__dict__.update(tensor=proto, shape=shape, dtype=known[0], nbytes=volume * known[1])
    return new_constant(proto.name, values, int(proto.data_location) if proto.HasField("data_location") else None)


def _attributes(proto: onnx.NodeProto) -> Optional[OrderedDict]:
    """gs's import of the node's attributes, or None when one is of a kind left to gs."""
    attrs: OrderedDict = OrderedDict()
    for a in proto.attribute[:]:
        kind = a.type
        if kind not in _PLAIN or a.ref_attr_name:
            return None
        if kind == _A.INT:
            attrs[a.name] = a.i
        elif kind == _A.TENSOR:
            attrs[a.name] = _constant(a.t)
        elif kind == _A.INTS:
            attrs[a.name] = a.ints[:]
        elif kind == _A.FLOAT:
            attrs[a.name] = a.f
        elif kind == _A.FLOATS:
            attrs[a.name] = a.floats[:]
        elif kind == _A.STRING:
            attrs[a.name] = a.s.decode()
        else:
            attrs[a.name] = [s.decode() for s in a.strings[:]]
    return attrs


def _node(proto: onnx.NodeProto, tensors: OrderedDict, opset, domains, handed: list) -> Node:
    """gs's ``OnnxImporter.import_node`` for a main-graph node (noted in ``handed`` when gs imports its
    attributes: it may then add the tensors a body reads to ``tensors`` first)."""
    node = _new(Node)
    attrs = _attributes(proto)
    if attrs is None:
        attrs = OnnxImporter.import_attributes(proto.attribute, OrderedDict(), tensors, opset, domains)
        handed.append((proto, node))
    ins, outs = gs_links(node, "outputs"), gs_links(node, "inputs")
    get = tensors.get
    for name in proto.input[:]:  # slices: see _constant
        t = get(name)
        if t is None:
            t = new_variable(name)  # an omitted optional input ("") is never shared
            if name:
                tensors[name] = t
        list.append(ins, t)
        list.append(t.__dict__["outputs"], node)
    for name in proto.output[:]:
        t = get(name)
        if t is None:
            t = new_variable(name)
            if name:
                tensors[name] = t
        list.append(outs, t)
        list.append(t.__dict__["inputs"], node)
    d = node.__dict__
    d["op"] = proto.op_type
    d["name"] = proto.name
    d["attrs"] = attrs
    d["inputs"] = ins
    d["outputs"] = outs
    d["domain"] = proto.domain if proto.HasField("domain") else None
    return node
