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

from typing import Optional

import onnx
from onnx import AttributeProto, TensorProto

from .external import is_weight


def lift_constant_nodes(model: onnx.ModelProto) -> list[str]:
    """Turn the main graph's liftable ``Constant`` nodes (see the module docstring) into initializers, in
    place; returns the names of the nodes removed, one per node (the run's fresh names must still avoid them).

    For a model without If/Loop/Scan bodies (its loading said so): a body's reads of outer values are
    not looked for.
    """
    g = model.graph
    read: set[str] = set()
    candidates: list[tuple[str, str, TensorProto]] = []  # (node name, output, value) in node order
    for node in g.node:
        read.update(node.input[:])
        if node.op_type == "Constant":
            value = _liftable_value(node)
            if value is not None:
                candidates.append((node.name, node.output[0], value))
    outputs = {vi.name for vi in g.output}
    lifted = [c for c in candidates if c[1] in read and c[1] not in outputs]
    if not lifted:
        return []
    for _, name, value in lifted:
        t = g.initializer.add()
        t.CopyFrom(value)
        t.name = name
    gone = {name for _, name, _ in lifted}
    # A stable sort moves the lifted nodes last, in place: cheaper than rebuilding the field without them.
    # An output name is defined once, so a Constant defining a lifted name is a lifted node.
    g.node.sort(key=lambda n: n.op_type == "Constant" and n.output[0] in gone)
    del g.node[len(g.node) - len(lifted):]
    return [node_name for node_name, _, _ in lifted]


def _liftable_value(node: onnx.NodeProto) -> Optional[TensorProto]:
    """The Constant node's value tensor when the node can be lifted, else None."""
    if node.domain not in ("", "ai.onnx") or len(node.output) != 1 or not node.output[0] or \
            len(node.attribute) != 1:
        return None
    attr = node.attribute[0]
    if attr.name != "value" or attr.type != AttributeProto.TENSOR or attr.ref_attr_name:
        return None
    t = attr.t
    if t.HasField("data_location"):
        return None
    return None if is_weight(t) else t  # the seed's inference model keeps exactly these inline
