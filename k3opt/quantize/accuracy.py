"""What quantization did to a model's numbers, measured as a user would: the logits error against the
float model on the verification inputs, and the greedy-token agreement over generated tokens."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np
import onnx

from ..pipeline import verify

#: Prompt length of the greedy-token check.
PROMPT = 8


def _causal_lm(model: onnx.ModelProto) -> Optional[str]:
    """Why the greedy check does not apply (None: it does): one ``input_ids`` input, logits first output,
    and no past key/value inputs (each step reruns the whole sequence)."""
    inits = {t.name for t in model.graph.initializer}
    inputs = [i.name for i in model.graph.input if i.name not in inits]
    if "input_ids" not in inputs:
        return "no input_ids input"
    extra = set(inputs) - {"input_ids", "attention_mask", "position_ids"}
    if extra:
        return f"inputs besides input_ids/attention_mask/position_ids ({', '.join(sorted(extra)[:3])})"
    out = model.graph.output[0].type.tensor_type
    if len(out.shape.dim) != 3:
        return "the first output is not (batch, sequence, vocabulary) logits"
    return None


def _feeds(names: list[str], ids: np.ndarray) -> dict[str, np.ndarray]:
    feeds = {"input_ids": ids}
    if "attention_mask" in names:
        feeds["attention_mask"] = np.ones_like(ids)
    if "position_ids" in names:
        feeds["position_ids"] = np.arange(ids.shape[1], dtype=np.int64)[None].repeat(ids.shape[0], 0)
    return feeds


def measure(original: Path, quantized: Path, tokens: int = 16, seed: int = 0) -> dict[str, Any]:
    """``{"logits": {max_abs, rel}, "tokens": {agreement, count}}`` (or a ``skipped`` reason for either).

    Both files are run by onnxruntime (its optimizations off). The token check generates ``tokens``
    tokens greedily with the float model from a seeded random prompt, then asks the quantized one for its
    choice at each of those steps on the same prefix: the fraction it agrees on.
    """
    result: dict[str, Any] = {}
    need = sum(p.stat().st_size + (Path(str(p) + ".data").stat().st_size if Path(str(p) + ".data").exists() else 0)
               for p in (original, quantized))
    if 3 * need > verify.available_memory():
        return {"skipped": f"the two models ({need / 2**20:.0f} MB) would not fit in free memory three times"}
    try:
        fs, qs = verify.session(original), verify.session(quantized)
    except verify.Unrunnable as exc:
        return {"skipped": str(exc)}
    model = onnx.load(str(original), load_external_data=False)
    feeds = dict(verify.make_feeds(model, seed=seed, run=lambda f: verify.run(fs, f)))
    ref, got = verify.run(fs, feeds), verify.run(qs, feeds)
    worst = max(range(len(ref)), key=lambda i: float(np.abs(ref[i].astype(np.float64)).max(initial=0)))
    r, q = ref[worst].astype(np.float64), got[worst].astype(np.float64)
    result["logits"] = {"output": fs.get_outputs()[worst].name, "max_abs": float(np.abs(r - q).max(initial=0)),
                        "rel": float(np.linalg.norm(r - q) / max(np.linalg.norm(r), 1e-30))}
    why = _causal_lm(model)
    if why is not None or tokens <= 0:
        result["tokens"] = {"skipped": why or "no tokens asked"}
        return result
    names = [i.name for i in fs.get_inputs()]
    vocab = fs.run(None, _feeds(names, np.zeros((1, 1), np.int64)))[0].shape[-1]
    limit = verify._index_limits(model.graph).get("input_ids", vocab)
    ids = np.random.default_rng(seed).integers(0, min(vocab, limit), (1, PROMPT), dtype=np.int64)
    for _ in range(tokens):
        step = fs.run(None, _feeds(names, ids))[0]
        ids = np.concatenate([ids, step[:, -1:].argmax(-1).astype(np.int64)], axis=1)
    q_logits = qs.run(None, _feeds(names, ids[:, :-1]))[0]
    chosen = q_logits[0, PROMPT - 1:].argmax(-1)
    agree = float(np.mean(chosen == ids[0, PROMPT:]))
    result["tokens"] = {"agreement": agree, "count": tokens}
    return result


def lines(measured: dict[str, Any]) -> list[str]:
    """The report lines of :func:`measure`'s result."""
    if "skipped" in measured:
        return [f"accuracy not measured: {measured['skipped']}"]
    lo = measured["logits"]
    out = [f"logits error vs float ({lo['output']}): max abs {lo['max_abs']:.3g}, relative {lo['rel']:.3g}"]
    tk = measured["tokens"]
    out.append(f"greedy-token agreement: not measured ({tk['skipped']})" if "skipped" in tk else
               f"greedy-token agreement: {tk['agreement']:.1%} of {tk['count']} generated tokens")
    return out
