"""Greedy generation through a serving pair, and through the original decode step (the reference it must equal).

``PairRunner`` drives a written pair (its manifest, :mod:`k3opt.llm.manifest`)
in onnxruntime: the prefill on the left-padded prompt, then one decode step
per token over the fixed cache, the decode graph of the smallest batch size
that fits (rows are padded with copies of row 0 and dropped). The position of
a token is its cache slot; the mask ``[B, L]`` marks the prompt's padding
only, the graph hides the slots past ``position`` itself.

``original_greedy`` runs the decode-step export as its own loop from an empty
cache (``Concat``-grown), which is what the pair must reproduce token for token.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import onnx

from ..errors import InputError, UsageError
from .manifest import Manifest


def session(model: Any, threads: int = 1, evaluator: Optional[Callable[[onnx.ModelProto], Any]] = None) -> Any:
    """An onnxruntime session (one thread by default) for a path or ModelProto, or ``evaluator(model)``."""
    if evaluator is not None:
        return _Evaluated(evaluator(model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))))
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"], enable_fallback=0)


class _Evaluated:
    """onnx's ReferenceEvaluator behind onnxruntime's ``run(None, feeds)``."""

    def __init__(self, evaluator: Any) -> None:
        self.evaluator = evaluator

    def run(self, outputs: Any, feeds: dict) -> list:
        return self.evaluator.run(outputs, feeds)


def pick(logits: np.ndarray, top_k: int = 1, rng: Optional[np.random.Generator] = None) -> np.ndarray:
    """Next token per row of ``logits [B, V]``: argmax, or a sample of the ``top_k`` best (seeded ``rng``)."""
    if top_k <= 1:
        return logits.argmax(-1).astype(np.int64)
    best = np.argsort(-logits, axis=-1)[:, :top_k]
    scores = np.take_along_axis(logits, best, -1).astype(np.float64)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    rng = rng or np.random.default_rng(0)
    return np.array([row[rng.choice(top_k, p=p)] for row, p in zip(best, probs)], dtype=np.int64)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) ``[B, T]`` for token lists of any lengths, left-padded with ``pad_id``."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UsageError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(prompts), width), dtype=np.int64)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = p
        mask[row, width - len(p):] = 1
    return ids, mask


class PairRunner:
    """A written pair (folder with ``manifest.json``) loaded for generation."""

    def __init__(self, folder: Any, threads: int = 1,
                 evaluator: Optional[Callable[[onnx.ModelProto], Any]] = None, *,
                 manifest: Optional[Manifest] = None, open_graph: Optional[Callable[[str], Any]] = None) -> None:
        """``manifest`` and ``open_graph`` (graph file name -> object with ``run(None, feeds)``) stand in for the
        folder's own manifest and sessions (a pair split into pipeline stages: k3opt.llm.split_pair)."""
        self.folder = Path(folder)
        self.manifest = manifest or Manifest.read(self.folder)
        self._open = open_graph or (lambda name: session(self.folder / name, threads, evaluator))
        self.prefill = self._open(self.manifest.prefill)
        self._decode: dict[int, Any] = {}
        self.step_times: list[float] = []

    def decode(self, batch: int) -> tuple[int, Any]:
        """(graph batch size, session) of the smallest decode graph for ``batch`` rows."""
        size = self.manifest.decode_batch(batch)
        if size not in self._decode:
            self._decode[size] = self._open(self.manifest.decode[size])
        return size, self._decode[size]

    def generate(self, ids: np.ndarray, mask: np.ndarray, steps: int, top_k: int = 1,
                 seed: int = 0) -> np.ndarray:
        """``steps`` new tokens per row ``[B, steps]`` after the left-padded prompt ``ids``/``mask`` ``[B, T]``."""
        m = self.manifest
        batch, prompt = ids.shape
        if prompt + steps - 1 > m.max_seq:
            raise UsageError(f"{prompt} prompt tokens + {steps} new ones need {prompt + steps - 1} cache slots; "
                             f"the pair was built with --max-seq {m.max_seq}")
        size, dec = self.decode(batch)
        rng = np.random.default_rng(seed)
        start = time.perf_counter()
        outs = self.prefill.run(None, {m.ids: ids, m.mask: mask})
        self.step_times = [time.perf_counter() - start]
        token = pick(outs[0][:, -1], top_k, rng)
        tokens = [token]
        caches = [np.zeros((size, e.heads, m.max_seq, e.dim), dtype=m.np_dtype) for e in m.entries]
        for cache, present in zip(caches, outs[1:]):
            cache[:batch, :, :prompt] = present
            cache[batch:] = cache[:1]
        full = np.ones((size, m.max_seq), dtype=np.int64)
        full[:batch, :prompt] = mask
        full[batch:] = full[:1]
        for position in range(prompt, prompt + steps - 1):
            feed = np.concatenate([token, np.repeat(token[:1], size - batch)])[:, None]
            feeds = {m.ids: feed, m.mask: full, m.position: np.array([position], dtype=np.int64)}
            feeds.update({e.past: c for e, c in zip(m.entries, caches)})
            start = time.perf_counter()
            outs = dec.run(None, feeds)
            self.step_times.append(time.perf_counter() - start)
            caches = outs[1:]
            token = pick(outs[0][:batch, -1], top_k, rng)
            tokens.append(token)
        return np.stack(tokens, axis=1)


def original_greedy(model: Any, ids: np.ndarray, mask: np.ndarray, steps: int, threads: int = 1) -> np.ndarray:
    """``steps`` greedy tokens ``[B, steps]`` from the decode-step export run from an empty, Concat-grown cache."""
    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))
    from .cache_form import recognise

    layout = recognise(proto)
    sess = session(proto, threads)
    dtype = onnx.helper.tensor_dtype_to_np_dtype(layout.dtype)
    batch = ids.shape[0]
    feeds = {layout.ids: ids, layout.mask: mask}
    feeds.update({e.past: np.zeros((batch, e.heads, 0, e.dim), dtype=dtype) for e in layout.entries})
    outputs = [o.name for o in proto.graph.output]
    logits = next(o for o in outputs if o not in {e.present for e in layout.entries})
    tokens = []
    for _ in range(steps):
        outs = dict(zip(outputs, sess.run(None, feeds)))
        token = outs[logits][:, -1].argmax(-1).astype(np.int64)
        tokens.append(token)
        feeds = {layout.ids: token[:, None],
                 layout.mask: np.concatenate([feeds[layout.mask], np.ones((batch, 1), dtype=np.int64)], axis=1)}
        feeds.update({e.past: outs[e.present] for e in layout.entries})
    return np.stack(tokens, axis=1)


def check_prompt(ids: np.ndarray, vocab: Optional[int]) -> None:
    """Refuse token ids outside the vocabulary (a one-line error, not an onnxruntime index failure)."""
    if vocab is not None and ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise InputError(f"token ids must be in [0, {vocab}); got {int(ids.min())}..{int(ids.max())}")
