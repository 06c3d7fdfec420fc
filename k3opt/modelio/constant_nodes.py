"""Constant nodes lifted into initializers before the graph is imported.

A TorchScript export spells every literal as a ``Constant`` node: 5,732 of the 16,108 nodes of the
64-layer Llama at opset 14. fold-constants' first step turns each into an initializer of the same name;
when it is the pipeline's first pass, the run lifts them on the proto instead, before shape inference
and the import: they are then never inferred, imported as nodes, walked by the passes' first scans or
removed one by one. The result is the graph fold-constants' first step makes, so the output is the same
(tests/test_constant_nodes.py compares whole runs byte for byte).

Only what that step would lift, and only what shape inference sees the same way as an initializer: a
node of the default domain with one output that a node reads and that is no graph output, holding its
``value`` tensor inline (no ``data_location``), under 1 KB unless it is a string tensor (the seed's
inference model keeps exactly those initializers inline: it reads their data as it reads a Constant
node's). Anything else is left to fold-constants, which lifts the rest in place as before.
"""
from __future__ import annotations

import onnx
from onnx import AttributeProto, TensorProto

from .external import EXTERNAL_THRESHOLD, tensor_nbytes


def lift_constant_nodes(model: onnx.ModelProto) -> list[str]:
    """Turn the main graph's liftable ``Constant`` nodes (see the module docstring) into initializers, in
    place; returns the names of the nodes removed, one per node (the run's fresh names must still avoid them).

    For a model without If/Loop/Scan bodies (its loading said so): a body's reads of outer values are
    not looked for.
    """
    g = model.graph
    nodes = list(g.node)
    read: set[str] = set()
    candidates: list[int] = []
    for i, node in enumerate(nodes):
        read.update(node.input[:])
        if node.op_type == "Constant" and _liftable(node):
            candidates.append(i)
    outputs = {vi.name for vi in g.output}
    lifted = [i for i in candidates if nodes[i].output[0] in read and nodes[i].output[0] not in outputs]
    if not lifted:
        return []
    for i in lifted:
        node = nodes[i]
        t = g.initializer.add()
        t.CopyFrom(node.attribute[0].t)
        t.name = node.output[0]
    gone = set(lifted)
    del g.node[:]
    g.node.extend(n for i, n in enumerate(nodes) if i not in gone)
    return [nodes[i].name for i in lifted]


def _liftable(node: onnx.NodeProto) -> bool:
    if node.domain not in ("", "ai.onnx") or len(node.output) != 1 or not node.output[0] or \
            len(node.attribute) != 1:
        return False
    attr = node.attribute[0]
    if attr.name != "value" or attr.type != AttributeProto.TENSOR or attr.ref_attr_name:
        return False
    t = attr.t
    return not t.HasField("data_location") and \
        (t.data_type == TensorProto.STRING or tensor_nbytes(t) < EXTERNAL_THRESHOLD)
