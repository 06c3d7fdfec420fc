"""Exporting a gs graph back to a ModelProto with the source model's metadata and opset imports."""
from __future__ import annotations

import onnx

from .. import graph as gs
from ..graph import gs_roundtrip, ir


def export_graph(graph: gs.Graph, model: onnx.ModelProto) -> onnx.ModelProto:
    """Clean up, sort and export ``graph`` with ``model``'s metadata and opset imports."""
    ir.toposort(ir.cleanup(graph))
    out = gs_roundtrip.export_onnx(graph)
    out.ir_version = model.ir_version
    for field in ("producer_name", "producer_version", "domain", "model_version", "doc_string"):
        setattr(out, field, getattr(model, field))
    del out.metadata_props[:]
    out.metadata_props.extend(model.metadata_props)
    imports = list(model.opset_import)
    known = {o.domain for o in imports} | {"ai.onnx"}
    imports += [o for o in out.opset_import if o.domain not in known and o.domain]
    del out.opset_import[:]
    out.opset_import.extend(imports)
    return out
