"""Opset 18 -> 17 where onnx's converter cannot go exactly: rewrites, or one-line refusals.

onnx has no Pad 18 -> 17 adapter (Pad-18's optional ``axes`` input) and none for Split's
``num_outputs``; its Reduce adapters fail on ``noop_with_empty_axes``, and its Resize and Scatter
adapters stop with an assertion text on what opset 17 cannot express. Before the converter runs, each
such node is rewritten into a form that computes the same and is valid at both opsets (onnx's adapters,
or none, then finish), or the conversion stops naming the node and what opset 17 lacks.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import onnx

from .opset_nodes import ModelScope, all_graphs

_DEFAULT_DOMAINS = ("", "ai.onnx")
#: The Reduce ops whose axes became an input at opset 18 (ReduceSum did at 13).
REDUCE_18 = ("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin",
             "ReduceProd", "ReduceSumSquare")


class NoOpset17Form(Exception):
    """A node that opset 17 cannot express (the message names it and says why)."""


def rewrite_for_17(model: onnx.ModelProto, scope: ModelScope) -> None:
    """Rewrite, in place, the opset-18 nodes of ``model`` (subgraphs included) that onnx's converter
    cannot take to 17 into equal forms it can; :class:`NoOpset17Form` for one opset 17 cannot express."""
    for graph in all_graphs(model.graph):
        for node in graph.node:
            if node.domain in _DEFAULT_DOMAINS:
                rule = _RULES.get(node.op_type) or (_reduce if node.op_type in REDUCE_18 else None)
                if rule is not None:
                    rule(node, graph, scope)


def _label(node: onnx.NodeProto) -> str:
    return f"op {node.op_type}" + (f" (node '{node.name}')" if node.name else "")


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _drop_attr(node: onnx.NodeProto, name: str) -> None:
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(kept)


def _constant(scope: ModelScope, node: onnx.NodeProto, index: int, what: str) -> np.ndarray:
    t = scope.constant(node.input[index])
    if t is None:
        raise NoOpset17Form(f"{_label(node)}: its '{what}' input is computed, not a constant, and its opset-17 "
                            f"form needs the value")
    scope.read.add(node.input[index])  # dropped after the conversion if nothing reads it any more
    return onnx.numpy_helper.to_array(t)


def _rank(scope: ModelScope, node: onnx.NodeProto) -> Optional[int]:
    if scope.rank(node.input[0]) is None:
        scope.infer_types()
    return scope.rank(node.input[0])


def _new_constant(graph: onnx.GraphProto, scope: ModelScope, values: np.ndarray, name: str) -> str:
    name = scope.fresh(name)
    graph.initializer.append(onnx.numpy_helper.from_array(values, name))
    return name


def _pad(node: onnx.NodeProto, graph: onnx.GraphProto, scope: ModelScope) -> None:
    """Pad-18 with constant ``axes``: Pad-13's pads for every axis, zero on the axes not listed."""
    if len(node.input) < 4 or not node.input[3]:
        del node.input[3:]  # no axes: already a Pad-13
        return
    axes, pads = _constant(scope, node, 3, "axes"), _constant(scope, node, 1, "pads")
    rank = _rank(scope, node)
    if rank is None:
        raise NoOpset17Form(f"{_label(node)}: the rank of its input is unknown, and opset 17 needs pads for every axis")
    full = np.zeros(2 * rank, np.int64)
    for k, axis in enumerate(axes.tolist()):
        full[axis % rank] = pads[k]
        full[axis % rank + rank] = pads[k + len(axes)]
    node.input[1] = _new_constant(graph, scope, full, node.input[1] + "_all_axes")
    del node.input[3:]
    if not node.input[2]:
        del node.input[2:]


def _split(node: onnx.NodeProto, graph: onnx.GraphProto, scope: ModelScope) -> None:
    """Split-18 with ``num_outputs``: Split-13 with the sizes it means (equal, the last one smaller)."""
    count = _attr(node, "num_outputs")
    if count is None:
        return
    axis = _attr(node, "axis", 0)
    dim = _static_dim(scope, node, axis)
    if dim is None:
        raise NoOpset17Form(f"{_label(node)}: num_outputs={count} needs the size of axis {axis}, which is not "
                            f"fixed here, to give opset 17 the split sizes")
    size = -(-dim // count)
    sizes = [size] * (dim // size) + ([dim % size] if dim % size else [])
    if len(sizes) != count:
        raise NoOpset17Form(f"{_label(node)}: axis {axis} of size {dim} does not split into {count} outputs")
    node.input.append(_new_constant(graph, scope, np.array(sizes, np.int64), f"{node.output[0]}_split_sizes"))
    _drop_attr(node, "num_outputs")


def _static_dim(scope: ModelScope, node: onnx.NodeProto, axis: int) -> Optional[int]:
    rank = _rank(scope, node)
    if rank is None:
        return None
    dim = scope.types[node.input[0]].tensor_type.shape.dim[axis % rank]
    return dim.dim_value if dim.HasField("dim_value") else None


def _reduce(node: onnx.NodeProto, graph: onnx.GraphProto, scope: ModelScope) -> None:
    """``noop_with_empty_axes=1`` means nothing with constant, non-empty axes: dropped. With no axes the
    op returns its input, which Reduce-17 (no axes: all axes) cannot say."""
    if not _attr(node, "noop_with_empty_axes", 0):
        return
    has_axes = len(node.input) > 1 and node.input[1]
    if has_axes and scope.constant(node.input[1]) is None:
        return  # computed axes: the conversion names them
    if not has_axes or _constant(scope, node, 1, "axes").size == 0:
        raise NoOpset17Form(f"{_label(node)}: noop_with_empty_axes=1 without axes has no opset-17 form")
    _drop_attr(node, "noop_with_empty_axes")


def _resize(node: onnx.NodeProto, graph: onnx.GraphProto, scope: ModelScope) -> None:
    for name, default in (("antialias", 0), ("axes", None), ("keep_aspect_ratio_policy", "stretch")):
        value = _attr(node, name, default)
        if isinstance(value, bytes):
            value = value.decode()
        if value != default:
            raise NoOpset17Form(f"{_label(node)}: {name}={value} exists from opset 18 on")


def _scatter(node: onnx.NodeProto, graph: onnx.GraphProto, scope: ModelScope) -> None:
    reduction = _attr(node, "reduction", b"none").decode()
    if reduction in ("max", "min"):
        raise NoOpset17Form(f"{_label(node)}: reduction='{reduction}' exists from opset 18 on")


def _lp_pool(node: onnx.NodeProto, graph: onnx.GraphProto, scope: ModelScope) -> None:
    if _attr(node, "ceil_mode", 0):
        raise NoOpset17Form(f"{_label(node)}: ceil_mode=1 exists from opset 18 on")


_RULES: dict[str, Callable[[onnx.NodeProto, onnx.GraphProto, ModelScope], None]] = {
    "Pad": _pad, "Split": _split, "Resize": _resize, "ScatterND": _scatter, "ScatterElements": _scatter,
    "LpPool": _lp_pool,
}
