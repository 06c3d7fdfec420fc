"""Reading and writing models without loading their weights.

Inside k3opt every external-data ``location`` is an ABSOLUTE path (see
docs/design.md, "External data"): :func:`load` resolves the locations of a
model file against its folder, so a model proto can travel through the
pipeline (and through temporary spill files) without a base directory.
:class:`ExternalValues` reads such a tensor lazily for gs, :func:`save`
streams it into the output's data file chunk by chunk.
"""
from __future__ import annotations

import atexit
import math
import mmap
import os
import tempfile
from pathlib import Path
from typing import AbstractSet, BinaryIO, Callable, Iterator, NamedTuple, Optional, Union

import numpy as np
import onnx
from . import graph as gs
from google.protobuf.message import DecodeError, EncodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet
from onnx import TensorProto
from onnx.external_data_helper import uses_external_data
from .graph import LazyValues

from . import data_location
from .graph import gs_roundtrip
from .direct_io import DirectWriter, direct_writer_or_file
from .errors import InputError, OutputError
from .graph.wire import varint
from .graph.ir import all_graphs

PathLike = Union[str, os.PathLike]

#: Protobuf refuses messages of 2 GiB; stay clear of it.
PROTO_LIMIT = 2**31 - 64 * 2**20
#: Tensors at least this big go to the data file when saving with external data.
EXTERNAL_THRESHOLD = 1024
#: Data files at least this big are written around the page cache (k3opt/direct_io.py).
DIRECT_THRESHOLD = 512 * 2**20
_CHUNK = 16 * 2**20
#: Prefix of the spill files k3opt writes to keep merged weights out of memory.
SPILL_PREFIX = "k3opt-spill-"


# --------------------------------------------------------------------------- tensors


_A = onnx.AttributeProto
#: Attribute types that may hold tensors or subgraphs (UNDEFINED: a sloppy writer may have left it unset).
_MAY_HOLD_TENSORS = frozenset((_A.UNDEFINED, _A.TENSOR, _A.TENSORS, _A.GRAPH, _A.GRAPHS))


def all_tensors(model: onnx.ModelProto) -> Iterator[TensorProto]:
    """Every TensorProto of the model: initializers and tensor attributes, subgraphs included."""
    def graph_tensors(g: onnx.GraphProto) -> Iterator[TensorProto]:
        yield from g.initializer
        for node in g.node:
            for attr in node.attribute:
                if attr.type not in _MAY_HOLD_TENSORS:  # one field read for the common int/float/ints attrs
                    continue
                if attr.HasField("t"):
                    yield attr.t
                yield from attr.tensors
                if attr.HasField("g"):
                    yield from graph_tensors(attr.g)
                for sub in attr.graphs:
                    yield from graph_tensors(sub)

    yield from graph_tensors(model.graph)


def external_info(t: TensorProto) -> dict[str, str]:
    """The tensor's external_data entries as a dict (location, offset, length...)."""
    return {e.key: e.value for e in t.external_data}


def _set_external(t: TensorProto, location: str, offset: int, length: int) -> None:
    del t.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    t.data_location = TensorProto.EXTERNAL


def external_tensor(name: str, data_type: int, dims, location: str, offset: int, length: int) -> TensorProto:
    """A TensorProto whose data is ``length`` bytes at ``offset`` of file ``location``."""
    t = TensorProto(name=name, data_type=data_type, dims=[int(d) for d in dims])
    _set_external(t, location, offset, length)
    return t


def tensor_nbytes(t: TensorProto) -> int:
    """Bytes of the tensor's data as stored in raw/external form."""
    info = external_info(t)
    if "length" in info:
        return int(info["length"])
    if t.HasField("raw_data"):
        return len(t.raw_data)
    if t.data_type == TensorProto.STRING:
        return sum(len(s) for s in t.string_data)
    return data_location.claimed_bytes(t) or 0


def _external_span(t: TensorProto) -> tuple[str, int, int]:
    info = external_info(t)
    return info["location"], int(info.get("offset", 0)), tensor_nbytes(t)


def read_external_bytes(t: TensorProto, start: int = 0, length: Optional[int] = None) -> bytes:
    """The raw bytes of a tensor whose (absolute) location k3opt resolved (``length`` bytes from ``start``)."""
    location, offset, size = _external_span(t)
    length = size - start if length is None else length
    materialize(location, offset)
    with open(location, "rb") as f:
        f.seek(offset + start)
        data = f.read(length)
    if len(data) != length:
        raise InputError(f"external data file {location} is too short for tensor '{t.name}'")
    return data


