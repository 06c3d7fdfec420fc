"""Atomic save: external data streamed chunk by chunk, protobuf split around the 2 GiB limit."""
from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, NamedTuple, Optional, Union

import onnx
from google.protobuf.message import EncodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet
from onnx import TensorProto
from onnx.external_data_helper import uses_external_data

from ..errors import InputError, OutputError
from ..interrupts import deferred_signals
from ..graph.wire import varint
from .direct_io import DirectWriter, direct_writer_or_file
from .external import (EXTERNAL_THRESHOLD, PathLike, all_tensors, external_span, inline_copy, set_external,
                       tensor_nbytes)
from .output_paths import data_path, refuse_non_regular
from .temp_folders import TempFolder
from .spill_regions import deferred_writer

#: Protobuf refuses messages of 2 GiB; stay clear of it.
PROTO_LIMIT = 2**31 - 64 * 2**20
#: Data files at least this big are written around the page cache (k3opt/modelio/direct_io.py).
DIRECT_THRESHOLD = 512 * 2**20
_CHUNK = 16 * 2**20


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
         fsync: bool = False, check: Optional[Callable[[Path], None]] = None) -> list[Path]:
    """Write ``model`` to ``dst`` atomically; returns the files written.

    External data is used when asked, when the model already keeps weights
    outside the proto, or when the proto would pass the 2 GB limit; it goes
    to ``DST.data`` (tensors under EXTERNAL_THRESHOLD always go inline).
    Weights in source files are streamed, never loaded at once. ``model``'s
    tensors are rewritten to point at the new file.
    Atomic means a temporary folder next to ``dst`` and renames: a failing
    or interrupted run never leaves a partial output. ``check`` gets the
    written model's path in that folder (its data file beside it, under its
    final name) before the renames; an exception from it leaves nothing
    written. ``fsync`` also makes the files and the renames durable against
    a power loss, at the cost of writing out what is still in the page cache
    (data files of DIRECT_THRESHOLD or more bypass it anyway); off by
    default, as in onnx.save and every peer.
    """
    out = Path(dst)
    has_external = _inline_small(model)
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
    temp: Optional[TempFolder] = None
    try:
        temp = TempFolder.next_to(out)
        temp.expect(out.name, data_path(out).name)
        written = _write_files(model, temp.path, out, external_data, serialized, fsync)
        # the model is in the files now: let it go before the check reads them back (when the caller let go of
        # it too, as the command line does, its weights are not in memory twice while the check parses them)
        del model, serialized
        if check is not None:
            check(temp.path / out.name)
        for path in written:  # checked again: the path may have changed since the run began
            refuse_non_regular(path, follow=False)
        with deferred_signals():  # a signal waits for the pair of renames: never a new data file under an old model
            for path in reversed(written):  # the data file first: the new model never points at an old one
                os.replace(temp.path / path.name, path)
        if fsync:
            _sync_folder(out.parent)
        return written
    except OSError as exc:
        raise OutputError(f"{out}: cannot write ({exc.strerror or exc})") from None
    finally:
        if temp is not None:
            temp.remove()


# Serializing a whole model at once (upb) encodes it into a buffer that doubles as it grows, then copies
# it out: several times the model's size in fresh memory. The model is written, and sized, a piece
# at a time instead: its fields before and after the graph, the graph's before and after its initializers,
# and each initializer on its own. Protobuf writes known fields in field-number order, so the pieces join
# into the very same bytes; a model or graph with unknown fields (written after the known ones) is
# serialized whole.

_GRAPH = onnx.ModelProto.DESCRIPTOR.fields_by_name["graph"].number
_INITIALIZER = onnx.GraphProto.DESCRIPTOR.fields_by_name["initializer"].number


def _write_files(model: onnx.ModelProto, folder: Path, out: Path, external_data: Optional[bool],
                 serialized: Optional["_Serialized"], fsync: bool) -> list[Path]:
    """Write ``model`` (and its data file with ``external_data``) into ``folder`` under ``out``'s names; the
    final paths."""
    written = [out] + [data_path(out)] * bool(external_data)
    if external_data:
        data_tmp = folder / data_path(out).name
        direct = sum(size for _, size in _external_candidates(model)) >= DIRECT_THRESHOLD
        with direct_writer_or_file(data_tmp, direct) as f:
            _write_external(model, f, data_path(out).name)
            if fsync:
                _sync(f)
    else:
        for t in all_tensors(model):
            if uses_external_data(t):
                t.CopyFrom(inline_copy(t))
    with open(folder / out.name, "wb") as f:
        _write_serialized(serialized or _serialized(model), f)
        if fsync:
            _sync(f)
    return written


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


def _sync_folder(folder: Path) -> None:
    """Make the renames durable (a crash right after save keeps the new files)."""
    fd = os.open(folder if str(folder) else ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
            src, src_offset, length = external_span(t)
            writer = deferred_writer(src, src_offset)
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
        set_external(t, location, offset, size)


def _inline_small(model: onnx.ModelProto) -> bool:
    """Read external tensors under :data:`EXTERNAL_THRESHOLD` back into the proto: onnxruntime's shape
    inference reads no data file, so a model with, say, Unsqueeze axes stored outside it does not load.
    Returns whether a tensor still uses external data (one walk for both)."""
    external = False
    for t in all_tensors(model):
        if uses_external_data(t):
            if t.data_type != TensorProto.STRING and tensor_nbytes(t) < EXTERNAL_THRESHOLD:
                t.CopyFrom(inline_copy(t))
            else:
                external = True
    return external


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
