"""numpy reference implementations of the MoE NPU ops k3opt emits (``lower-moe-npu``), for onnx's evaluator.

Each computes its documented formula (sources by short name in :mod:`.npu_contract`) and refuses, with an
error, what the documentation does not define or k3opt does not model.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
from onnx.reference.op_run import OpRun

from ..npu_contract import MOE_MAX_K
from .registry import ReferenceError, reference_op


class MoeReferenceError(ReferenceError):
    """A MoE node asks for something the documented contract does not define (or k3opt does not model)."""


def _float(x: np.ndarray, what: str) -> None:
    if x.dtype.name not in ("float32", "float16", "bfloat16"):
        raise MoeReferenceError(f"{what} is {x.dtype}: float32, float16 or bfloat16 ([MGS-IR], [MIR-IR], [MFR-IR])")


def gating_top_k_softmax(x: np.ndarray, k: int, finished: Optional[np.ndarray] = None
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[MGS-doc]: ``y, expert_idx = topK(softmax(x, -1), k)``; ``row_idx = arange(N*k).reshape(k, N).T`` over the
    N rows (leading dims flattened); a ``finished`` row's experts are E (the expert count). Softmax in float32,
    y cast to x's dtype; among equal scores the lower expert index first (as ONNX TopK)."""
    _float(x, "x")
    if x.ndim not in (2, 3):
        raise MoeReferenceError(f"x has rank {x.ndim}: the op takes 2-D or 3-D x ([MGS-IR])")
    experts = x.shape[-1]
    if not 0 < k <= min(experts, MOE_MAX_K):
        raise MoeReferenceError(f"k = {k} is not in 1..min({experts} experts, {MOE_MAX_K}) ([MGS-IR])")
    xf = x.astype(np.float32)
    e = np.exp(xf - xf.max(axis=-1, keepdims=True))
    p = e / e.sum(axis=-1, keepdims=True)
    order = np.argsort(-p, axis=-1, kind="stable")[..., :k]
    y = np.take_along_axis(p, order, axis=-1).astype(x.dtype)
    idx = order.astype(np.int32)
    if finished is not None:
        idx = np.where(finished.astype(bool)[..., None], np.int32(experts), idx)
    rows = int(np.prod(x.shape[:-1]))
    row_idx = np.arange(rows * k, dtype=np.int32).reshape(k, rows).T.reshape(*x.shape[:-1], k)
    return y, idx, row_idx


