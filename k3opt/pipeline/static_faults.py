"""Faults of the input that static shapes and constants prove before any pass: nodes onnxruntime would
refuse when it runs them (issue #26 item 8).

onnx's checker and onnxruntime's loader accept these models; only running them fails. Without this check
``--no-verify`` wrote them with exit 0 (and a pass may fold or move the faulty node, hiding the fault).
Each check refuses only what is certain: every dim it reads is a known int, every value a constant.

- any default-domain node with more or fewer inputs or outputs than its op's schema allows (a pass would
  index past them);

- Reshape to a shape whose element count differs from its input's (no ``-1``), that no ``-1`` can fill,
  with two ``-1``, a negative size other than ``-1``, or a ``0`` copying a dim the input lacks;
- Gather with a constant index outside ``[-n, n)`` of the data's ``axis`` (or an axis outside the rank).
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import numpy as np
import onnx

from ..errors import InputError
from ..graph.ir import Graph, Node, const_shape, const_tensor, int_list, peek, rank

#: Constants read to check a node (a shape target, indices) are at most this many elements: a bigger
#: index tensor is left to onnxruntime rather than read whole here.
MAX_ELEMENTS = 1 << 20


def check(graph: Graph, source: str) -> None:
    """Raise InputError naming the first node of ``graph`` (its main graph) that cannot run."""
    for node in graph.nodes:
        if node.domain and node.domain != "ai.onnx":
            continue
        fault = arity_fault(node, graph.opset) or _CHECKS.get(node.op, _none)(node)
        if fault:
            name = node.name or (node.outputs[0].name if node.outputs else "")
            raise InputError(f"{source}: {node.op} node '{name}' cannot run: {fault}")


def arity_fault(node: Node, opset: int) -> Optional[str]:
    """Why ``node`` has more or fewer inputs or outputs than its op takes at ``opset`` (passes index them), or
    None; None too for an op onnx does not know at that opset (onnxruntime says what it makes of it)."""
    schema = _schema(node.op, opset)
    if schema is None:
        return None
    given = len(node.inputs)
    while given and not node.inputs[given - 1].name:  # trailing omitted optional inputs
        given -= 1
    if not schema.min_input <= given <= schema.max_input:
        return f"it has {given} input(s); {node.op}-{schema.since_version} takes {_range(schema.min_input, schema.max_input)}"
    made = len(node.outputs)
    if not schema.min_output <= made <= schema.max_output:
        return (f"it has {made} output(s); {node.op}-{schema.since_version} gives "
                f"{_range(schema.min_output, schema.max_output)}")
    return None


def _range(low: int, high: int) -> str:
    return str(low) if low == high else f"{low} or more" if high > 1 << 20 else f"{low} to {high}"


@functools.lru_cache(maxsize=None)
def _schema(op: str, opset: int) -> Optional[onnx.defs.OpSchema]:
    try:
        return onnx.defs.get_schema(op, opset, "")
    except onnx.defs.SchemaError:
        return None


def _none(node: Node) -> Optional[str]:
    return None


def _small_ints(node: Node, i: int) -> Optional[list[int]]:
    """Input ``i`` of ``node`` as ints when it is a constant of at most MAX_ELEMENTS, else None."""
    c = const_tensor(node.inputs[i]) if len(node.inputs) > i else None
    if c is None or c.shape is None or math.prod(c.shape) > MAX_ELEMENTS:
        return None
    return int_list(node.inputs[i])


def reshape_fault(node: Node) -> Optional[str]:
    """Why this Reshape cannot reshape its (static) input to its (constant) target, or None."""
    target = _small_ints(node, 1)
    dims = const_shape(node.inputs[0])
    if target is None:
        return _concat_target_fault(node)
    if dims is None:
        return None
    if target.count(-1) > 1:
        return f"target shape {target} has more than one -1"
    if any(d < -1 for d in target):
        return f"target shape {target} has a negative size other than -1"
    allowzero = int(node.attrs.get("allowzero", 0))
    if not allowzero and any(d == 0 and i >= len(dims) for i, d in enumerate(target)):
        return f"target shape {target} copies (0) a dim of input {list(dims)}, which has only {len(dims)}"
    sizes = [dims[i] if d == 0 and not allowzero else d for i, d in enumerate(target)]
    count, known = math.prod(dims), math.prod(d for d in sizes if d != -1)
    if -1 not in sizes and known != count:
        return f"input {list(dims)} has {count} elements, target shape {target} takes {known}"
    if -1 in sizes and known and count % known:
        return f"input {list(dims)} has {count} elements, not a multiple of the {known} of target shape {target}"
    return None


def _concat_target_fault(node: Node) -> Optional[str]:
    """A target concatenated from pieces (``Concat([Unsqueeze(batch)], [2, -9])``): a constant piece's element
    below -1, or constant sizes whose product no tensor can have, make it invalid whatever the other pieces."""
    p = node.inputs[1].inputs[0] if len(node.inputs) > 1 and node.inputs[1].inputs else None
    if p is None or p.op != "Concat":
        return None
    known = [d for x in range(len(p.inputs)) for d in (_small_ints(p, x) or [])]
    if any(d < -1 for d in known):
        return f"its target's constant sizes {known} hold a negative size other than -1"
    if math.prod(d for d in known if d > 0) >= 1 << 63:
        return f"its target's constant sizes {known} multiply past 2^63 elements"
    return None


def gather_fault(node: Node) -> Optional[str]:
    """Why this Gather's constant indices fall outside its data's (static) axis, or None."""
    data = node.inputs[0]
    r = rank(data)
    if r is None or r == 0:
        return None
    axis = int(node.attrs.get("axis", 0))
    if not -r <= axis < r:
        return f"axis {axis} is outside the rank {r} of its data"
    size = data.shape[axis]
    if not isinstance(size, (int, np.integer)) or size < 0:
        return None
    c = const_tensor(node.inputs[1]) if len(node.inputs) > 1 else None
    if c is None or c.shape is None or math.prod(c.shape) > MAX_ELEMENTS:
        return None
    indices = np.asarray(peek(c))
    if indices.size == 0 or not np.issubdtype(indices.dtype, np.integer):
        return None
    low, high = int(indices.min()), int(indices.max())
    bad = high if high >= size else low if low < -size else None
    if bad is None:
        return None
    return f"index {bad} is out of range for axis {axis} of size {size} (valid: {-size} to {size - 1})"


_CHECKS: dict[str, Callable[[Node], Optional[str]]] = {"Reshape": reshape_fault, "Gather": gather_fault}
