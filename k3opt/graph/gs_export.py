"""k3opt's export of onnx-graphsurgeon 0.6's graph: ``gs.export_onnx(graph, do_type_check=False)`` written
straight into one ModelProto (docs/design.md, "In-memory graph", has the figures).

gs builds every NodeProto and ValueInfoProto on its own and copies it into
a GraphProto, which is copied again into the model; it recomputes the ONNX
type of each tensor's dtype (a dict of ml_dtypes per call) and walks the
tensor map through ``SynchronizedList.__add__``. :func:`export_onnx` sets the
same fields in place: the same proto, byte for byte. Node attributes,
constants, local functions and tensors of other kinds than plain tensors are
converted by gs's own ``OnnxExporter`` methods. One deliberate difference:
element types come from ``k3opt.graph.dtypes``, not gs's ``dtype_to_onnx``
(which types a float8e4m3fnuz tensor as float8e4m3fn).
"""
from __future__ import annotations

import struct
from typing import Optional, Sequence, Union

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter, update_import_domains
from onnx_graphsurgeon.ir.tensor import SparseValues

from . import dtypes
from .ir import Graph, Tensor, all_graphs, node_subgraphs, tensor_map
from .wire import field, varint


def export_onnx(graph: Graph, tensors: Optional[dict[str, Tensor]] = None) -> onnx.ModelProto:
    """Exactly ``gs.export_onnx(graph, do_type_check=False)``, element types from :mod:`.dtypes`; ``tensors``:
    ``tensor_map(graph)`` when known."""
    model = onnx.ModelProto()
    model.ir_version = onnx.IR_VERSION  # as onnx.helper.make_model
    used = _write_graph(graph, model.graph, tensor_map(graph) if tensors is None else dict(tensors))
    model.opset_import.extend(import_domains(graph, used=used))
    model.functions.extend([OnnxExporter.export_function(f) for f in graph.functions])
    model.producer_name = graph.producer_name
    model.producer_version = graph.producer_version
    if graph.ir_version is not None:
        model.ir_version = graph.ir_version
    return model


def import_domains(graph: Graph, graphs: Optional[Sequence[Graph]] = None,
                   used: Optional[set[Optional[str]]] = None) -> list[onnx.OperatorSetIdProto]:
    """gs's ``update_import_domains(graph)``, without gs's slow walk for subgraphs when it would add nothing.

    ``graphs``: ``graph`` and its subgraphs when the caller already knows them (``[graph]``: none), so
    even the walk that finds them is saved; ``used``: the domains of all their nodes, when known.
    """
    if graph.import_domains is not None:
        if used is None:
            used = {n.domain for g in (all_graphs(graph) if graphs is None else graphs) for n in g.nodes}
        used = {_DEFAULT.get(d, d) for d in used} - {None}
        if used <= {_DEFAULT.get(o.domain, o.domain) for o in graph.import_domains}:
            return graph.import_domains
    imports = update_import_domains(graph)
    # "ai.onnx" is the default domain's other name: gs would import it at version 1 (Cast's 'to' a string then)
    if any(o.domain == "" for o in imports):
        for i in reversed(range(len(imports))):
            if imports[i].domain == "ai.onnx":
                del imports[i]
    return imports


_DEFAULT = {"ai.onnx": ""}


def _write_graph(graph: Graph, out: onnx.GraphProto, tensors: dict[str, Tensor]) -> Optional[set[Optional[str]]]:
    """``OnnxExporter.export_graph(graph, do_type_check=False)`` (then ``make_graph``), into ``out``;
    ``tensors``: ``tensor_map(graph)``, which this consumes.

    Returns the domains of the nodes written (saves :func:`import_domains` its own walk), None when a
    node holds a body (whose nodes count too).
    """
    used: Optional[set[Optional[str]]] = set()
    for node in graph.nodes:
        _write_node(node, out.node.add())
        if used is not None:
            used.add(node.domain)
            if node.attrs and node_subgraphs(node):
                used = None
    out.name = graph.name
    for t in graph.inputs:
        write_value_info(t, out.input)
    for t in graph.outputs:
        write_value_info(t, out.output)
    constants = [t for t in tensors.values() if isinstance(t, gs.Constant)]
    # Protos first, copies after, as gs: Constants sharing one lazy TensorProto all get the last name.
    dense = [(t, None if _array_type(t) else OnnxExporter.export_tensor_proto(t))
             for t in constants if not isinstance(t._values, SparseValues)]
    sparse = [OnnxExporter.export_sparse_tensor_proto(t) for t in constants if isinstance(t._values, SparseValues)]
    for t, proto in dense:
        if proto is None:
            _write_array(t, out.initializer.add())
        else:
            out.initializer.append(proto)
    out.sparse_initializer.extend(sparse)
    for t in list(graph.inputs) + list(graph.outputs):
        tensors.pop(t.name, None)
    _write_value_infos([t for t in tensors.values()
                        if isinstance(t, gs.Variable) and (t.dtype is not None or t.shape is not None)], out)
    if graph.doc_string:
        out.doc_string = graph.doc_string
    return used


