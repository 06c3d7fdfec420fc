"""ONNX operator schemas as the matcher and rewriter need them: attribute defaults, and node validity.

Looked up through ``onnx.defs`` for the model's opset and cached, so a
missing ``keepdims`` compares equal to ``keepdims=1`` and a rewrite that
builds an unknown op or a wrong attribute is rejected before it touches
the graph.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import onnx
from onnx import defs

_NO_DEFAULT = object()


@functools.lru_cache(maxsize=None)  # of onnx's built-in schemas: shared by runs and threads, never changes
def get_schema(op_type: str, domain: str, opset: int) -> Optional[defs.OpSchema]:
    """The schema of ``op_type`` in force at ``opset`` (None for unknown ops/domains)."""
    try:
        return defs.get_schema(op_type, opset, domain)
    except defs.SchemaError:
        return None


@functools.lru_cache(maxsize=None)  # as get_schema; attr_value copies a list it returns (shared)
def _default(op_type: str, domain: str, opset: int, name: str) -> Any:
    schema = get_schema(op_type, domain, opset)
    if schema is None or name not in schema.attributes:
        return _NO_DEFAULT
    proto = schema.attributes[name].default_value
    if proto is None or proto.type == onnx.AttributeProto.UNDEFINED:
        return _NO_DEFAULT
    value = onnx.helper.get_attribute_value(proto)
    return value.decode() if isinstance(value, bytes) else value


def attr_value(node_attrs: dict, op_type: str, domain: str, opset: int, name: str) -> Any:
    """The node's attribute ``name``, or the schema default, or :data:`MISSING`."""
    if name in node_attrs:
        return node_attrs[name]
    value = _default(op_type, domain, opset, name)
    if isinstance(value, list):
        return list(value)  # the cache's own list: a caller changing it would change every later answer
    return MISSING if value is _NO_DEFAULT else value


class _Missing:
    def __repr__(self) -> str:
        return "<absent, no schema default>"


MISSING = _Missing()


def validate_node(op_type: str, domain: str, opset: int, n_inputs: int, n_outputs: int, attrs: dict) -> Optional[str]:
    """Why a node with this signature is invalid for the schema, or None if it is fine (or unknown)."""
    if domain not in ("", "ai.onnx"):
        return None  # custom domains (com.microsoft, a CANN lowering) carry no schema here
    schema = get_schema(op_type, "", opset)
    if schema is None:
        return f"{op_type} is not an ONNX operator at opset {opset}"
    if not schema.min_input <= n_inputs <= schema.max_input:
        return f"{op_type} takes {schema.min_input}..{schema.max_input} inputs, got {n_inputs}"
    if not schema.min_output <= n_outputs <= schema.max_output:
        return f"{op_type} has {schema.min_output}..{schema.max_output} outputs, got {n_outputs}"
    for name in attrs:
        if name not in schema.attributes:
            return f"{op_type} (opset {opset}) has no attribute '{name}'"
    for name, spec in schema.attributes.items():
        if spec.required and name not in attrs:
            return f"{op_type} needs attribute '{name}'"
    return None
