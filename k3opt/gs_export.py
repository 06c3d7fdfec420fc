"""``gs.export_onnx(graph, do_type_check=False)`` written straight into one ModelProto.

gs builds every NodeProto and ValueInfoProto on its own and copies it into
a GraphProto, which is copied again into the model; it recomputes the ONNX
type of each tensor's dtype (a dict of ml_dtypes per call) and walks the
tensor map through ``SynchronizedList.__add__``. :func:`export_onnx` sets the
same fields in place: the same proto, byte for byte. Node attributes,
constants, and tensors of other kinds than plain tensors are still
converted by gs's own ``OnnxExporter`` methods; graphs with local functions
go to gs entirely.
"""
from __future__ import annotations

import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter, dtype_to_onnx, update_import_domains
from onnx_graphsurgeon.ir.tensor import SparseValues

from .ir import Graph, Tensor


def export_onnx(graph: Graph) -> onnx.ModelProto:
    """Exactly ``gs.export_onnx(graph, do_type_check=False)``."""
    if graph.functions:
        return gs.export_onnx(graph, do_type_check=False)
    model = onnx.ModelProto()
    model.ir_version = onnx.IR_VERSION  # as onnx.helper.make_model
    _write_graph(graph, model.graph)
    model.opset_import.extend(update_import_domains(graph))
    model.producer_name = graph.producer_name
    model.producer_version = graph.producer_version
    if graph.ir_version is not None:
        model.ir_version = graph.ir_version
    return model


def tensor_map(graph: Graph) -> dict[str, Tensor]:
    """``graph.tensors()``: named tensors in gs's order (a repeated name keeps its first place, its last
    tensor), without gs's warnings about distinct tensors sharing a name."""
    found: dict[str, Tensor] = {}
    for t in graph.inputs:
        if t.name:
            found[t.name] = t
    for node in graph.nodes:
        for t in node.inputs:
            if t.name:
                found[t.name] = t
        for t in node.outputs:
            if t.name:
                found[t.name] = t
    for t in graph.outputs:
        if t.name:
            found[t.name] = t
    return found


def _write_graph(graph: Graph, out: onnx.GraphProto) -> None:
    """``OnnxExporter.export_graph(graph, do_type_check=False)`` (then ``make_graph``), into ``out``."""
    for node in graph.nodes:
        _write_node(node, out.node.add())
    out.name = graph.name
    for t in graph.inputs:
        _write_value_info(t, out.input)
    for t in graph.outputs:
        _write_value_info(t, out.output)
    tensors = tensor_map(graph)
    constants = [t for t in tensors.values() if isinstance(t, gs.Constant)]
    # Lists first, copies after, as gs: Constants sharing one lazy TensorProto all get the last name.
    dense = [OnnxExporter.export_tensor_proto(t) for t in constants if not isinstance(t._values, SparseValues)]
    sparse = [OnnxExporter.export_sparse_tensor_proto(t) for t in constants if isinstance(t._values, SparseValues)]
    out.initializer.extend(dense)
    out.sparse_initializer.extend(sparse)
    for t in list(graph.inputs) + list(graph.outputs):
        tensors.pop(t.name, None)
    for t in tensors.values():
        if isinstance(t, gs.Variable) and (t.dtype is not None or t.shape is not None):
            _write_value_info(t, out.value_info)
    if graph.doc_string:
        out.doc_string = graph.doc_string


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
        out.attribute.extend(OnnxExporter.export_attributes(node.attrs))


#: dtype -> ONNX element type, as gs's ``dtype_to_onnx`` gives it.
_ELEM_TYPES: dict = {}


def _write_value_info(t: Tensor, entries) -> None:
    """Append ``OnnxExporter.export_value_info_proto(t, False)`` to ``entries``."""
    dtype = t.dtype
    if dtype is None or not (isinstance(t, gs.Constant) or t.type == "tensor_type"):
        entries.append(OnnxExporter.export_value_info_proto(t, False))
        return
    if isinstance(dtype, int):
        elem = dtype
    else:
        elem = _ELEM_TYPES.get(dtype)
        if elem is None:
            elem = _ELEM_TYPES[dtype] = dtype_to_onnx(dtype)
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