#: Spill-file regions reserved but not written yet: (path, offset) -> a writer of their bytes at a
#: file's current position. :func:`save` has the writer produce them straight into the output's data
#: file (no spill write and copy back); any reader of the region writes them into the spill file first.
_PENDING: dict[tuple[str, int], Callable[[BinaryIO], None]] = {}


def defer_spill(location: str, offset: int, writer: Callable[[BinaryIO], None]) -> None:
    """Register the bytes of spill-file region ``(location, offset)`` as written on demand by ``writer``."""
    _PENDING[(location, offset)] = writer


def materialize(location: str, offset: int) -> None:
    """Write a deferred spill region into its spill file (no-op for any other region)."""
    writer = _PENDING.pop((location, offset), None)
    if writer is not None:
        with open(location, "r+b") as f:
            f.seek(offset)
            writer(f)


def materialize_all() -> None:
    """Write every deferred spill region: protos that leave k3opt must point at real bytes."""
    for key in list(_PENDING):
        materialize(*key)


def deferred_regions() -> set[tuple[str, int]]:
    """The deferred spill regions now registered, as (path, offset)."""
    return set(_PENDING)


def forget_deferred(regions: set[tuple[str, int]]) -> None:
    """Drop deferred regions no proto refers to any more (their bytes are saved), releasing their sources."""
    for key in regions:
        _PENDING.pop(key, None)


def inline_copy(t: TensorProto) -> TensorProto:
    """A copy of ``t`` with its external data read into ``raw_data``."""
    out = TensorProto()
    out.CopyFrom(t)
    if uses_external_data(t):
        out.raw_data = read_external_bytes(t)
        del out.external_data[:]
        out.ClearField("data_location")
    return out


def weights_as_inputs(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, TensorProto]]:
    """A copy of ``model`` whose big or external initializers are typed graph inputs instead.

    onnx's shape inference and version converter only need their types;
    given the data they would read or materialize it. Small initializers
    stay, with any external data read in. Returns the copy and the original
    initializers taken out, by name.
    """
    big = {t.name: t for t in model.graph.initializer
           if t.data_type != TensorProto.STRING and tensor_nbytes(t) >= EXTERNAL_THRESHOLD}
    light = onnx.ModelProto()
    light.CopyFrom(model)
    g = light.graph
    declared = {vi.name for vi in g.input}
    # small ones (shape constants, axes...) stay, inlined: onnx cannot read external data
    small = [inline_copy(t) for t in g.initializer if t.name not in big]
    del g.initializer[:]
    g.initializer.extend(small)
    g.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                   for t in big.values() if t.name not in declared)
    return light, big


class ExternalValues(LazyValues):
    """gs lazy values for a tensor in an external file with an absolute location.

    onnx itself refuses absolute locations; this reads just this tensor's
    bytes when a pass asks for ``.values``.
    """

    def load(self) -> np.ndarray:
        return np.array(onnx.numpy_helper.to_array(inline_copy(self.tensor)))


def import_graph(model: onnx.ModelProto, external: Optional[list[TensorProto]] = None) -> gs.Graph:
    """``gs.import_onnx`` with external weights left on disk until a pass reads them.

    The graph shares TensorProtos with ``model``: import a proto you own.
    ``external``: the model's external-data tensors when known (see
    :class:`Loaded`); when there are none, the walk over every graph that
    looks for them is spared (14 ms on the 64-layer Llama).
    """
    try:
        graph = gs_roundtrip.import_onnx(model)
    except Exception as exc:  # gs raises assorted types on models it cannot represent
        raise InputError(f"the graph cannot be imported ({type(exc).__name__}: {exc})") from exc
    if external is not None and not external:
        return graph
    graphs = list(all_graphs(graph))
    if len(graphs) == 1 and not any(uses_external_data(t) for t in model.graph.initializer):
        return graph  # nothing to make lazy: skip walking every tensor
    for g in graphs:
        for t in g.tensors().values():
            if isinstance(t, gs.Constant) and isinstance(t._values, LazyValues):
                if uses_external_data(t._values.tensor):
                    t._values = ExternalValues(t._values.tensor)
                    # Once a pass loads the values, gs must export them inline (save()
                    # moves big ones out again), not as "external" without a location.
                    t.data_location = None
    return graph


