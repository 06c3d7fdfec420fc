"""Checking that a model is well-formed enough to optimize: one clear error for bad input."""
from __future__ import annotations

import math
import os
from pathlib import Path
from dataclasses import dataclass, field
from typing import AbstractSet, Iterator, Optional

import onnx
from onnx import TensorProto

from ..errors import InputError
from ..graph import dtypes
from . import data_location
from .external import MAY_HOLD_TENSORS, PathLike, external_info
from .spill import is_spill_file


@dataclass
class Validated:
    """What :func:`validate` found, collected by the checks as they go: the tensors that use external data
    (in :func:`all_tensors` order), and whether any node holds a body (If/Loop/Scan...): without one, a
    caller need not look for bodies again."""

    external: list[TensorProto] = field(default_factory=list)
    bodies: bool = False


def validate(model: onnx.ModelProto, base_dir: PathLike, source: str = "model",
             absolute_ok: bool = True) -> Validated:
    """Check the model's structure and make its external-data locations absolute.

    Relative locations are resolved against ``base_dir`` and must name regular
    files inside it (:mod:`k3opt.data_location`); absolute ones are accepted
    only for k3opt spill files, and only when ``absolute_ok`` (a proto built
    in this process; a model read from a file never has them). Subgraphs may
    nest at most :data:`MAX_GRAPH_DEPTH` deep. Returns the tensors that use
    external data, in :func:`all_tensors` order, and whether there are bodies.
    """
    if not model.HasField("graph") or not model.opset_import or not model.graph.output:
        raise InputError(f"{source}: not an ONNX model (no graph, outputs or opset import)")
    found = Validated()
    _check_graph(model.graph, source, frozenset(), found)
    base = Path(os.path.abspath(base_dir))
    for t in found.external:
        spill = absolute_ok and is_spill_file(external_info(t).get("location", ""))
        path = data_location.resolve(t, base, source, absolute_ok=spill)
        for entry in t.external_data:
            if entry.key == "location":
                entry.value = str(path)
    return found


def check_graph(graph: onnx.GraphProto, source: str = "model", outer: frozenset = frozenset()) -> None:
    """Every node input is produced somewhere and the nodes form no cycle."""
    _check_graph(graph, source, outer, Validated())


_EXTERNAL = TensorProto.EXTERNAL
_NodeIO = list[tuple[list[str], list[str], onnx.NodeProto]]
#: How deep subgraphs (If/Loop/Scan bodies) may nest; real models stay within a handful of levels, and
#: protobuf itself cannot parse a model file nested much past 30.
MAX_GRAPH_DEPTH = 16
_TYPES = frozenset(v for v in TensorProto.DataType.values() if v != TensorProto.UNDEFINED)


def _check_graph(graph: onnx.GraphProto, source: str, outer: AbstractSet[str], found: Validated,
                 depth: int = 0) -> None:
    """:func:`check_graph`, collecting into ``found``; ``depth``: how many bodies ``graph`` is nested in.

    One walk in node order suffices for what exporters write (each node after
    the producers of its inputs, each name defined once); anything else takes
    the general check, which finds the same first error as before.
    """
    if depth > MAX_GRAPH_DEPTH:
        raise InputError(f"{source}: subgraphs nested more than {MAX_GRAPH_DEPTH} deep (graph '{graph.name}'); "
                         f"k3opt reads at most {MAX_GRAPH_DEPTH} levels")
    initializers = [t.name for t in graph.initializer]
    unique = set(initializers)
    if len(unique) < len(initializers):
        seen: set[str] = set()
        twice = next(n for n in initializers if n in seen or seen.add(n))
        raise InputError(f"{source}: initializer '{twice}' is defined twice (which one is meant is undefined)")
    _check_text(graph, source)
    inputs = [i.name for i in graph.input]
    if len(set(inputs)) < len(inputs):
        seen = set()
        twice = next(n for n in inputs if n in seen or seen.add(n))
        raise InputError(f"{source}: graph input '{twice}' is listed twice (which declaration holds is undefined)")
    known = set(outer) | set(inputs) | unique
    if graph.sparse_initializer:
        _check_sparse(graph, source)
        known |= {t.values.name for t in graph.sparse_initializer}
    found.external.extend(t for t in graph.initializer if t.data_location == _EXTERNAL)
    ordered = _walk_in_order(graph, known)
    if ordered is None:
        return _check_any_order(graph, source, known, found, depth)
    visible, holders = ordered
    for attr in holders:
        _check_attribute(attr, source, visible, found, depth)
    _check_outputs(graph, source, visible)


def _check_text(graph: onnx.GraphProto, source: str) -> None:
    """Refuse names and symbolic dims that are not UTF-8: protobuf hands such a field over as bytes, or raises
    when it is read, wherever a pass happens to read it."""
    try:
        bad = next(_non_text(graph), None)
    except UnicodeDecodeError as exc:
        bad = exc.object
    if bad is not None:
        raise InputError(f"{source}: a name or symbolic dim is not UTF-8 ({bytes(bad)[:40]!r})")


def _non_text(graph: onnx.GraphProto) -> Iterator[bytes]:
    """The names (and symbolic dims) of ``graph``'s own values and nodes that protobuf hands over as bytes."""
    for vi in (*graph.input, *graph.output, *graph.value_info):
        yield from (t for t in (vi.name, *(d.dim_param for d in vi.type.tensor_type.shape.dim)) if type(t) is not str)
    yield from (t.name for t in graph.initializer if type(t.name) is not str)
    for node in graph.node:
        yield from (t for t in (node.name, node.op_type, node.domain, *node.input[:], *node.output[:])
                    if type(t) is not str)


