"""Protobuf wire-format encoding: the few primitives the fast exporter and shape refreshes share."""
from __future__ import annotations

from google.protobuf.message import Message

#: The one-byte varints 0..127, prebuilt.
_ONE_BYTE = [bytes((n,)) for n in range(0x80)]


def varint(n: int) -> bytes:
    """The protobuf varint of ``n`` >= 0."""
    if n < 0x80:
        return _ONE_BYTE[n]
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    """``payload`` encoded as the length-delimited field ``number`` of a protobuf message."""
    tag, size = number << 3 | 2, len(payload)
    return ((_ONE_BYTE[tag] if tag < 0x80 else varint(tag)) + (_ONE_BYTE[size] if size < 0x80 else varint(size))
            + payload)


def copy_fields(source: Message, target: Message, skip: tuple[str, ...]) -> None:
    """Copy the fields set in ``source`` into the empty ``target`` of the same type, but those named in ``skip``."""
    for fd, value in source.ListFields():
        if fd.name in skip:
            continue
        if fd.is_repeated:
            getattr(target, fd.name).extend(value)
        elif fd.message_type is not None:
            getattr(target, fd.name).CopyFrom(value)
        else:
            setattr(target, fd.name, value)