def init_routing(x: np.ndarray, row_idx: np.ndarray, expert_idx: np.ndarray, active_num: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[MIR-doc]: ``expanded_expert_idx, sorted_row_idx = keyValueSort(expert_idx, row_idx)`` (flattened, stable
    as torch_npu's reference), ``expanded_row_idx[sorted_row_idx[i]] = i``, ``expanded_x[i] =
    x[sorted_row_idx[i] % N]`` for the first ``min(N, active_num) * k`` rows."""
    _float(x, "x")
    if x.ndim != 2 or row_idx.ndim != 2 or row_idx.shape != expert_idx.shape or row_idx.shape[0] != x.shape[0]:
        raise MoeReferenceError(f"x {list(x.shape)}, row_idx {list(row_idx.shape)}, expert_idx "
                                f"{list(expert_idx.shape)}: (N, H), (N, k), (N, k) are documented ([MIR-IR])")
    if row_idx.dtype != np.int32 or expert_idx.dtype != np.int32:
        raise MoeReferenceError("row_idx and expert_idx must be int32 ([MIR-IR])")
    if active_num <= 0:
        raise MoeReferenceError(f"active_num = {active_num}: only an active count > 0 is modelled")
    n, k = expert_idx.shape
    order = np.argsort(expert_idx.reshape(-1), kind="stable")
    expanded_expert_idx = expert_idx.reshape(-1)[order]
    sorted_rows = row_idx.reshape(-1)[order]
    expanded_row_idx = np.empty(n * k, dtype=np.int32)
    expanded_row_idx[sorted_rows] = np.arange(n * k, dtype=np.int32)
    expanded_x = x[sorted_rows[:min(n, active_num) * k] % n]
    return expanded_x, expanded_row_idx, expanded_expert_idx.astype(np.int32)


def finalize_routing(expanded_x: np.ndarray, x1: np.ndarray, x2: Optional[np.ndarray], bias: np.ndarray,
                     scales: np.ndarray, expanded_row_idx: np.ndarray, expert_idx: np.ndarray) -> np.ndarray:
    """[MFR-doc]: ``out[i] = x1[i] + x2[i] + sum_k scales[i, k] * (expanded_x[expanded_row_idx[i + k*N]] +
    bias[expert_idx[i, k]])``, in float32, cast to expanded_x's dtype."""
    for t, what in ((expanded_x, "expanded_x"), (x1, "x1"), (bias, "bias"), (scales, "scales")):
        _float(t, what)
        if t.dtype != expanded_x.dtype:
            raise MoeReferenceError(f"{what} is {t.dtype}, expanded_x {expanded_x.dtype}: one dtype ([MFR-IR])")
    n, k = scales.shape
    if expert_idx.shape != (n, k) or expanded_row_idx.shape != (n * k,) or x1.shape != (n, expanded_x.shape[1]) \
            or bias.ndim != 2 or bias.shape[1] != expanded_x.shape[1]:
        raise MoeReferenceError(f"shapes expanded_x {list(expanded_x.shape)}, x1 {list(x1.shape)}, bias "
                                f"{list(bias.shape)}, scales {list(scales.shape)}, expanded_row_idx "
                                f"{list(expanded_row_idx.shape)}, expert_idx {list(expert_idx.shape)} are not the "
                                "documented ones ([MFR-IR])")
    out = x1.astype(np.float32) + (0 if x2 is None else x2.astype(np.float32))
    ef, bf, sf = expanded_x.astype(np.float32), bias.astype(np.float32), scales.astype(np.float32)
    for j in range(k):
        rows = ef[expanded_row_idx[np.arange(n) + j * n]]
        out = out + sf[:, j:j + 1] * (rows + bf[expert_idx[:, j]])
    return out.astype(expanded_x.dtype)


def _present(inputs: Any, i: int) -> Optional[np.ndarray]:
    return inputs[i] if i < len(inputs) and inputs[i] is not None else None


@reference_op("NPUMoeGatingTopKSoftmax")
class NPUMoeGatingTopKSoftmax(OpRun):
    """``(x, finished?) -> (y, expert_idx, row_idx)``, attribute ``k`` required ([MGS-plugin])."""

    def _run(self, x, finished=None, k=None):  # noqa: D102 - OpRun's interface
        if k is None:
            raise MoeReferenceError("k is required (the plugin refuses the node without the INT attribute)")
        return gating_top_k_softmax(x, int(k), finished)


@reference_op("NPUMoeInitRouting")
class NPUMoeInitRouting(OpRun):
    """``(x, row_idx, expert_idx) -> (expanded_x, expanded_row_idx, expanded_expert_idx)``, ``active_num``
    required ([MIR-plugin])."""

    def _run(self, x, row_idx, expert_idx, active_num=None):  # noqa: D102
        if active_num is None:
            raise MoeReferenceError("active_num is required (the plugin refuses the node without it)")
        return init_routing(x, row_idx, expert_idx, int(active_num))


@reference_op("NPUMoeFinalizeRouting")
class NPUMoeFinalizeRouting(OpRun):
    """``(expanded_x, x1, x2?, bias, scales, expanded_row_idx, expert_idx) -> y`` ([MFR-plugin]: no attribute)."""

    def _run(self, *inputs):  # noqa: D102
        if len(inputs) != 7:
            raise MoeReferenceError(f"{len(inputs)} inputs: the op takes 7 (x2 may be empty) ([MFR-IR])")
        return (finalize_routing(inputs[0], inputs[1], _present(inputs, 2), *inputs[3:]),)