_SPILL: dict[str, object] = {}


def spill_constant(name: str, values: np.ndarray) -> gs.Constant:
    """A gs Constant whose data is written to this process's spill file instead of memory.

    Passes that create big weights (e.g. merged sibling MatMuls) use this so
    memory stays flat; :func:`save` copies the bytes into the output's data
    file, and the spill file is removed when the process exits.
    """
    arr = np.ascontiguousarray(values)
    if "file" not in _SPILL:
        fd, path = tempfile.mkstemp(prefix=SPILL_PREFIX, suffix=".data")
        _SPILL["file"] = os.fdopen(fd, "r+b")
        _SPILL["path"] = path
        atexit.register(_remove_spill)
    f = _SPILL["file"]
    f.seek(0, os.SEEK_END)
    offset = f.tell()
    f.write(arr.tobytes())
    f.flush()
    dtype = onnx.helper.np_dtype_to_tensor_dtype(arr.dtype)
    tensor = external_tensor(name, dtype, arr.shape, str(_SPILL["path"]), offset, arr.nbytes)
    return gs.Constant(name, ExternalValues(tensor))


def _remove_spill() -> None:
    f = _SPILL.pop("file", None)
    if f is not None:
        f.close()
        Path(str(_SPILL.pop("path"))).unlink(missing_ok=True)


def _is_spill_file(location: str) -> bool:
    p = Path(location)
    return p.name.startswith(SPILL_PREFIX) and p.parent == Path(tempfile.gettempdir())


# --------------------------------------------------------------------------- loading


class Loaded(NamedTuple):
    """A model read by :func:`read_model` and the tensors in it that use external data."""

    model: onnx.ModelProto
    #: Its external-data tensors (locations made absolute), in :func:`all_tensors` order.
    external: list[TensorProto]


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
    return Loaded(model, validate(model, p.parent, source=str(p), absolute_ok=False))


