"""Outputs whose values differ on every run: the ones an unseeded random op (or a training-mode Dropout)
feeds. Verification cannot compare their values, only their types and shapes (issue #26 item 8: a
training-mode Dropout's output made verification blame whichever pass ran first).

A random op with a ``seed`` attribute is deterministic in onnxruntime (each fresh session draws the same
values), so it is compared like any other op; passes never fold or merge random ops either way.
"""
from __future__ import annotations

from typing import Optional

import onnx

#: Ops whose result is not a function of their inputs: never folded, never merged as common subexpressions.
RANDOM_OPS = frozenset(
    {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli"}
)
_DEFAULT_DOMAINS = ("", "ai.onnx")


def random_outputs(model: onnx.ModelProto) -> dict[str, str]:
    """Graph output name -> the unseeded random node it depends on (``"RandomNormalLike 'r'"``), for the
    outputs whose values change from run to run."""
    constants = _constant_values(model.graph)
    tainted: dict[str, str] = {}
    for node in model.graph.node:
        source = _random_source(node, constants, tainted)
        if source is not None:
            for name in node.output:
                if name:
                    tainted[name] = source
    return {o.name: tainted[o.name] for o in model.graph.output if o.name in tainted}


def _random_source(node: onnx.NodeProto, constants: dict[str, onnx.TensorProto], tainted: dict[str, str]
                   ) -> Optional[str]:
    """What makes ``node``'s outputs random: itself, an input, or a random node in a body it holds."""
    if node.domain in _DEFAULT_DOMAINS and _draws_unseeded(node, constants):
        return f"{node.op_type} '{node.name or node.output[0]}'"
    for name in node.input:
        if name in tainted:
            return tainted[name]
    return _in_bodies(node)


def _body_source(graph: onnx.GraphProto) -> Optional[str]:
    """The first unseeded random node in a body (or in a body inside it), else None."""
    constants = _constant_values(graph)
    for node in graph.node:
        if node.domain in _DEFAULT_DOMAINS and _draws_unseeded(node, constants):
            return f"{node.op_type} '{node.name or node.output[0]}'"
        inner = _in_bodies(node)
        if inner is not None:
            return inner
    return None


def _in_bodies(node: onnx.NodeProto) -> Optional[str]:
    """The first unseeded random node in the bodies ``node`` holds, else None."""
    for attr in node.attribute:
        for body in [attr.g] if attr.HasField("g") else list(attr.graphs):
            inner = _body_source(body)
            if inner is not None:
                return inner
    return None


def _draws_unseeded(node: onnx.NodeProto, constants: dict[str, onnx.TensorProto]) -> bool:
    if any(a.name == "seed" for a in node.attribute):
        return False
    if node.op_type in RANDOM_OPS:
        return True
    if node.op_type != "Dropout" or len(node.input) < 3 or not node.input[2]:
        return False  # Dropout before opset 12, or without training_mode: the identity in inference
    ratio = _scalar(constants.get(node.input[1])) if len(node.input) > 1 and node.input[1] else 0.5
    return _scalar(constants.get(node.input[2])) != 0 and ratio != 0


def _scalar(t: Optional[onnx.TensorProto]) -> Optional[float]:
    """A constant's single value (None when not a constant of one element)."""
    if t is None:
        return None
    value = onnx.numpy_helper.to_array(t)
    return float(value.reshape(-1)[0]) if value.size == 1 else None


def _constant_values(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    """Small constants by name (initializers of at most 16 bytes and Constant nodes' tensors): a Dropout's
    ratio and training_mode."""
    found = {t.name: t for t in graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL
             and len(t.raw_data) <= 16 and len(t.dims) <= 1}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].HasField("t"):
            found[node.output[0]] = node.attribute[0].t
    return found
