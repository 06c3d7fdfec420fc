"""Protobuf wire-format encoding: the few primitives the fast exporter and shape refreshes share."""
from __future__ import annotations

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