def _parse(p: Path) -> onnx.ModelProto:
    """``onnx.load(p, load_external_data=False)``, a binary model parsed from the mapped file.

    Read into a bytes object first, the file took 40 MB of fresh memory on the
    64-layer Llama, which the parse then copies again (22k page faults, ~95 ms
    in a fresh process; mapped: 12.6k, ~63 ms). Text formats (known by the
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


def validate(model: onnx.ModelProto, base_dir: PathLike, source: str = "model",
             absolute_ok: bool = True) -> list[TensorProto]:
    """Check the model's structure and make its external-data locations absolute.

    Relative locations are resolved against ``base_dir`` and must name regular
    files inside it (:mod:`k3opt.data_location`); absolute ones are accepted
    only for k3opt spill files, and only when ``absolute_ok`` (a proto built
    in this process; a model read from a file never has them). Subgraphs may
    nest at most :data:`MAX_GRAPH_DEPTH` deep. Returns the tensors that use
    external data, in :func:`all_tensors` order.
    """
    if not model.HasField("graph") or not model.opset_import or not model.graph.output:
        raise InputError(f"{source}: not an ONNX model (no graph, outputs or opset import)")
    external: list[TensorProto] = []
    _check_graph(model.graph, source, frozenset(), external)
    base = Path(os.path.abspath(base_dir))
    for t in external:
        spill = absolute_ok and _is_spill_file(external_info(t).get("location", ""))
        path = data_location.resolve(t, base, source, absolute_ok=spill)
        for entry in t.external_data:
            if entry.key == "location":
                entry.value = str(path)
    return external


def check_graph(graph: onnx.GraphProto, source: str = "model", outer: frozenset = frozenset()) -> None:
    """Every node input is produced somewhere and the nodes form no cycle."""
    _check_graph(graph, source, outer, [])


_EXTERNAL = TensorProto.EXTERNAL
_NodeIO = list[tuple[list[str], list[str], onnx.NodeProto]]
#: How deep subgraphs (If/Loop/Scan bodies) may nest; real models stay within a handful of levels, and
#: protobuf itself cannot parse a model file nested much past 30.
MAX_GRAPH_DEPTH = 16
_TYPES = frozenset(v for v in TensorProto.DataType.values() if v != TensorProto.UNDEFINED)


def _check_graph(graph: onnx.GraphProto, source: str, outer: AbstractSet[str], external: list[TensorProto],
                 depth: int = 0) -> None:
    """:func:`check_graph`, appending the tensors that use external data to ``external``; ``depth``: how
    many bodies ``graph`` is nested in.

    One walk in node order suffices for what exporters write (each node after
    the producers of its inputs, each name defined once); anything else takes
    the general check, which finds the same first error as before.
    """
    if depth > MAX_GRAPH_DEPTH:
        raise InputError(f"{source}: subgraphs nested more than {MAX_GRAPH_DEPTH} deep (graph '{graph.name}'); "
                         f"k3opt reads at most {MAX_GRAPH_DEPTH} levels")
    known = set(outer) | {i.name for i in graph.input} | {t.name for t in graph.initializer}
    if graph.sparse_initializer:
        _check_sparse(graph, source)
        known |= {t.values.name for t in graph.sparse_initializer}
    external.extend(t for t in graph.initializer if t.data_location == _EXTERNAL)
    ordered = _walk_in_order(graph, known)
    if ordered is None:
        return _check_any_order(graph, source, known, external, depth)
    visible, holders = ordered
    for attr in holders:
        _check_attribute(attr, source, visible, external, depth)
    _check_outputs(graph, source, visible)


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
            if attr.type in _MAY_HOLD_TENSORS:
                holders.append(attr)
    return available, holders


def _check_any_order(graph: onnx.GraphProto, source: str, known: set, external: list[TensorProto],
                     depth: int) -> None:
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
            if attr.type in _MAY_HOLD_TENSORS:
                _check_attribute(attr, source, visible, external, depth)
    _check_outputs(graph, source, visible)
    _check_acyclic(nodes, known, source)


def _check_attribute(attr: onnx.AttributeProto, source: str, visible: AbstractSet[str],
                     external: list[TensorProto], depth: int) -> None:
    """Check the attribute's tensors (collecting the external ones) and the bodies it holds (seeing
    ``visible``, one level deeper than ``depth``)."""
    if attr.HasField("t"):
        _check_attribute_tensor(attr.t, source, external)
    for t in attr.tensors:
        _check_attribute_tensor(t, source, external)
    if attr.HasField("g"):
        _check_graph(attr.g, source, visible, external, depth + 1)
    for sub in attr.graphs:
        _check_graph(sub, source, visible, external, depth + 1)


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
    elif t.data_type in data_location.PACKED_BITS:
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


# --------------------------------------------------------------------------- saving


def check_output_path(dst: PathLike, src: Optional[PathLike] = None, overwrite: bool = False) -> Path:
    """Refuse an output that is the input (unless ``overwrite``) or in an unwritable folder."""
    out = Path(dst)
    if src is not None and Path(src).exists() and not overwrite:
        if os.path.abspath(src) == os.path.abspath(out) or (out.exists() and out.samefile(src)):
            raise OutputError(f"{out}: output is the input model; pass --overwrite to replace it")
    if out.is_dir():
        raise OutputError(f"{out}: is a directory")
    folder = out.parent if str(out.parent) else Path(".")
    if not folder.is_dir():
        raise OutputError(f"{out}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise OutputError(f"{out}: folder {folder} is not writable")
    return out


def data_path(dst: PathLike) -> Path:
    """Where the external data of output ``dst`` goes: ``DST.data`` next to it."""
    return Path(str(dst) + ".data")


def proto_size(model: onnx.ModelProto, serialized: Optional[int] = None,
               external: Optional[list[TensorProto]] = None) -> int:
    """Bytes the model would take inline: proto plus external data.

    ``serialized``: the proto's own size when already known (the size of the
    file it was read from), which saves a pass over the proto; ``external``:
    its external-data tensors when known (:class:`Loaded`), which saves a walk.
    """
    size = inline_size(model) if serialized is None else serialized
    if external is None:
        external = [t for t in all_tensors(model) if uses_external_data(t)]
    return size + sum(tensor_nbytes(t) for t in external)


def save(model: onnx.ModelProto, dst: PathLike, *, external_data: Optional[bool] = None,
         fsync: bool = False) -> list[Path]:
    """Write ``model`` to ``dst`` atomically; returns the files written.

    External data is used when asked, when the model already keeps weights
    outside the proto, or when the proto would pass the 2 GB limit; it goes
    to ``DST.data``. Weights in source files are streamed, never loaded at
    once. ``model``'s tensors are rewritten to point at the new file.
    Atomic means temporary files and a rename: a failing or interrupted
    run never leaves a partial output. ``fsync`` also makes the files and
    the renames durable against a power loss, at the cost of writing out
    what is still in the page cache (data files of DIRECT_THRESHOLD or more
    bypass it anyway); off by default, as in onnx.save and every peer.
    """
    out = Path(dst)
    has_external = any(uses_external_data(t) for t in all_tensors(model))
    serialized = None  # the inline model's pieces, when sizing it already produced them
    if external_data is None and has_external:
        external_data = True
    if not external_data:
        if has_external:
            too_big = proto_size(model) > PROTO_LIMIT
        else:
            serialized = _serialized_within_limit(model)
            too_big = serialized is None
        if too_big and external_data is None:
            external_data = True
        elif too_big:
            raise OutputError(f"{out}: model exceeds 2 GB; it must be saved with external data")
    temps: list[Path] = []
    try:
        if external_data:
            data_tmp = _temp_in(out.parent, data_path(out).name)
            temps.append(data_tmp)
            direct = sum(size for _, size in _external_candidates(model)) >= DIRECT_THRESHOLD
            with direct_writer_or_file(data_tmp, direct) as f:
                _write_external(model, f, data_path(out).name)
                if fsync:
                    _sync(f)
        else:
            for t in all_tensors(model):
                if uses_external_data(t):
                    t.CopyFrom(inline_copy(t))
        model_tmp = _temp_in(out.parent, out.name)
        temps.append(model_tmp)
        with open(model_tmp, "wb") as f:
            _write_serialized(serialized or _serialized(model), f)
            if fsync:
                _sync(f)
        written = [out]
        if external_data:
            os.replace(temps[0], data_path(out))
            written.append(data_path(out))
        os.replace(model_tmp, out)
        if fsync:
            _sync_folder(out.parent)
        return written
    except OSError as exc:
        raise OutputError(f"{out}: cannot write ({exc.strerror or exc})") from None
    finally:
        for tmp in temps:
            tmp.unlink(missing_ok=True)


# Serializing a whole model at once (upb) encodes it into a buffer that doubles as it grows, then copies
# it out: on a 40 MB model that touched ~140 MB of fresh memory. The model is written, and sized, a piece
# at a time instead: its fields before and after the graph, the graph's before and after its initializers,
# and each initializer on its own. Protobuf writes known fields in field-number order, so the pieces join
# into the very same bytes; a model or graph with unknown fields (written after the known ones) is
# serialized whole.

_GRAPH = onnx.ModelProto.DESCRIPTOR.fields_by_name["graph"].number
_INITIALIZER = onnx.GraphProto.DESCRIPTOR.fields_by_name["initializer"].number


def inline_size(model: onnx.ModelProto) -> int:
    """``model.ByteSize()`` (its bytes when written inline), sized a piece at a time; more than
    :data:`PROTO_LIMIT` when protobuf cannot encode it."""
    try:
        return _serialized(model).size
    except EncodeError:
        return PROTO_LIMIT + 1


class _Serialized(NamedTuple):
    """A model's bytes in order: bytes, and initializers (TensorProtos) serialized when written."""

    parts: list[Union[bytes, TensorProto]]
    size: int