#: ONNX types whose numpy arrays gs writes as ``tobytes()`` into ``raw_data`` (no packing, no conversion).
_ARRAY_TYPES = frozenset(getattr(onnx.TensorProto, n) for n in (
    "FLOAT", "DOUBLE", "FLOAT16", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64", "BOOL"))


def _array_type(t: gs.Constant) -> Optional[int]:
    """The ONNX type of a Constant holding a numpy array that :func:`_write_array` writes; else None."""
    values = t._values
    if type(values) is not np.ndarray or values.dtype.kind not in "biuf":
        return None
    elem = _elem_type(values.dtype)
    exported = t._export_dtype
    if elem not in _ARRAY_TYPES or (exported is not None and _elem_type(exported) != elem):
        return None
    return elem


def _write_array(t: gs.Constant, out: onnx.TensorProto) -> None:
    """``OnnxExporter.export_tensor_proto(t)`` (gs's ``onnx.helper.make_tensor(..., raw=True)``) into ``out``.

    Built in place: built apart, the array's bytes were copied once more into the model (the merged
    weights of the 64-layer Llama are 25 MB).
    """
    out.data_type = _array_type(t)
    out.name = t.name
    out.dims.extend(t._values.shape)
    out.raw_data = t._values.tobytes()
    if t.data_location is not None:
        out.data_location = t.data_location


def _write_node(node: gs.Node, out: onnx.NodeProto) -> None:
    """``OnnxExporter.export_node(node)`` (``onnx.helper.make_node`` plus gs's attributes), into ``out``."""
    out.op_type = node.op
    out.input.extend([t.name for t in node.inputs])
    out.output.extend([t.name for t in node.outputs])
    if node.name:
        out.name = node.name
    if node.domain is not None:
        out.domain = node.domain
    if node.attrs:
        empty = {k for k, v in node.attrs.items() if isinstance(v, (list, tuple)) and not v}
        attrs = {k: v for k, v in node.attrs.items() if k not in empty} if empty else node.attrs
        out.attribute.extend(OnnxExporter.export_attributes(attrs))
        for name in sorted(empty):  # gs cannot tell an empty list's kind (make_attribute refuses it): the schema's
            out.attribute.add(name=name, type=_list_kind(node, name))


def _list_kind(node: gs.Node, name: str) -> int:
    """The attribute kind of ``node``'s attribute ``name`` (a list) by its op's schema; INTS when unknown."""
    try:
        kind = onnx.defs.get_schema(node.op, onnx.defs.onnx_opset_version(), node.domain or "").attributes[name].type
    except (onnx.defs.SchemaError, KeyError):
        return onnx.AttributeProto.INTS
    lists = (onnx.AttributeProto.INTS, onnx.AttributeProto.FLOATS, onnx.AttributeProto.STRINGS,
             onnx.AttributeProto.TENSORS, onnx.AttributeProto.GRAPHS)
    return int(kind) if int(kind) in lists else onnx.AttributeProto.INTS


def _elem_type(dtype) -> int:
    """The ONNX element type of a tensor's dtype (an int is one already); ValueError when it has none."""
    if isinstance(dtype, int):  # gs keeps an ONNX type it has no numpy type for (UNDEFINED, a sequence's) as is
        return dtype
    elem = dtypes.onnx_type(dtype)
    if elem is None:
        raise ValueError(f"no ONNX element type for dtype {dtype!r}")
    return elem


def _write_value_infos(tensors: list[Tensor], out: onnx.GraphProto) -> None:
    """:func:`write_value_info` for each of ``tensors`` into ``out.value_info``.

    Plain entries (a str name, a tensor type whose dims are None, ints or
    strs) are written as wire-format bytes and parsed in one go: a graph's
    tensors share a few dozen types, whose bytes are made once. The bytes
    parse to the entries :func:`write_value_info` builds (same fields, same
    order); any other entry is built by it, in its place.
    """
    types: dict[tuple, Optional[bytes]] = {}
    parts: list[bytes] = []
    for t in tensors:
        entry = _value_info_bytes(t, types)
        if entry is None:
            if parts:
                out.MergeFromString(b"".join(parts))
                parts = []
            write_value_info(t, out.value_info)
        else:
            parts.append(entry)
    if parts:
        out.MergeFromString(b"".join(parts))


#: An empty TensorShapeProto.Dimension (an unknown dim) as a ``dim`` field.
_NO_DIM = b"\x0a\x00"
#: The dim values written as bytes; a shape holding anything else is built by :func:`write_value_info`.
_PLAIN_DIMS = frozenset((type(None), int, str))


def _value_info_bytes(t: Tensor, types: dict[tuple, Optional[bytes]]) -> Optional[bytes]:
    """GraphProto field ``value_info`` holding ``t``'s ValueInfoProto, or None when ``t`` is not plain.

    ``types`` caches the type bytes by (dtype's class, dtype, dims): dims are
    None, ints and strs only, so equal keys are the same type (1.0 or True
    would equal 1).
    """
    dtype = t.dtype
    name = t.name
    if dtype is None or type(name) is not str or not (isinstance(t, gs.Constant) or t.type == "tensor_type"):
        return None
    shape = t.shape
    try:
        dims = None if shape is None else tuple(shape)
        if dims is not None and not _PLAIN_DIMS.issuperset(map(type, dims)):
            return None
        key = (type(dtype), dtype, dims)
        typed = types.get(key, False)
    except TypeError:  # not a sequence, or an unhashable dtype
        return None
    if typed is False:
        typed = types[key] = _type_bytes(_elem_type(dtype), dims)
    if typed is None:
        return None
    try:
        return field(13, field(1, name.encode()) + typed)
    except UnicodeError:
        return None


def _type_bytes(elem: int, shape: Optional[tuple]) -> Optional[bytes]:
    """ValueInfoProto field ``type``: a tensor type of ``elem`` and ``shape``, or None (not plain)."""
    if type(elem) is not int or not 0 <= elem <= 0x7FFFFFFF:
        return None
    body = b"\x08" + varint(elem)
    if shape is not None:
        dims = []
        for d in shape:
            if d is None:
                dims.append(_NO_DIM)
            elif type(d) is str:
                try:
                    dims.append(field(1, field(2, d.encode())))
                except UnicodeError:
                    return None
            elif _INT64_MIN <= d <= _INT64_MAX:
                dims.append(field(1, _int(b"\x08", d)))
            else:
                return None
        body += field(2, b"".join(dims))
    return field(2, field(1, body))


def write_value_info(t: Tensor, entries) -> None:
    """Append ``OnnxExporter.export_value_info_proto(t, False)`` to ``entries`` (a repeated ValueInfoProto
    field), the element type from :mod:`.dtypes` (gs's types float8e4m3fnuz as float8e4m3fn)."""
    dtype = t.dtype
    if dtype is None or not (isinstance(t, gs.Constant) or t.type == "tensor_type"):
        entries.append(OnnxExporter.export_value_info_proto(t, False))
        return
    elem = _elem_type(dtype)
    vi = entries.add()
    vi.name = t.name
    # onnx.helper.make_tensor_type_proto, field by field
    tensor_type = vi.type.tensor_type
    tensor_type.elem_type = elem
    shape = t.shape
    if shape is not None:
        dims = tensor_type.shape.dim
        dims.extend([])  # an empty shape is still a shape (a scalar)
        for d in shape:
            dim = dims.add()
            if d is None:
                pass
            elif isinstance(d, int):
                dim.dim_value = d
            elif isinstance(d, str):
                dim.dim_param = d
            else:
                raise ValueError(f"Invalid item in shape: {d}. Needs to be of int or str.")


# --- gs's NodeProto as bytes -------------------------------------------------------------------------------------
# Shape refreshes serialize every node's proto (the refresh after folding ~7,500 of them). Writing the protobuf wire
# format of plain nodes directly costs less than building each NodeProto with onnx.helper and serializing it (the
# figures are in docs/benchmarks.md's speed diary). Fields go in field-number order, as protobuf serializes them.

_INT64 = 1 << 64
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_pack_float = struct.Struct("<f").pack
#: AttributeProto.type (field 20) for each attribute kind written here.
_A = onnx.AttributeProto
_KIND = {kind: b"\xa0\x01" + bytes((kind,)) for kind in (_A.FLOAT, _A.INT, _A.STRING, _A.TENSOR, _A.FLOATS, _A.INTS,
                                                         _A.STRINGS)}
_INTEGRAL = frozenset((int, bool))
_REAL = frozenset((int, bool, float))
_TEXT = frozenset((str, bytes))


def _string(tag: bytes, value: str) -> bytes:
    """A string field (a name): not a str raises AttributeError, a lone surrogate UnicodeError."""
    data = value.encode()
    return tag + varint(len(data)) + data


def _text(tag: bytes, value: Union[str, bytes]) -> bytes:
    """A bytes field holding a string attribute: str as UTF-8, bytes as they are (onnx.helper's ``_to_bytes``)."""
    data = value.encode() if type(value) is str else value
    return tag + varint(len(data)) + data


def _int(tag: bytes, value: int) -> bytes:
    """An int64 field; a negative value is its 64-bit two's complement, as protobuf writes it."""
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise OverflowError(value)
    return tag + varint(value + _INT64 if value < 0 else value)


def _float(tag: bytes, value: float) -> bytes:
    """A float field: the value rounded to float32 (struct raises where it would overflow to inf)."""
    return tag + _pack_float(value)


def _attribute_bytes(name: str, value: object) -> Optional[bytes]:
    """``onnx.helper.make_attribute(name, value).SerializeToString()`` for gs's plain attribute values; None otherwise."""
    of = type(value)
    if of in _INTEGRAL:
        body, kind = _int(b"\x18", value), _A.INT
    elif of is float:
        body, kind = _float(b"\x15", value), _A.FLOAT
    elif of in _TEXT:
        body, kind = _text(b"\x22", value), _A.STRING
    elif of is list or of is tuple:
        if not value:
            return None  # make_attribute cannot tell an empty list's kind: gs raises
        kinds = set(map(type, value))
        if kinds <= _INTEGRAL:
            if bool in kinds:
                return None  # INTS: protobuf refuses a bool in a repeated int64
            body, kind = b"".join([_int(b"\x40", v) for v in value]), _A.INTS
        elif kinds <= _REAL:
            body, kind = b"".join([_float(b"\x3d", v) for v in value]), _A.FLOATS
        elif kinds <= _TEXT:
            body, kind = b"".join([_text(b"\x4a", v) for v in value]), _A.STRINGS
        else:
            return None
    elif isinstance(value, gs.Constant):
        body, kind = field(5, OnnxExporter.export_tensor_proto(value).SerializeToString()), _A.TENSOR
    else:
        return None
    return _string(b"\x0a", name) + body + _KIND[kind]


def node_bytes(node: gs.Node) -> Optional[bytes]:
    """``OnnxExporter.export_node(node).SerializeToString()``, or None when the node is not plain.

    Plain: str op, names and domain; attributes that are ints, floats, strings,
    non-empty lists of one of them, or Constants (the kinds gs imports from a
    model). Subgraphs, references, numpy values, and values protobuf would
    refuse are left to gs (None), which then exports them or raises as before.
    """
    try:
        parts = [_string(b"\x0a", t.name) for t in node.inputs]
        parts += [_string(b"\x12", t.name) for t in node.outputs]
        if node.name:
            parts.append(_string(b"\x1a", node.name))
        parts.append(_string(b"\x22", node.op))
        for key, value in node.attrs.items():
            attribute = _attribute_bytes(key, value)
            if attribute is None:
                return None
            parts.append(b"\x2a" + varint(len(attribute)) + attribute)
        if node.domain is not None:
            parts.append(_string(b"\x3a", node.domain))
    except (AttributeError, OverflowError, UnicodeError):
        return None
    return b"".join(parts)