def _check_sparse(graph: onnx.GraphProto, source: str) -> None:
    """Refuse external data in sparse initializers: k3opt (like onnx's loader) does not read it."""
    for sparse in graph.sparse_initializer:
        if _EXTERNAL in (sparse.values.data_location, sparse.indices.data_location):
            raise InputError(f"{source}: sparse initializer '{sparse.values.name}' keeps its data in an external "
                             f"file, which k3opt does not read")


def _walk_in_order(graph: onnx.GraphProto, known: set) -> Optional[tuple[set, list[onnx.AttributeProto]]]:
    """The names visible in ``graph`` and its attributes that may hold tensors or bodies, if every node
    comes after the producers of its inputs and defines only new names; else None."""
    available = set(known)
    add = available.add
    holders = []
    for node in graph.node:
        for name in node.input[:]:  # a slice: one list from upb, quicker than iterating the field
            if name not in available and name:
                return None
        for name in node.output[:]:
            if name in available and name:
                return None
            add(name)
        for attr in node.attribute:
            if attr.type in MAY_HOLD_TENSORS:
                holders.append(attr)
    return available, holders


def _check_any_order(graph: onnx.GraphProto, source: str, known: set, found: Validated, depth: int) -> None:
    # (inputs, outputs, node) read once: proto field access is the cost on a big graph
    nodes = [(n.input[:], n.output[:], n) for n in graph.node]
    produced: dict[str, onnx.NodeProto] = {}
    for _, outputs, node in nodes:
        for o in outputs:
            if o and (o in produced or o in known):
                raise InputError(f"{source}: tensor '{o}' is defined twice (node '{node.name or node.op_type}')")
            produced[o] = node
    visible = frozenset(known | set(produced))
    for inputs, _, node in nodes:
        for name in inputs:
            if name and name not in visible:
                raise InputError(
                    f"{source}: input '{name}' of node '{node.name or node.op_type}' is produced by nothing"
                )
        for attr in node.attribute:
            if attr.type in MAY_HOLD_TENSORS:
                _check_attribute(attr, source, visible, found, depth)
    _check_outputs(graph, source, visible)
    _check_acyclic(nodes, known, source)


def _check_attribute(attr: onnx.AttributeProto, source: str, visible: AbstractSet[str], found: Validated,
                     depth: int) -> None:
    """Check the attribute's tensors (collecting the external ones) and the bodies it holds (seeing
    ``visible``, one level deeper than ``depth``)."""
    if attr.HasField("t"):
        _check_attribute_tensor(attr.t, source, found.external)
    for t in attr.tensors:
        _check_attribute_tensor(t, source, found.external)
    if attr.HasField("g"):
        found.bodies = True
        _check_graph(attr.g, source, visible, found, depth + 1)
    for sub in attr.graphs:
        found.bodies = True
        _check_graph(sub, source, visible, found, depth + 1)


def _check_attribute_tensor(t: TensorProto, source: str, external: list[TensorProto]) -> None:
    """Collect ``t`` when it uses external data, else refuse raw bytes other than its dims and type take.

    An attribute's tensor (a Constant's value) is read whole by the passes and by onnxruntime: one whose
    dims claim more than its bytes (say 2**62 elements in 4 bytes) is refused here, before anything sizes
    work by it. Initializers are checked when a pass decodes them (k3opt.graph.ir.bad_data): reading every
    weight's bytes at load would cost a pass over all of them.
    """
    if t.data_location == _EXTERNAL:
        external.append(t)
        return
    if t.data_type not in _TYPES:
        raise InputError(f"{source}: tensor '{t.name}' has no known data type ({t.data_type})")
    claimed = data_location.claimed_bytes(t)
    if claimed is None:
        raise InputError(f"{source}: tensor '{t.name}' has a negative dimension {list(t.dims)}")
    if t.HasField("raw_data"):
        held, want = len(t.raw_data), claimed
    elif t.data_type in dtypes.PACKED_BITS:
        return  # packed into int32_data by rules of their own: decoding checks them
    else:
        per = 2 if t.data_type in (TensorProto.COMPLEX64, TensorProto.COMPLEX128) else 1
        held, want = len(getattr(t, onnx.helper.tensor_dtype_to_field(t.data_type))), per * math.prod(t.dims)
    if held != want:
        raise InputError(f"{source}: tensor '{t.name}': its data does not fit its type and shape "
                         f"({held} {'bytes' if t.HasField('raw_data') else 'values'} for {list(t.dims)})")


def _check_outputs(graph: onnx.GraphProto, source: str, visible: AbstractSet[str]) -> None:
    for name in graph.output:
        if name.name not in visible:
            raise InputError(f"{source}: graph output '{name.name}' is produced by nothing")


def _check_acyclic(nodes: _NodeIO, known: set, source: str) -> None:
    pending = {i: sum(1 for x in inputs if x and x not in known) for i, (inputs, _, _) in enumerate(nodes)}
    users: dict[str, list[int]] = {}
    for i, (inputs, _, _) in enumerate(nodes):
        for x in inputs:
            if x and x not in known:
                users.setdefault(x, []).append(i)
    ready = [i for i, c in pending.items() if c == 0]
    done = 0
    while ready:
        i = ready.pop()
        done += 1
        for out in nodes[i][1]:
            for j in users.pop(out, ()):
                pending[j] -= 1
                if pending[j] == 0:
                    ready.append(j)
    if done < len(nodes):
        stuck = next(nodes[i][2] for i, c in pending.items() if c > 0)
        raise InputError(f"{source}: the graph has a cycle (through node '{stuck.name or stuck.op_type}')")