def _serialized(model: onnx.ModelProto) -> _Serialized:
    """``model.SerializeToString()`` in parts (see above); raises EncodeError where protobuf would."""
    if not model.HasField("graph") or _unknown(model) or _unknown(model.graph):
        data = model.SerializeToString()
        return _Serialized([data], len(data))
    head, tail = _split(model, _GRAPH)
    graph_head, graph_tail = _split(model.graph, _INITIALIZER)
    parts: list[Union[bytes, TensorProto]] = [graph_head]
    size = len(graph_head) + len(graph_tail)
    tag = _tag(_INITIALIZER)
    for t in model.graph.initializer:
        n = t.ByteSize()
        key = tag + varint(n)
        parts += (key, t)
        size += len(key) + n
    parts.append(graph_tail)
    key = _tag(_GRAPH) + varint(size)
    return _Serialized([head, key] + parts + [tail], len(head) + len(key) + size + len(tail))


def _serialized_within_limit(model: onnx.ModelProto) -> Optional[_Serialized]:
    """``model``'s pieces, or None when its bytes would pass :data:`PROTO_LIMIT` (protobuf refuses 2 GiB)."""
    try:
        serialized = _serialized(model)
    except EncodeError:  # upb cannot encode it at all
        return None
    return serialized if serialized.size <= PROTO_LIMIT else None


