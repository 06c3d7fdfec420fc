"""The in-memory graph layer: the only package that touches onnx-graphsurgeon or the protobuf wire format.

Outside ``k3opt.graph`` code reaches graph objects through the names re-exported here (used as
``from k3opt import graph as gs``: ``gs.Constant``, ``gs.Variable``, ``gs.Node``...), and through the
modules ``dtypes`` (the one ONNX element type <-> numpy dtype mapping), ``ir`` (reading constants,
creating values, rewiring), ``gs_roundtrip`` (import/export) and ``wire``.
"""
from onnx_graphsurgeon import Constant, Graph, Node, Tensor, Variable, export_onnx, import_onnx
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter
from onnx_graphsurgeon.ir.tensor import LazyValues, SparseValues
from onnx_graphsurgeon.logger import G_LOGGER

__all__ = ["Constant", "G_LOGGER", "Graph", "LazyValues", "Node", "OnnxExporter", "SparseValues", "Tensor",
           "Variable", "export_onnx", "import_onnx"]
