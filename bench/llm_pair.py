"""Serving-pair latency: the static decode graph against the Concat-grown decode step, and the prefill's lm_head.

``python -m bench.llm_pair [--models llama,qwen2,gpt2,deepseek_v3] [--max-seq 512] [--position 480]
[--prompt 480] [--rounds 15] [--runs 20] [--hidden 256] [--vocab 8192] [--out DIR]``

Per model (a transformers config of ``--hidden`` and ``--vocab``, two layers, seeded random weights each
perturbed so that no norm scale is 1 and no bias 0; exported by ``k3opt.export.from_transformers(use_cache=True)``,
cached in ``$K3OPT_BENCH_CACHE/llm``), in onnxruntime CPU with one thread, ORT_ENABLE_ALL, in one process with
the sessions' runs interleaved round by round:

- **decode**: one token at cache position ``--position`` of ``--max-seq``: the pair's ``decode_b1`` (fixed
  cache, ScatterElements write) against the export's own step with a past of ``--position`` tokens, as
  exported (``concat``) and optimized by k3opt (``concat-k3opt``). Figure: the median over rounds of
  pair / concat within a round (goal: <= 1, issue #30);
- **prefill**: a ``--prompt``-token prompt: the pair's prefill (lm_head on the last row) against the step
  with an empty past (every row's logits); figure: the same per-round median ratio, and the lm_head rows
  each computes.

Results: a markdown table on stdout and ``results.json`` in ``--out`` (default
``$K3OPT_BENCH_CACHE/llm/results/<time>``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx

from .models import CACHE

FAMILIES = ("llama", "qwen2", "gpt2", "deepseek_v3")


def config(family: str, hidden: int, vocab: int, max_seq: int) -> Any:
    """A two-layer transformers config of ``family`` (GQA 2 KV heads for 4 where the family has it)."""
    import transformers as tf

    heads = 4
    common = dict(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=heads, intermediate_size=2 * hidden,
                  vocab_size=vocab, max_position_embeddings=max(2048, max_seq), tie_word_embeddings=False)
    if family == "llama":
        return tf.LlamaConfig(num_key_value_heads=2, **common)
    if family == "qwen2":
        return tf.Qwen2Config(num_key_value_heads=2, **common)
    if family == "gpt2":
        return tf.GPT2Config(n_embd=hidden, n_layer=2, n_head=heads, vocab_size=vocab, n_positions=max(1024, max_seq))
    if family == "deepseek_v3":
        d = hidden // heads
        return tf.DeepseekV3Config(num_key_value_heads=heads, q_lora_rank=hidden // 2, kv_lora_rank=hidden // 4,
                                   qk_nope_head_dim=d, qk_rope_head_dim=d // 2, v_head_dim=d, head_dim=d // 2,
                                   n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=2,
                                   topk_group=1, first_k_dense_replace=1, moe_intermediate_size=hidden // 2, **common)
    raise SystemExit(f"unknown model {family!r}; choose from {', '.join(FAMILIES)}")


def model(family: str, hidden: int, vocab: int, max_seq: int) -> Any:
    """The seeded random-weight model of ``family``, every weight perturbed (as tests/zoo.py does).

    transformers initializes norm scales to 1 and biases to 0; k3opt drops a Mul by 1 or an Add of 0, which
    stops onnxruntime fusing the norm (its SimplifiedLayerNormalization needs the scale's Mul): a trained
    model has neither, so the benchmark's must not either.
    """
    import torch
    import transformers as tf

    torch.manual_seed(0)
    hf = tf.AutoModelForCausalLM.from_config(config(family, hidden, vocab, max_seq)).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return hf


def decode_step(family: str, hidden: int, vocab: int, max_seq: int) -> Path:
    """The cached decode-step export of ``family`` (exported on first use)."""
    from k3opt.export import from_transformers

    path = CACHE / "llm" / f"{family}-h{hidden}-v{vocab}-s{max_seq}-w1.onnx"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.onnx")
        from_transformers(model(family, hidden, vocab, max_seq), tmp, use_cache=True, seq_len=3, optimize=False)
        tmp.replace(path)
    return path


def session(model: Any) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def interleaved(runs: dict[str, Callable[[], Any]], rounds: int, per_round: int) -> dict[str, list[float]]:
    """Seconds per call of each callable in each of ``rounds`` rounds of ``per_round`` calls, in rotating order."""
    times: dict[str, list[float]] = {k: [] for k in runs}
    names = list(runs)
    for fn in runs.values():
        fn()  # warm-up
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            for _ in range(per_round):
                runs[name]()
            times[name].append((time.perf_counter() - start) / per_round)
    return times


def ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    """The median over rounds of ``a``'s time / ``b``'s in the same round: a load burst on the shared machine
    slows both sides of a round, so it cancels where a ratio of medians would keep it."""
    return float(np.median(np.array(times[a]) / np.array(times[b])))


def medians_ms(times: dict[str, list[float]]) -> dict[str, float]:
    return {k: float(np.median(v)) * 1e3 for k, v in times.items()}


def measure(family: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import k3opt
    from k3opt.llm import build_pair, recognise

    step_path = decode_step(family, args.hidden, args.vocab, args.max_seq)
    step = onnx.load(str(step_path))
    layout = recognise(step)
    pair = out / f"{family}-pair"
    build_pair(step, pair, max_seq=args.max_seq, max_batch=1, overwrite=True)
    rng = np.random.default_rng(0)
    pos = args.position
    dtype = np.float32
    past = {e.past: rng.standard_normal((1, e.heads, pos, e.dim)).astype(dtype) for e in layout.entries}
    token = np.array([[7]], dtype=np.int64)
    concat_feeds = {"input_ids": token, "attention_mask": np.ones((1, pos + 1), np.int64), **past}
    cache = {k: np.concatenate([v, np.zeros(v.shape[:2] + (args.max_seq - pos,) + v.shape[3:], dtype)], 2)
             for k, v in past.items()}
    pair_feeds = {"input_ids": token, "attention_mask": np.ones((1, args.max_seq), np.int64),
                  "position": np.array([pos], np.int64), **cache}
    optimized = k3opt.optimize(step)
    concat, concat_opt = session(step), session(optimized)
    decode = session(pair / "decode_b1.onnx")
    want = concat.run(None, concat_feeds)[0]
    got = decode.run(None, pair_feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    dec = interleaved({"pair": lambda: decode.run(None, pair_feeds), "concat": lambda: concat.run(None, concat_feeds),
                       "concat-k3opt": lambda: concat_opt.run(None, concat_feeds)}, args.rounds, args.runs)
    prompt = rng.integers(1, args.vocab, (1, args.prompt)).astype(np.int64)
    empty = {e.past: np.zeros((1, e.heads, 0, e.dim), dtype) for e in layout.entries}
    full_feeds = {"input_ids": prompt, "attention_mask": np.ones_like(prompt), **empty}
    prefill = session(pair / "prefill.onnx")
    pre_out = prefill.run(None, {"input_ids": prompt, "attention_mask": np.ones_like(prompt)})[0]
    full_out = concat.run(None, full_feeds)[0]
    np.testing.assert_allclose(pre_out[:, -1], full_out[:, -1], rtol=1e-4, atol=1e-4)
    pre = interleaved({"pair": lambda: prefill.run(None, {"input_ids": prompt, "attention_mask": np.ones_like(prompt)}),
                       "concat": lambda: concat.run(None, full_feeds)}, args.rounds, max(1, args.runs // 4))
    return {"model": family, "decode_ms": medians_ms(dec), "decode_ratio": ratio(dec, "pair", "concat"),
            "decode_ratio_k3opt": ratio(dec, "pair", "concat-k3opt"), "prefill_ms": medians_ms(pre),
            "prefill_ratio": ratio(pre, "pair", "concat"),
            "lm_head_rows": {"pair": int(pre_out.shape[1]), "concat": int(full_out.shape[1])}}


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"decode: one token at position {args.position} of {args.max_seq}; prefill: {args.prompt} tokens; "
             "onnxruntime CPU, 1 thread, ORT_ENABLE_ALL; medians in ms; ratio = median over rounds of pair / Concat step "
             "in the same round", "",
             "| model | decode pair | decode concat | concat (k3opt) | ratio | ratio vs k3opt | prefill pair | "
             "prefill concat | ratio | lm_head rows |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d, p = r["decode_ms"], r["prefill_ms"]
        lines.append(f"| {r['model']} | {d['pair']:.3f} | {d['concat']:.3f} | {d['concat-k3opt']:.3f} | "
                     f"{r['decode_ratio']:.2f} | {r['decode_ratio_k3opt']:.2f} | {p['pair']:.2f} | {p['concat']:.2f} | "
                     f"{r['prefill_ratio']:.2f} | {r['lm_head_rows']['pair']} vs {r['lm_head_rows']['concat']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="python -m bench.llm_pair", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(FAMILIES))
    parser.add_argument("--max-seq", type=int, default=512)
    parser.add_argument("--position", type=int, default=480)
    parser.add_argument("--prompt", type=int, default=480)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--runs", type=int, default=20, help="calls per round (decode; prefill a quarter)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not 0 < args.position < args.max_seq or not 0 < args.prompt <= args.max_seq:
        parser.error("need 0 < --position < --max-seq and 0 < --prompt <= --max-seq")
    out = args.out or CACHE / "llm" / "results" / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        rows = [measure(m.strip(), args, Path(tmp)) for m in args.models.split(",") if m.strip()]
    (out / "results.json").write_text(json.dumps({"args": vars(args) | {"out": str(out)}, "rows": rows}, indent=1))
    print(markdown(rows, args))
    return rows


if __name__ == "__main__":
    main()