def _write_serialized(serialized: _Serialized, f: BinaryIO) -> None:
    for part in serialized.parts:
        f.write(part if isinstance(part, bytes) else part.SerializeToString())


def _unknown(message) -> bool:
    return len(UnknownFieldSet(message)) > 0


def _split(message, number: int) -> tuple[bytes, bytes]:
    """The serialized fields of ``message`` numbered below ``number``, and those above it."""
    below, above = type(message)(), type(message)()
    for fd, value in message.ListFields():
        if fd.number == number:
            continue
        part = below if fd.number < number else above
        if isinstance(value, Message):
            getattr(part, fd.name).CopyFrom(value)
        elif isinstance(value, (int, float, str, bytes)):
            setattr(part, fd.name, value)
        else:  # a repeated field
            getattr(part, fd.name).extend(value)
    return below.SerializeToString(), above.SerializeToString()


def _tag(number: int) -> bytes:
    """The key of length-delimited field ``number``."""
    return varint(number << 3 | 2)


def _temp_in(folder: Path, name: str) -> Path:
    """An empty temporary file next to the target, with the permissions a new file would get."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder if str(folder) else ".")
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_umask())
    return Path(tmp)


def _sync_folder(folder: Path) -> None:
    """Make the renames durable (a crash right after save keeps the new files)."""
    fd = os.open(folder if str(folder) else ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _sync(f) -> None:
    f.flush()
    os.fsync(f.fileno())


def _write_external(model: onnx.ModelProto, f, location: str) -> None:
    """Move every big tensor's bytes into ``f`` (streamed from source files) and repoint it."""
    for t, size in _external_candidates(model):
        if size >= 2**20:
            f.write(b"\0" * (-f.tell() % 4096))  # page-aligned big weights can be mmapped
        offset = f.tell()
        if uses_external_data(t):
            src, src_offset, length = _external_span(t)
            writer = _PENDING.get((src, src_offset))
            if writer is not None:  # a deferred spill region: its bytes go straight here
                writer(f)
            else:
                with open(src, "rb") as data:
                    _copy_exact(data, src_offset, f, length, src)
            if f.tell() != offset + length:
                raise OutputError(f"tensor '{t.name}': wrote {f.tell() - offset} bytes, expected {length}")
        else:
            f.write(_raw_bytes(t))
            for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
                t.ClearField(field)
        _set_external(t, location, offset, size)


def _external_candidates(model: onnx.ModelProto) -> Iterator[tuple[TensorProto, int]]:
    """The tensors an external-data save moves to the data file, with their sizes."""
    for t in all_tensors(model):
        if t.data_type == TensorProto.STRING:
            continue
        size = tensor_nbytes(t)
        if size >= EXTERNAL_THRESHOLD or uses_external_data(t):
            yield t, size


def _raw_bytes(t: TensorProto) -> bytes:
    if t.HasField("raw_data"):
        return t.raw_data
    return onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t)).raw_data


def _copy_exact(src, offset: int, dst, length: int, name: str) -> None:
    """Copy ``length`` bytes at ``offset`` of ``src`` to ``dst``'s position, in the kernel where it can."""
    if isinstance(dst, DirectWriter):
        if dst.copy_from(src, offset, length) < length:
            raise InputError(f"external-data file {name} ended early")
        return
    dst.flush()
    start = dst.tell()
    done = 0
    try:
        while done < length:
            n = os.copy_file_range(src.fileno(), dst.fileno(), length - done, offset + done, start + done)
            if n == 0:
                raise InputError(f"external-data file {name} ended early")
            done += n
    except (AttributeError, OSError):  # no copy_file_range here (or not between these files): plain copy
        pass
    dst.seek(start + done)
    src.seek(offset + done)
    remaining = length - done
    while remaining:
        chunk = src.read(min(_CHUNK, remaining))
        if not chunk:
            raise InputError(f"external-data file {name} ended early")
        dst.write(chunk)
        remaining -= len(chunk)

