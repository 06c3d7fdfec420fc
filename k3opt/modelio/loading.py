"""Reading a model file (external data left on disk) and importing it as a gs graph."""
from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import NamedTuple, Optional

import onnx
from google.protobuf.message import DecodeError
from onnx import TensorProto
from onnx.external_data_helper import uses_external_data

from .. import graph as gs
from ..errors import InputError
from ..graph import LazyValues
from ..graph import gs_roundtrip
from ..graph.ir import all_graphs, store_values, stored_values
from .external import ExternalValues, PathLike, all_tensors
from .validation import MAX_GRAPH_DEPTH, validate


def import_graph(model: onnx.ModelProto, external: Optional[list[TensorProto]] = None) -> gs.Graph:
    """``gs.import_onnx`` with external weights left on disk until a pass reads them.

    The graph shares TensorProtos with ``model``: import a proto you own.
    ``external``: the model's external-data tensors when known (see
    :class:`Loaded`); when there are none, the walk over every graph that
    looks for them is spared.
    """
    try:
        graph = gs_roundtrip.import_onnx(model)
    except Exception as exc:  # gs raises assorted types on models it cannot represent
        raise InputError(f"the graph cannot be imported ({type(exc).__name__}: {exc})") from exc
    if external is not None and not external:
        return graph
    if external is None and not any(uses_external_data(t) for t in all_tensors(model)):
        return graph  # nothing to make lazy: skip walking every tensor
    for g in all_graphs(graph):
        for t in g.tensors().values():
            _read_lazily(t)
        for node in g.nodes:  # a Constant node's value (an attribute tensor) may keep its data outside too
            for value in node.attrs.values():
                for t in value if isinstance(value, list) else (value,):
                    _read_lazily(t)
    return graph


def _read_lazily(t: object) -> None:
    """Make a gs constant whose TensorProto keeps its data in a file read it through :class:`ExternalValues`
    (the location is absolute inside k3opt, which onnx's own reader refuses)."""
    values = stored_values(t) if isinstance(t, gs.Constant) else None
    if isinstance(values, LazyValues) and uses_external_data(values.tensor):
        store_values(t, ExternalValues(values.tensor))
        # Once a pass loads the values, gs must export them inline (save()
        # moves big ones out again), not as "external" without a location.
        t.data_location = None


class Loaded(NamedTuple):
    """A model read by :func:`read_model`, the tensors in it that use external data, and whether it has bodies."""

    model: onnx.ModelProto
    #: Its external-data tensors (locations made absolute), in :func:`all_tensors` order.
    external: list[TensorProto]
    #: Whether a node of it holds a body (If/Loop/Scan...); True when not known.
    bodies: bool = True


def load(path: PathLike) -> onnx.ModelProto:
    """Read a model file without its external data, checked enough to optimize (see :func:`read_model`)."""
    return read_model(path).model


def read_model(path: PathLike) -> Loaded:
    """Read a model file without its external data, checked enough to optimize.

    Raises InputError (one clear line) for a missing file, a directory, bytes
    that are not a model, a graph with a cycle or an undefined input, and
    missing or short external-data files. The external tensors come with it
    (found by the check's walk) so the caller need not walk the model again.
    """
    p = Path(path)
    if not p.exists():
        raise InputError(f"{p}: no such file")
    if p.is_dir():
        raise InputError(f"{p}: is a directory, not an ONNX model file")
    if p.stat().st_size == 0:
        raise InputError(f"{p}: file is empty")
    if not os.access(p, os.R_OK):
        raise InputError(f"{p}: permission denied")
    try:
        model = _parse(p)
    except (DecodeError, ValueError, RuntimeError, OSError, UnicodeDecodeError) as exc:
        if "MaxDepth" in str(exc):  # upb's nesting limit: ~30 levels of subgraphs
            raise InputError(f"{p}: not a readable ONNX model: it nests deeper than protobuf can parse (k3opt "
                             f"reads subgraphs at most {MAX_GRAPH_DEPTH} levels deep)") from None
        raise InputError(f"{p}: not a readable ONNX model (truncated or corrupt: {exc})") from None
    found = validate(model, p.parent, source=str(p), absolute_ok=False)
    return Loaded(model, found.external, found.bodies)


def _parse(p: Path) -> onnx.ModelProto:
    """``onnx.load(p, load_external_data=False)``, a binary model parsed from the mapped file.

    Read into a bytes object first, the file would take its size in fresh
    memory, which the parse then copies again. Text formats (known by the
    file's extension, as onnx.load knows them) and files that cannot be
    mapped are read by onnx.load. (A file truncated by another process while
    it is parsed would raise SIGBUS instead of a decode error.)
    """
    if onnx.serialization.registry.get_format_from_file_extension(p.suffix) not in (None, "protobuf"):
        return onnx.load(str(p), load_external_data=False)
    with open(p, "rb") as f:
        try:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):  # not mappable (a pipe, some FUSE mounts): read as onnx does
            return onnx.load(f, load_external_data=False)
    with mapped, memoryview(mapped) as data:
        model = onnx.ModelProto()
        decoded = model.ParseFromString(data)
        if decoded is not None and decoded != len(data):  # as onnx's deserializer checks
            raise DecodeError(f"Protobuf decoding consumed too few bytes: {decoded} out of {len(data)}")
    return model
