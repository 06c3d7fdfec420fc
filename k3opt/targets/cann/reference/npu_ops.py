"""numpy reference implementations of the NPU ops k3opt emits, for ``onnx.reference.ReferenceEvaluator``.

onnxruntime cannot run NPU nodes, so a ``--target cann`` model is verified by
running it in onnx's reference evaluator with these ops (:func:`.registry.evaluator`),
and a user with an NPU can compare the device with them. Each op implements
what the ATC plugin hands to the kernel (attributes the plugin drops are
ignored here too) and refuses, with an error, what its documentation does
not define. The ops' documented contracts, and the sources cited by short
name in the comments, are in :mod:`.npu_contract`.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
from onnx.reference.op_run import OpRun
from onnx.reference.ops.op_loop import Loop as _OnnxLoop

from ..npu_contract import (MAX_GROUP, MAX_HEAD_DIM, MAX_HEADS, PFA_INPUT_COUNTS, RMS_EPSILON, ROPE_ANGLE_LAYOUTS,
                           ROPE_HALF, ROPE_MAX_HEAD_DIM, SPARSE_TEMPLATE, template_mask)
from .registry import ReferenceError, reference_op

def _bnsd(x: np.ndarray, layout: str, heads: int) -> np.ndarray:
    """``x`` as (B, N, S, D) from ``layout`` ([PFA-doc] "inputLayout": BSH, BSND, BNSD)."""
    if layout == "BNSD" and x.ndim == 4:
        return x
    if layout == "BSND" and x.ndim == 4:
        return x.transpose(0, 2, 1, 3)
    if layout == "BSH" and x.ndim == 3:
        b, s, h = x.shape
        if h % heads:
            raise ReferenceError(f"BSH hidden size {h} is not a multiple of {heads} heads")
        return x.reshape(b, s, heads, h // heads).transpose(0, 2, 1, 3)
    raise ReferenceError(f"input_layout {layout!r} with a rank-{x.ndim} tensor is not modelled")


def _from_bnsd(x: np.ndarray, layout: str) -> np.ndarray:
    if layout == "BNSD":
        return x
    y = x.transpose(0, 2, 1, 3)
    return y if layout == "BSND" else y.reshape(y.shape[0], y.shape[1], -1)


def _mask4(mask: np.ndarray, q_len: int, kv_len: int) -> np.ndarray:
    """A bool (B|1, 1, Sq, Skv) view of a documented mask shape: (S, S), (B|1, S, S), (B|1, 1, S, S)
    ([PFA-doc] "attenMask"); dtypes bool, int8, uint8, 1/True = masked ([PFA-torch], [IFA-torch])."""
    if mask.dtype not in (np.bool_, np.int8, np.uint8):
        raise ReferenceError(f"atten_mask dtype {mask.dtype} is not bool, int8 or uint8")
    m = mask.astype(bool)
    if m.ndim == 2:
        m = m[None, None]
    elif m.ndim == 3:
        m = m[:, None]
    if m.ndim != 4 or m.shape[1] != 1 or m.shape[2:] != (q_len, kv_len):
        raise ReferenceError(f"atten_mask shape {list(mask.shape)} is not (S, S), (B|1, S, S) or (B|1, 1, S, S) "
                             f"for Sq={q_len}, Skv={kv_len}")
    return m


def _masked(sparse_mode: int, mask: Optional[np.ndarray], pre: int, nxt: int, q_len: int, kv_len: int
            ) -> Optional[np.ndarray]:
    """Which (query, key) pairs are masked out, broadcastable to (B, N, Sq, Skv); None: none.

    [PFA-doc] "sparseMode": 0 without a mask masks nothing (pre/next tokens are then ignored); 0 with a
    mask takes a full (Sq x Skv) mask and computes only the band ``i - pre <= j <= i + next``; 1 takes
    the full mask as it is; 2 is causal from the top left, 3 causal from the bottom right (both with
    the 2048 template mask). 4 (band) and 5..8 are not modelled.
    """
    i = np.arange(q_len)[:, None]
    j = np.arange(kv_len)[None, :]
    if sparse_mode in (0, 1):
        if mask is None:
            if sparse_mode == 1:
                raise ReferenceError("sparse_mode 1 (allMask) needs an atten_mask")
            return None
        m = _mask4(mask, q_len, kv_len)
        if sparse_mode == 0:
            m = m | ((j < i - pre) | (j > i + nxt))[None, None]
        return m
    if sparse_mode in (2, 3):
        if mask is None or mask.shape[-2:] != (SPARSE_TEMPLATE, SPARSE_TEMPLATE) or \
                not np.array_equal(mask.astype(bool).reshape(-1, SPARSE_TEMPLATE, SPARSE_TEMPLATE)[0], template_mask()):
            raise ReferenceError(f"sparse_mode {sparse_mode} needs the 2048 x 2048 triu(ones, 1) template mask")
        offset = 0 if sparse_mode == 2 else kv_len - q_len
        return (j > i + offset)[None, None]
    raise ReferenceError(f"sparse_mode {sparse_mode} is not modelled (k3opt emits 0 and 3)")


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, masked: Optional[np.ndarray], scale: float,
              kv_heads: int, fix_masked_rows: bool) -> np.ndarray:
    """``softmax(scale * q @ k^T, masked out) @ v`` in float32 for (B, N, S, D) tensors, cast to q's dtype.

    GQA: query head h reads key/value head ``h // (N / N_kv)`` ([PFA-doc] "numKeyValueHeads": N must be a
    multiple of it; 0 means N). A query row with every key masked: its result is not documented
    ([PFA-doc] "innerPrecise": with bits 0b00/0b01 "precision may be lost" when a row of the mask is
    all 1; bit 1 turns on the invalid-row correction). With the correction (``fix_masked_rows``) the
    reference gives 0 for such a row; without it NaN, so a comparison fails rather than guess.
    """
    heads = q.shape[1]
    if kv_heads <= 0:
        kv_heads = heads
    if heads % kv_heads or k.shape[1] != kv_heads or v.shape[1] != kv_heads:
        raise ReferenceError(f"{heads} query heads, num_key_value_heads {kv_heads}, key/value with "
                             f"{k.shape[1]}/{v.shape[1]} heads")
    if heads // kv_heads > MAX_GROUP or heads > MAX_HEADS:
        raise ReferenceError(f"{heads} heads over {kv_heads} KV heads is outside the documented limits")
    if q.shape[-1] != k.shape[-1] or v.shape[-1] != q.shape[-1] or q.shape[-1] > MAX_HEAD_DIM:
        raise ReferenceError(f"head dims q {q.shape[-1]}, k {k.shape[-1]}, v {v.shape[-1]}: one D <= "
                             f"{MAX_HEAD_DIM} is documented for these layouts")
    group = heads // kv_heads
    kf = np.repeat(k.astype(np.float32), group, axis=1)
    vf = np.repeat(v.astype(np.float32), group, axis=1)
    scores = np.float32(scale) * (q.astype(np.float32) @ kf.swapaxes(-1, -2))
    if masked is not None:
        masked = np.broadcast_to(masked, scores.shape)
        scores = np.where(masked, -np.inf, scores)
    top = scores.max(axis=-1, keepdims=True)
    dead = ~np.isfinite(top)  # every key of the row masked
    e = np.exp(scores - np.where(dead, 0, top))
    e = np.where(dead, 0, e)
    total = e.sum(axis=-1, keepdims=True)
    probs = e / np.where(dead, 1, total)
    out = probs @ vf
    if not fix_masked_rows:
        out = np.where(dead, np.float32(np.nan), out)
    return out.astype(q.dtype)


def _valid_lengths(value: Optional[np.ndarray], batch: int, size: int, name: str) -> Optional[np.ndarray]:
    """Per-batch valid lengths ([PFA-doc]): one value for all batches, or the first ``batch`` of at least as many."""
    if value is None:
        return None
    lens = np.asarray(value).reshape(-1).astype(np.int64)
    if lens.size == 1:
        lens = np.repeat(lens, batch)
    elif lens.size >= batch:
        lens = lens[:batch]
    else:
        raise ReferenceError(f"{name} has {lens.size} values for {batch} batches (1, or at least {batch})")
    if (lens < 0).any() or (lens > size).any():
        raise ReferenceError(f"{name} {lens.tolist()} outside 0..{size} (the tensor's S)")
    return lens


def _present(inputs: Sequence[Any], i: int) -> Optional[np.ndarray]:
    return inputs[i] if i < len(inputs) and inputs[i] is not None else None


@reference_op("NPURmsNorm")
class NPURmsNorm(OpRun):
    """``NPURmsNorm(x, gamma) -> (y, rstd)`` ([RMS-plugin]): over gamma's rank of trailing dims, in float32,
    ``rstd = 1 / sqrt(mean(x^2) + 1e-6)``, ``y = x * rstd * gamma`` cast to x's dtype; rstd float32 with
    the normalized dims kept as 1. The plugin reads no attribute (epsilon fixed)."""

    def _run(self, x, gamma):  # noqa: D102 - OpRun's interface
        k = gamma.ndim
        if k == 0 or k > x.ndim or x.shape[x.ndim - k:] != gamma.shape:
            raise ReferenceError(f"gamma {list(gamma.shape)} is not the trailing dims of x {list(x.shape)}")
        xf = x.astype(np.float32)
        axes = tuple(range(x.ndim - k, x.ndim))
        rstd = (1 / np.sqrt(np.mean(xf * xf, axis=axes, keepdims=True) + np.float32(RMS_EPSILON))).astype(np.float32)
        return (xf * rstd * gamma.astype(np.float32)).astype(x.dtype), rstd


@reference_op("NPUPromptFlashAttention")
class NPUPromptFlashAttention(OpRun):
    """Prefill flash attention as the plugin passes it on ([PFA-plugin]).

    Inputs by position (groups of [PFA-plugin]): query, key, value, pse_shift, atten_mask,
    actual_seq_lengths, actual_seq_lengths_kv, quantization scales; the first seven are modelled and
    pse_shift must be absent. actual_seq_lengths_kv masks each batch's keys from its valid length on;
    actual_seq_lengths (query rows) must leave every row valid (what a cut row returns is not
    documented). Both: one value for every batch, or at least B values of which the first B count,
    none above the tensor's S ([PFA-doc] "actualSeqLengths, actualSeqLengthsKv"). Attributes as the plugin reads them, with ITS defaults when absent (not
    torch_npu's): num_heads, input_layout (both required), scale_value 1.0, pre_tokens 0, next_tokens 0,
    num_key_value_heads 0 (= num_heads), sparse_mode 0, inner_precise 1.
    """

    def _run(self, *inputs, num_heads=None, input_layout=None, scale_value=1.0, pre_tokens=0,  # noqa: D102
             next_tokens=0, num_key_value_heads=0, sparse_mode=0, inner_precise=1):
        if len(inputs) not in PFA_INPUT_COUNTS:
            raise ReferenceError(f"{len(inputs)} inputs: the plugin takes {PFA_INPUT_COUNTS}")
        if num_heads is None or input_layout is None:
            raise ReferenceError("num_heads and input_layout are required (the plugin refuses the node)")
        if any(_present(inputs, i) is not None for i in (3, *range(7, len(inputs)))):
            raise ReferenceError("only query, key, value, atten_mask and the actual sequence lengths are modelled")
        layout = input_layout.decode() if isinstance(input_layout, bytes) else input_layout
        q = _bnsd(inputs[0], layout, num_heads)
        kv_heads = num_key_value_heads or num_heads
        k, v = _bnsd(inputs[1], layout, kv_heads), _bnsd(inputs[2], layout, kv_heads)
        if q.shape[1] != num_heads:
            raise ReferenceError(f"query has {q.shape[1]} heads, num_heads is {num_heads}")
        masked = _masked(sparse_mode, _present(inputs, 4), pre_tokens, next_tokens, q.shape[2], k.shape[2])
        q_lens = _valid_lengths(_present(inputs, 5), q.shape[0], q.shape[2], "actual_seq_lengths")
        if q_lens is not None and (q_lens < q.shape[2]).any():
            raise ReferenceError(f"actual_seq_lengths {q_lens.tolist()} cut query rows (S = {q.shape[2]}): "
                                 "what a cut row returns is not documented")
        kv_lens = _valid_lengths(_present(inputs, 6), k.shape[0], k.shape[2], "actual_seq_lengths_kv")
        if kv_lens is not None:
            beyond = np.arange(k.shape[2])[None, None, None, :] >= kv_lens[:, None, None, None]
            masked = beyond if masked is None else (masked | beyond)
        out = attention(q, k, v, masked, scale_value, kv_heads, bool(inner_precise & 2))
        return (_from_bnsd(out, layout),)


@reference_op("NPUIncreFlashAttention")
class NPUIncreFlashAttention(OpRun):
    """Decode flash attention (one query row against the cache) as the plugin passes it on ([IFA-plugin]).

    Inputs: query, n keys, n values, pse_shift, atten_mask, actual_seq_lengths (``len - 4`` must be even;
    only n = 1, no pse_shift and no actual_seq_lengths are modelled). The plugin reads only num_heads,
    input_layout and scale_value: num_key_value_heads keeps the IR default 1 ([IFA-IR]) whatever the
    node says, so the key/value cache must have ONE head. atten_mask: (B, Skv), (B, 1, Skv) or
    (B, 1, 1, Skv), 1 = masked ([IFA-torch]); the query's S must be 1 ([IFA-IR] / torch_npu). No
    invalid-row correction is documented for IFA: a fully masked row gives NaN here.
    """

    def _run(self, *inputs, num_heads=None, input_layout=None, scale_value=1.0, **ignored):  # noqa: D102
        if len(inputs) != 6:
            raise ReferenceError(f"{len(inputs)} inputs: only query, key, value, pse_shift, atten_mask, "
                                 "actual_seq_lengths (one key and one value) are modelled")
        if num_heads is None or input_layout is None:
            raise ReferenceError("num_heads and input_layout are required (the plugin refuses the node)")
        if _present(inputs, 3) is not None or _present(inputs, 5) is not None:
            raise ReferenceError("pse_shift and actual_seq_lengths are not modelled")
        layout = input_layout.decode() if isinstance(input_layout, bytes) else input_layout
        q = _bnsd(inputs[0], layout, num_heads)
        k, v = _bnsd(inputs[1], layout, 1), _bnsd(inputs[2], layout, 1)
        if q.shape[2] != 1:
            raise ReferenceError(f"the query has S = {q.shape[2]}; IncreFlashAttention takes S = 1")
        mask = _present(inputs, 4)
        masked = None
        if mask is not None:
            b = mask.shape[0]
            masked = _mask4(mask.reshape(b, 1, 1, mask.shape[-1]) if mask.ndim in (2, 3) else mask, 1, k.shape[2])
        return (_from_bnsd(attention(q, k, v, masked, scale_value, 1, False), layout),)


def rope_layout_refusal(x_shape: Sequence[int], angle_shape: Sequence[int], mode: int) -> Optional[str]:
    """Why cos/sin of ``angle_shape`` are not a documented layout for an x of ``x_shape`` ([RoPE-doc]), or None.
    A leading dim of 1 in x may be read as kept or as broadcast."""
    if len(x_shape) != 4 or len(angle_shape) != 4:
        return f"x {list(x_shape)} and cos/sin {list(angle_shape)} are not both 4-D"
    d = x_shape[3]
    if angle_shape[3] != d or d % 2 or d > ROPE_MAX_HEAD_DIM:
        return f"head dim {d} (cos/sin {angle_shape[3]}) is not one even D < 896"
    layouts = ROPE_ANGLE_LAYOUTS.get(mode)
    if layouts is None:
        return f"mode {mode} is not modelled (Atlas A2/A3 take 0 half and 1 interleave)"
    options = []
    for have, want in zip(angle_shape[:3], x_shape[:3]):
        if have not in (1, want):
            return f"cos/sin {list(angle_shape)} do not broadcast to x {list(x_shape)}"
        options.append("f1" if want == 1 else ("f" if have == want else "1"))
    if not any(a + b + c in layouts for a in options[0] for b in options[1] for c in options[2]):
        return f"cos/sin {list(angle_shape)} against x {list(x_shape)} is not a documented layout for mode {mode}"
    return None


@reference_op("NPURotaryPositionEmbedding")
class NPURotaryPositionEmbedding(OpRun):
    """``NPURotaryPositionEmbedding(x, cos, sin, mode) -> y`` as the plugin passes it on ([RoPE-plugin]: the INT
    ``mode`` is required, the node is refused without it), computing [RoPE-doc]'s formulas on 4-D tensors:

    - mode 0 (half): ``y = x * cos + cat(-x[..., D/2:], x[..., :D/2]) * sin``;
    - mode 1 (interleave): ``y = x * cos + r * sin`` with ``r[..., 2i] = -x[..., 2i+1]``, ``r[..., 2i+1] = x[..., 2i]``.

    cos and sin have one shape, x's D and dtype (float16, bfloat16, float32 [RoPE-IR]), and a layout of
    :data:`ROPE_ANGLE_LAYOUTS`. float32 and float16 are computed in their own type (the half-mode kernel
    ``RotateHalf<T>`` multiplies and adds in T, [RoPE-tiling]); bfloat16 in float32, rounded once (numpy has
    no bfloat16 arithmetic; the kernel's own bf16 path, ``op_kernel/rotate_half_bf16.h``, is not modelled).
    """

    def _run(self, x, cos, sin, mode=None):  # noqa: D102 - OpRun's interface
        if mode is None:
            raise ReferenceError("mode is required (the plugin refuses a node without the INT attribute)")
        if cos.shape != sin.shape:
            raise ReferenceError(f"cos {list(cos.shape)} and sin {list(sin.shape)} differ in shape")
        if not (x.dtype == cos.dtype == sin.dtype) or x.dtype.name not in ("float16", "float32", "bfloat16"):
            raise ReferenceError(f"x, cos, sin are {x.dtype}, {cos.dtype}, {sin.dtype}: one of fp16, bf16, fp32")
        why = rope_layout_refusal(x.shape, cos.shape, int(mode))
        if why:
            raise ReferenceError(why)
        work = np.float32 if x.dtype.name == "bfloat16" else x.dtype
        xw, c, s = (t.astype(work) for t in (x, cos, sin))
        if mode == ROPE_HALF:
            h = x.shape[-1] // 2
            rotated = np.concatenate([-xw[..., h:], xw[..., :h]], axis=-1)
        else:
            rotated = np.stack([-xw[..., 1::2], xw[..., 0::2]], axis=-1).reshape(xw.shape)
        return ((xw * c + rotated * s).astype(x.dtype),)


@reference_op("GatherElements", domains=("",))
class GatherElements(OpRun):
    """The standard op, as the ONNX spec and onnxruntime define it (``out[i][j] = data[index[i][j]][j]`` for
    axis 0): onnx 1.23's reference implementation fails when the indices are smaller than the data on the
    other axes (TorchScript BERT's ``token_type_ids`` buffer), which onnxruntime and the spec allow."""

    def _run(self, data, indices, axis=0):  # noqa: D102
        axis = axis % data.ndim
        index = np.where(indices < 0, indices + data.shape[axis], indices)
        box = tuple(slice(None) if a == axis else slice(0, n) for a, n in enumerate(indices.shape))
        return (np.take_along_axis(data[box], index, axis=axis),)


@reference_op("Loop", domains=("",))
class Loop(_OnnxLoop):
    """The standard op, as the ONNX spec and onnxruntime define it: an omitted ``cond`` is true (``Loop(M, "",
    ...)`` runs M times; the spec's table: ``for (int i=0; i < max_trip_count; ++i)``). onnx 1.23's reference
    implementation runs no iteration then (``while cond and ...`` with ``cond`` None) and hands the body a
    None condition."""

    def _run(self, M, cond, *args, **kwargs):  # noqa: D102, N803 - OpRun's interface, the spec's names
        return super()._run(M, np.array(True) if cond is None else cond, *args, **kwargs)
