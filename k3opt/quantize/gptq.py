"""GPTQ: round-to-nearest with error feedback through the layer's input statistics (Frantar et al., 2022).

For ``y = x @ w`` with ``w`` ``(k, n)`` and calibration inputs ``X`` ``(samples, k)``, the layer-output
error of a quantized ``w + d`` is ``||X d||^2 = tr(d^T H d)`` with ``H = X^T X``. GPTQ quantizes the rows of
``w`` (the input channels) one at a time and spreads each row's rounding error over the rows not yet
quantized, in the proportions the inverse Hessian gives, so later rows compensate what earlier ones lost.
As in the reference implementation: the Hessian is damped by 1 % of its mean diagonal, the updates use the
upper Cholesky factor of ``H^-1``, and are applied lazily per block of rows. Each group's scale and zero
point are computed when the group is reached, from its rows as updated so far, over their full range as the
reference does (a clip chosen for one group's weights alone, before the feedback reaches the rows, made
the trained bench LM's perplexity worse, with weight or activation-weighted error alike); the stored
format is :mod:`.rtn`'s. Per channel, each column's scale covers its full range, fixed before the rows.

An input channel no calibration sample used (a zero diagonal) is quantized as RTN would and its weights kept
(the reference zeroes them: right for the calibration data, wrong for any input that uses the channel).
The result keeps whichever of GPTQ and RTN has the smaller layer-output error on the calibration inputs.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from . import rtn

#: Damping added to the Hessian's diagonal, as a fraction of its mean (the reference's ``percdamp``).
DAMP = 0.01
#: Rows updated together before the lazy update of the rest (a multiple of every group size used).
BLOCK = 128


def output_error(w: np.ndarray, d: np.ndarray, hessian: np.ndarray) -> float:
    """The relative layer-output error ``||X d|| / ||X w||`` from ``H = X^T X`` (columns in chunks)."""
    err = ref = 0.0
    for c in range(0, w.shape[1], 1024):
        dc, wc = d[:, c:c + 1024].astype(np.float64), w[:, c:c + 1024].astype(np.float64)
        err += float(np.sum((hessian @ dc) * dc))
        ref += float(np.sum((hessian @ wc) * wc))
    return float(np.sqrt(max(err, 0.0) / ref)) if ref > 0 else float(np.sqrt(max(err, 0.0)))


def _inverse_factor(hessian: np.ndarray) -> np.ndarray:
    """The upper Cholesky factor of the damped ``H^-1``, with unused channels given a unit diagonal."""
    h = np.array(hessian, dtype=np.float64)
    diag = np.diagonal(h).copy()
    dead = diag <= 0
    h[dead, dead] = 1.0
    damp = DAMP * float(np.mean(np.diagonal(h)))
    while True:  # a rank-deficient H (fewer samples than channels) needs more damping now and then
        try:
            low = np.linalg.cholesky(h + damp * np.eye(len(h)))
            break
        except np.linalg.LinAlgError:
            damp *= 10
    inv_low = np.linalg.solve(low, np.eye(len(h)))
    return np.linalg.cholesky(inv_low.T @ inv_low).T


def _gptq(w: np.ndarray, hessian: np.ndarray, scheme: rtn.Scheme,
          channel: Optional[tuple[np.ndarray, Optional[np.ndarray]]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(q, scales, zero points)`` of ``w`` ``(k, n)``: per group ``(k / g, n)``, per channel ``channel``'s."""
    k, n = w.shape
    g = scheme.group
    u = _inverse_factor(hessian)
    work = w.astype(np.float64)
    q = np.empty((k, n), np.int8)
    groups = k // g if g else 1
    scales, zps = np.empty((groups, n), np.float32), np.zeros((groups, n), np.float32)
    block = max(BLOCK, g)
    scale, zp = channel if channel is not None else (None, None)
    for a in range(0, k, block):
        b = min(k, a + block)
        rows, err = work[a:b], np.empty((b - a, n))
        for j in range(b - a):
            if g and (a + j) % g == 0:
                group = rows[j:j + g]
                scale, zp = rtn._params(group.min(axis=0, keepdims=True), group.max(axis=0, keepdims=True), scheme)
                scales[(a + j) // g], zps[(a + j) // g] = scale[0], 0 if zp is None else zp[0]
            qj = rtn._quant(rows[j:j + 1], scale, zp, scheme)
            q[a + j] = qj[0]
            err[j] = (rows[j] - rtn._dequant(qj, scale, zp)[0]) / u[a + j, a + j]
            rows[j + 1:] -= np.outer(u[a + j, a + j + 1:b], err[j])
        work[b:] -= u[a:b, b:].T @ err
    if not g:
        scales[0] = scale[0]
        if zp is not None:
            zps[0] = zp[0]
    return q, scales, zps


def quantize(read: Callable[[int, int], np.ndarray], k: int, n: int, scheme: rtn.Scheme,
             write: Callable[[int, int, np.ndarray], None], hessian: np.ndarray) -> rtn.Quantized:
    """:func:`rtn.quantize` with GPTQ's error feedback through ``hessian`` (``X^T X`` of the layer's inputs,
    ``(k, k)``); the result's ``output_errors`` are the relative layer-output errors on the calibration
    inputs of GPTQ and of RTN. The whole weight is read at once (one weight in memory)."""
    w = np.asarray(read(0, k), dtype=np.float32)
    rtn_blocks: list[np.ndarray] = []
    plain = rtn.quantize(lambda a, b: w[a:b], k, n, scheme, lambda a, b, v: rtn_blocks.append(v))
    plain_q = np.concatenate(rtn_blocks)
    back = rtn.dequantize(plain_q, plain.scale, plain.zero_point, scheme.group)
    rtn_error = output_error(w, back - w, hessian)
    channel = None if scheme.group else rtn._params(w.min(axis=0, keepdims=True), w.max(axis=0, keepdims=True),
                                                    scheme)
    q, scales, zps = _gptq(w, hessian, scheme, channel)
    if not scheme.group:
        scales, zps = scales[0], zps[0]
    zero = None if scheme.symmetric else zps.astype(np.int8)
    back = rtn.dequantize(q, scales, zero, scheme.group)
    gptq_error = output_error(w, back - w, hessian)
    if gptq_error >= rtn_error:  # greedy feedback can lose on a layer: keep RTN's there
        q, scales, zero, back = plain_q, plain.scale, plain.zero_point, rtn.dequantize(
            plain_q, plain.scale, plain.zero_point, scheme.group)
    write(0, k, q)
    rel = float(np.linalg.norm(back - w) / max(float(np.linalg.norm(w)), 1e-30))
    return rtn.Quantized(np.empty(0, np.int8), scales, zero, rel, (gptq_error, rtn_error))
