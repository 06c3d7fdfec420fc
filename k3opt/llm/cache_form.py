"""Recognise the KV cache of a decode-step export: which inputs are the past, how it grows, where the length is read.

A decode-step export (``k3opt export --use-cache``, optimum, transformers'
own) takes ``past`` tensors ``[B, Hkv, P, D]`` and returns ``present =
Concat(past, new, axis=2)``. The graph reads ``P`` back from the past's shape
(``Shape`` then ``Gather``/``Squeeze`` of dim 2) for two things: the key
length ``P + S`` (mask and reshape sizes) and the token positions
``Range(0, S) + P`` (RoPE or learned position embeddings, and the causal
mask). :func:`recognise` finds all of this, or refuses in one line: a graph
whose past is used any other way cannot be rewritten exactly.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Optional

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import InputError

_PASS_THROUGH = ("Identity",)


@dataclasses.dataclass
class CacheEntry:
    """One cached tensor: the past input, the present output, and the node that grows it."""

    past: str
    present: str
    concat: onnx.NodeProto  # Concat(past alias, new, axis=2): its output is ``present`` or feeds it
    new: str  # the step's new k/v, [B, Hkv, S, D]
    heads: int
    dim: int


@dataclasses.dataclass
class CacheLayout:
    """What :func:`recognise` found in a decode-step graph."""

    ids: str
    mask: str
    entries: list[CacheEntry]
    shape_nodes: list[onnx.NodeProto]  # Shape nodes reading a past tensor
    lengths: list[str]  # values equal to the past length P (Gather/Squeeze of dim 2 of a past shape)
    dtype: int  # the cache's element type

    @property
    def layers(self) -> int:
        return len(self.entries) // 2


def _consumers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    out: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in graph.node:
        for name in node.input:
            out[name].append(node)
    return out


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def constant_value(graph: onnx.GraphProto, name: str, producers: dict[str, onnx.NodeProto]) -> Optional[np.ndarray]:
    """The value of ``name`` when it is an initializer or a Constant node's output, else None."""
    for init in graph.initializer:
        if init.name == name:
            return numpy_helper.to_array(init)
    node = producers.get(name)
    if node is not None and node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
        return numpy_helper.to_array(node.attribute[0].t)
    return None


def _dims(vi: onnx.ValueInfoProto) -> list:
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in vi.type.tensor_type.shape.dim]


def recognise(model: onnx.ModelProto) -> CacheLayout:
    """The cache layout of decode-step ``model``; InputError naming what is missing or unrecognised."""
    graph = model.graph
    names = [i.name for i in graph.input]
    inits = {t.name for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in inits]
    if "input_ids" not in names:
        raise InputError("not a causal LM decode step: no input_ids input")
    mask = next((n for n in ("attention_mask",) if n in names), None)
    if mask is None:
        raise InputError("not a causal LM decode step: no attention_mask input")
    past = [i for i in inputs if i.name not in ("input_ids", "attention_mask")]
    if not past:
        raise InputError("not a decode step with a KV cache: the graph has no past key/value inputs")
    consumers = _consumers(graph)
    producers = {o: n for n in graph.node for o in n.output}
    outputs = {o.name for o in graph.output}
    entries, shape_nodes, lengths = [], [], []
    for vi in past:
        dims = _dims(vi)
        if len(dims) != 4 or not isinstance(dims[1], int) or not isinstance(dims[3], int):
            raise InputError(f"{vi.name}: a cache input must be [batch, kv heads, past, head dim] with static heads "
                             f"and head dim, not {dims}")
        aliases, concat = [vi.name], None
        while aliases:
            alias = aliases.pop()
            for node in consumers[alias]:
                if node.op_type in _PASS_THROUGH or (node.op_type == "Concat" and len(node.input) == 1):
                    aliases.append(node.output[0])
                elif node.op_type == "Shape":
                    shape_nodes.append(node)
                    lengths += _length_values(node, consumers, producers, graph)
                elif (node.op_type == "Concat" and len(node.input) == 2 and node.input[0] == alias
                      and _attr(node, "axis") in (2, -2) and concat is None):
                    concat = node
                else:
                    raise InputError(f"{vi.name}: cache layout not recognised (read by a {node.op_type} node "
                                     f"{node.name!r}; expected Concat(past, new) on axis 2 and Shape)")
        if concat is None:
            raise InputError(f"{vi.name}: cache layout not recognised (no Concat(past, new) on axis 2 grows it)")
        present = _present_of(concat.output[0], consumers, outputs)
        if present is None:
            raise InputError(f"{vi.name}: cache layout not recognised (its Concat is not a graph output)")
        entries.append(CacheEntry(vi.name, present, concat, concat.input[1], dims[1], dims[3]))
    if not lengths:
        raise InputError("cache layout not recognised: the graph never reads the past length from the cache's shape")
    dtype = past[0].type.tensor_type.elem_type
    return CacheLayout("input_ids", mask, entries, shape_nodes, lengths, dtype)


def _present_of(value: str, consumers: dict, outputs: set) -> Optional[str]:
    """The graph output ``value`` is (directly or through Identity nodes)."""
    if value in outputs:
        return value
    for node in consumers[value]:
        if node.op_type == "Identity":
            found = _present_of(node.output[0], consumers, outputs)
            if found:
                return found
    return None


def _length_values(shape: onnx.NodeProto, consumers: dict, producers: dict, graph: onnx.GraphProto) -> list[str]:
    """The values a past-reading Shape node yields that equal the past length (dim 2)."""
    start = _attr(shape, "start", 0)
    end = _attr(shape, "end", None)
    picks = list(range(4))[start:end]
    found = []
    for node in consumers[shape.output[0]]:
        if node.op_type == "Gather" and _attr(node, "axis", 0) == 0:
            index = constant_value(graph, node.input[1], producers)
            if index is not None and index.size == 1 and picks[int(index.reshape(()))] == 2:
                found.append(node.output[0])
        elif node.op_type == "Squeeze" and picks == [2]:
            found.append(node.output[0])
        elif node.op_type == "Slice":
            pass  # a slice of the shape vector: folded once the shapes are static
    return found
