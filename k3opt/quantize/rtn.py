"""Round-to-nearest weight quantization with a per-group clipping search, streamed over row blocks.

A MatMul weight ``w`` is ``(k, n)``: ``y = x @ w``. Quantization groups run along ``k`` (the reduced
axis), one scale per (group, column): int4 per-group gives scales ``(k / g, n)``, int8 per-channel
gives scales ``(n,)`` (one group of all ``k`` rows). The stored value is ``q`` and the weight reads back
as ``(q - zero_point) * scale``, ONNX's DequantizeLinear. Symmetric: no zero point, ``q`` in
``[-qmax, qmax]``; asymmetric: ``q`` in ``[qmin, qmax]`` of the signed type and a signed zero point of
the same type (so ``antiquant_offset = -zero_point`` for the NPU kernel).

The clipping search tries shrinking each group's range by :data:`CLIP_RATIOS` and keeps, per group,
the ratio with the least squared reconstruction error: outliers cost less than the resolution they
would take from every other weight of the group. It needs no data.

Rows are read a block at a time (whole groups), so a weight in a memory-mapped external file is never
in memory at once: int4 per-group is one pass, int8 per-channel three (range, search, quantize).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import numpy as np

#: The range fractions the clipping search tries (1.0: plain round-to-nearest over the full range).
CLIP_RATIOS = tuple(np.round(np.arange(1.0, 0.49, -0.05), 2))
#: Float elements per streamed block (about 16 MiB of float32).
BLOCK_ELEMENTS = 4 * 2**20


@dataclass(frozen=True)
class Scheme:
    """How a weight is quantized: bits (4 or 8), group size along k (0: per-channel), symmetric, clip search."""

    bits: int
    group: int
    symmetric: bool = False
    clip: bool = True

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1


@dataclass
class Quantized:
    """One quantized weight: ``q`` int8 holding the values, ``scale`` and ``zero_point`` (None: symmetric)
    shaped ``(k / g, n)`` per group or ``(n,)`` per channel, and the relative reconstruction error
    ``||w - dq(q)|| / ||w||``."""

    q: np.ndarray
    scale: np.ndarray
    zero_point: Optional[np.ndarray]
    rel_error: float
    #: calibrated (:mod:`.gptq`): the relative layer-output errors on the calibration inputs, (GPTQ's, RTN's)
    output_errors: Optional[tuple[float, float]] = None


def _params(lo: np.ndarray, hi: np.ndarray, scheme: Scheme) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """(scale, zero point) covering ``[lo, hi]`` (each broadcast over a group)."""
    if scheme.symmetric:
        scale = np.maximum(np.abs(lo), np.abs(hi)) / scheme.qmax
        scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
        return scale, None
    lo, hi = np.minimum(lo, 0), np.maximum(hi, 0)  # zero stays exactly representable
    scale = (hi - lo) / (scheme.qmax - scheme.qmin)
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    zp = np.clip(np.round(scheme.qmin - lo / scale), scheme.qmin, scheme.qmax).astype(np.float32)
    return scale, zp


def _quant(w: np.ndarray, scale: np.ndarray, zp: Optional[np.ndarray], scheme: Scheme) -> np.ndarray:
    q = np.round(w / scale)
    if zp is not None:
        q += zp
    lo = scheme.qmin if zp is not None else -scheme.qmax
    return np.clip(q, lo, scheme.qmax)


def _dequant(q: np.ndarray, scale: np.ndarray, zp: Optional[np.ndarray]) -> np.ndarray:
    return (q - zp) * scale if zp is not None else q * scale


def _search(w: np.ndarray, lo: np.ndarray, hi: np.ndarray, scheme: Scheme, axis: int) -> np.ndarray:
    """Squared reconstruction error of ``w`` per group for each clip ratio: shape ``(ratios, *groups)``."""
    ratios = CLIP_RATIOS if scheme.clip else (1.0,)
    errors = []
    for r in ratios:
        scale, zp = _params(lo * r, hi * r, scheme)
        d = _dequant(_quant(w, scale, zp, scheme), scale, zp) - w
        errors.append(np.square(d).sum(axis=axis))
    return np.stack(errors)


def row_blocks(k: int, n: int, group: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` row ranges of about :data:`BLOCK_ELEMENTS`, each whole groups of ``group`` rows."""
    unit = group or 1
    rows = max(unit, (BLOCK_ELEMENTS // max(n, 1)) // unit * unit)
    for start in range(0, k, rows):
        yield start, min(k, start + rows)


def quantize(read: Callable[[int, int], np.ndarray], k: int, n: int, scheme: Scheme,
             write: Callable[[int, int, np.ndarray], None]) -> Quantized:
    """Quantize the ``(k, n)`` weight whose rows ``[a, b)`` ``read(a, b)`` returns as float32.

    ``write(a, b, q)`` receives each block's int8 values; the returned :class:`Quantized` has an empty
    ``q`` (the values went to ``write``). Per group, ``k`` must be a multiple of the group size.
    """
    if scheme.group:
        return _per_group(read, k, n, scheme, write)
    return _per_channel(read, k, n, scheme, write)


def _per_group(read, k, n, scheme, write) -> Quantized:
    g = scheme.group
    scales, zps = np.empty((k // g, n), np.float32), np.empty((k // g, n), np.float32)
    err = ref = 0.0
    for a, b in row_blocks(k, n, g):
        w = np.asarray(read(a, b), dtype=np.float32).reshape((b - a) // g, g, n)
        lo, hi = w.min(axis=1, keepdims=True), w.max(axis=1, keepdims=True)
        best = np.argmin(_search(w, lo, hi, scheme, axis=1), axis=0)  # (groups, n)
        ratio = np.asarray(CLIP_RATIOS if scheme.clip else (1.0,), np.float32)[best][:, None, :]
        scale, zp = _params(lo * ratio, hi * ratio, scheme)
        q = _quant(w, scale, zp, scheme)
        err += float(np.square(_dequant(q, scale, zp) - w).sum())
        ref += float(np.square(w).sum())
        scales[a // g:b // g] = scale[:, 0, :]
        if zp is not None:
            zps[a // g:b // g] = zp[:, 0, :]
        write(a, b, q.reshape(b - a, n).astype(np.int8))
    return Quantized(np.empty(0, np.int8), scales, None if scheme.symmetric else zps.astype(np.int8),
                     _relative(err, ref))


def _per_channel(read, k, n, scheme, write) -> Quantized:
    lo, hi = np.full(n, np.inf, np.float32), np.full(n, -np.inf, np.float32)
    for a, b in row_blocks(k, n, 0):
        w = np.asarray(read(a, b), dtype=np.float32)
        lo, hi = np.minimum(lo, w.min(axis=0)), np.maximum(hi, w.max(axis=0))
    ratio = np.float32(1.0)
    if scheme.clip:
        errors = sum(_search(np.asarray(read(a, b), dtype=np.float32), lo, hi, scheme, axis=0)
                     for a, b in row_blocks(k, n, 0))
        ratio = np.asarray(CLIP_RATIOS, np.float32)[np.argmin(errors, axis=0)]
    scale, zp = _params(lo * ratio, hi * ratio, scheme)
    err = ref = 0.0
    for a, b in row_blocks(k, n, 0):
        w = np.asarray(read(a, b), dtype=np.float32)
        q = _quant(w, scale, zp, scheme)
        err += float(np.square(_dequant(q, scale, zp) - w).sum())
        ref += float(np.square(w).sum())
        write(a, b, q.astype(np.int8))
    return Quantized(np.empty(0, np.int8), scale, None if zp is None else zp.astype(np.int8), _relative(err, ref))


def _relative(err: float, ref: float) -> float:
    return float(np.sqrt(err / ref)) if ref > 0 else float(np.sqrt(err))


def dequantize(q: np.ndarray, scale: np.ndarray, zero_point: Optional[np.ndarray], group: int) -> np.ndarray:
    """The float ``(k, n)`` weight ``(q - zero_point) * scale`` (scales repeated over each group's rows)."""
    s = np.repeat(scale, group, axis=0) if group else scale
    z = None if zero_point is None else (np.repeat(zero_point, group, axis=0) if group else zero_point)
    return _dequant(q.astype(np.float32), s.astype(np.float32), None if z is None else z.astype(np.float32))


def pack_int4(q: np.ndarray) -> bytes:
    """int4 values (held in int8, row-major) packed two per byte, the first in the low nibble (ONNX's INT4)."""
    flat = q.reshape(-1).astype(np.uint8) & 0x0F
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.uint8)])
    return (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8).tobytes()


def unpack_int4(data: bytes, count: int) -> np.ndarray:
    """The inverse of :func:`pack_int4`: ``count`` signed values as int8."""
    b = np.frombuffer(data, np.uint8)
    nib = np.empty(b.size * 2, np.uint8)
    nib[0::2], nib[1::2] = b & 0x0F, b >> 4
    return ((nib[:count].astype(np.int16) ^ 8) - 8).astype(np.int8)
