"""Weight-only quantization, measured: size, decode latency and perplexity on real text, side by side with
onnxruntime's ``MatMulNBitsQuantizer`` at the same bits and group size, in one run.

``python -m bench.quant_eval [--steps 600] [--rounds 7] [--out DIR]``

1. **Accuracy on real text (no download).** A byte-level Llama (vocabulary 256, hidden 256, 2 layers) is
   trained in-process for ``--steps`` steps on Python standard-library source that ships with the
   interpreter (``Lib/*.py``, a fixed file list); the held-out text is other stdlib files. It is exported
   (TorchScript, no cache), quantized by k3opt (int8 per-channel, int4 g128; round-to-nearest, and GPTQ
   calibrated on windows of the training text) and by onnxruntime's
   quantizer (int8 and int4 g128, block-wise, QOperator MatMulNBits), and each is scored on the held-out
   text: perplexity (exp of the mean next-byte cross-entropy) and next-token agreement with the float
   model (the fraction of positions whose argmax matches). The trained model is kept in the cache and reused
   (``--retrain`` trains again).
2. **Size and decode latency.** A Llama with a vocabulary of 128 (the blocks dominate: hidden 1024,
   intermediate 2816, 4 layers, random seeded weights) exported as one decode step with a KV cache:
   file sizes of fp32 / k3opt int8 / k3opt int4 g128 / ORT int4 g128, and onnxruntime CPU latency,
   one thread, ORT_ENABLE_ALL, of one token after a 511-token cache: interleaved rounds in this process,
   the median per model.

Results go to ``--out`` (default ``~/.cache/k3opt-bench/quant/<time>``) as results.json and results.md.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import sysconfig
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx

CACHE = Path.home() / ".cache" / "k3opt-bench" / "quant"
#: The trained model: bytes in, bytes out.
TEXT_CONFIG = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
#: The decode-latency model: a vocabulary of 128 so the blocks dominate.
DECODE_CONFIG = dict(vocab_size=128, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                     num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=1024)
TRAIN_FILES = ("argparse.py", "typing.py", "inspect.py", "collections/__init__.py", "pathlib.py", "dataclasses.py",
               "functools.py", "subprocess.py", "tarfile.py", "zipfile.py")
HELD_OUT_FILES = ("shutil.py", "textwrap.py")
SEQ, PAST = 128, 511
#: Training-text windows of SEQ bytes given to GPTQ as calibration inputs.
CALIBRATION_SAMPLES = 64


def stdlib_text(names: tuple[str, ...]) -> bytes:
    lib = Path(sysconfig.get_paths()["stdlib"])
    return b"\n".join((lib / n).read_bytes() for n in names)


def train(steps: int, seed: int = 0) -> Any:
    """A byte-level Llama trained on the stdlib files (seeded; a minute or two on two cores)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    data = torch.tensor(list(stdlib_text(TRAIN_FILES)), dtype=torch.long)
    model = LlamaForCausalLM(LlamaConfig(**TEXT_CONFIG, tie_word_embeddings=False, use_cache=False))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(data) - SEQ - 1, (16,), generator=gen)
        batch = torch.stack([data[s:s + SEQ + 1] for s in starts])
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1].clone()).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    return model


def score(path: Path, text: bytes, reference: list | None = None) -> tuple[float, float, list, np.ndarray]:
    """(perplexity, agreement with ``reference`` argmaxes, this model's argmaxes, each window's mean
    next-byte NLL) over the held-out bytes."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    ids = np.frombuffer(text, np.uint8).astype(np.int64)
    nll, count, choices, windows = 0.0, 0, [], []
    for start in range(0, len(ids) - SEQ - 1, SEQ):
        window = ids[start:start + SEQ + 1]
        feeds = {"input_ids": window[None, :-1]}
        if "attention_mask" in names:
            feeds["attention_mask"] = np.ones_like(feeds["input_ids"])
        logits = sess.run(None, feeds)[0][0].astype(np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        windows.append(-logp[np.arange(SEQ), window[1:]].mean())
        nll -= logp[np.arange(SEQ), window[1:]].sum()
        count += SEQ
        choices.append(logits.argmax(-1))
    agree = 1.0 if reference is None else float(np.mean(np.concatenate(choices) == np.concatenate(reference)))
    return math.exp(nll / count), agree, choices, np.array(windows)


def paired(mine: np.ndarray, theirs: np.ndarray) -> dict[str, float]:
    """Perplexity ratio of two models over the same windows, with the ratio at -2 and +2 standard errors of the
    mean per-window NLL difference: an interval that excludes 1 is a measured difference, not noise."""
    d = mine - theirs
    se = float(d.std(ddof=1) / math.sqrt(len(d)))
    return {"ratio": math.exp(d.mean()), "low": math.exp(d.mean() - 2 * se), "high": math.exp(d.mean() + 2 * se)}


def ort_quantize(src: Path, dst: Path, bits: int, block: int) -> None:
    """onnxruntime's own weight-only quantizer (MatMulNBits), every MatMul but the lm_head as k3opt's default."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = onnx.load(str(src))
    head = [n.name for n in model.graph.node if n.op_type == "MatMul" and n.output[0] == model.graph.output[0].name
            or n.op_type == "MatMul" and "lm_head" in n.name]
    q = MatMulNBitsQuantizer(model, bits=bits, block_size=block, is_symmetric=False, nodes_to_exclude=head)
    q.process()
    q.model.save_model_to_file(str(dst), use_external_data_format=False)


def calibration_data(model: Path, samples: int = CALIBRATION_SAMPLES, seed: int = 1) -> dict[str, np.ndarray]:
    """``samples`` random windows of the training text (never the held-out files), as the model's inputs."""
    data = np.frombuffer(stdlib_text(TRAIN_FILES), np.uint8).astype(np.int64)
    starts = np.random.default_rng(seed).integers(0, len(data) - SEQ, samples)
    ids = np.stack([data[s:s + SEQ] for s in starts])
    names = [i.name for i in onnx.load(str(model), load_external_data=False).graph.input]
    return {"input_ids": ids, **({"attention_mask": np.ones_like(ids)} if "attention_mask" in names else {})}


def k3opt_quantize(src: Path, dst: Path, weights: str, group: int | None, clip: bool = True,
                   calibration: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    from k3opt.quantize import quantize_file

    t0 = time.time()
    report = quantize_file(src, dst, weights=weights, group_size=group, overwrite=True, tokens=0, clip=clip,
                           calibration=calibration)
    return {"worst_weight_error": max(report.layers.values()), "layers": len(report.layers),
            "seconds": time.time() - t0}


def trained_model(folder: Path, steps: int, retrain: bool = False) -> tuple[Path, float]:
    """The trained LM exported to ONNX, and the seconds its training took: kept in ``folder`` per step count and
    configuration (with its training time beside it), so the quantizers can be compared again without training
    again (``--retrain`` trains anyway)."""
    from k3opt.export import from_transformers

    key = hashlib.sha1(repr((TEXT_CONFIG, TRAIN_FILES, SEQ, steps)).encode()).hexdigest()[:8]
    fp32, took = folder / f"text-fp32-{steps}steps-{key}.onnx", folder / f"text-fp32-{steps}steps-{key}.seconds"
    if retrain or not (fp32.exists() and took.exists()):
        t0 = time.time()
        model = train(steps)
        took.unlink(missing_ok=True)
        from_transformers(model, fp32, seq_len=16, optimize=False, verify=False)
        took.write_text(f"{time.time() - t0:.1f}")
    return fp32, float(took.read_text())


def accuracy(folder: Path, steps: int, retrain: bool = False) -> dict[str, Any]:
    fp32, trained = trained_model(folder, steps, retrain)
    held = stdlib_text(HELD_OUT_FILES)
    calibration = calibration_data(fp32)
    variants: dict[str, Callable[[Path], Any]] = {
        "k3opt int8": lambda p: k3opt_quantize(fp32, p, "int8", None),
        "k3opt int4 g128": lambda p: k3opt_quantize(fp32, p, "int4", 128),
        "k3opt int4 g128 no clip search": lambda p: k3opt_quantize(fp32, p, "int4", 128, clip=False),
        "k3opt int8 GPTQ": lambda p: k3opt_quantize(fp32, p, "int8", None, calibration=calibration),
        "k3opt int4 g128 GPTQ": lambda p: k3opt_quantize(fp32, p, "int4", 128, calibration=calibration),
        "ort int8 g128": lambda p: ort_quantize(fp32, p, 8, 128),
        "ort int4 g128": lambda p: ort_quantize(fp32, p, 4, 128),
    }
    base_ppl, _, base_choices, _ = score(fp32, held)
    rows = {"fp32": {"ppl": base_ppl, "ppl_ratio": 1.0, "agreement": 1.0}}
    windows = {}
    for name, make in variants.items():
        path = folder / f"text-{name.replace(' ', '-')}.onnx"
        extra = make(path) or {}
        ppl, agree, _, windows[name] = score(path, held, base_choices)
        rows[name] = {"ppl": ppl, "ppl_ratio": ppl / base_ppl, "agreement": agree, **extra}
    for name in variants:
        if name.startswith("k3opt"):
            rows[name]["vs_ort"] = paired(windows[name], windows[f"ort int{name.split('int')[1][0]} g128"])
    return {"train_seconds": trained, "steps": steps, "held_out_bytes": len(held), "rows": rows,
            "calibration_samples": len(calibration["input_ids"])}


def decode_feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    cfg = DECODE_CONFIG
    rng = np.random.default_rng(0)
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    feeds = {}
    for i in model.graph.input:
        if i.name == "input_ids":
            feeds[i.name] = np.array([[7]], np.int64)
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((1, PAST + 1), np.int64)
        elif i.name == "position_ids":
            feeds[i.name] = np.array([[PAST]], np.int64)
        else:
            feeds[i.name] = rng.standard_normal((1, cfg["num_key_value_heads"], PAST, head_dim)).astype(np.float32)
    return feeds


def latency(paths: dict[str, Path], rounds: int, runs: int = 20) -> dict[str, float]:
    """Median seconds of one decode step per model: interleaved rounds, one thread, ORT_ENABLE_ALL."""
    import onnxruntime as ort

    sessions, feeds = {}, {}
    for name, path in paths.items():
        so = ort.SessionOptions()
        so.intra_op_num_threads = so.inter_op_num_threads = 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        sessions[name] = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        feeds[name] = decode_feeds(onnx.load(str(path), load_external_data=False))
        for _ in range(3):
            sessions[name].run(None, feeds[name])
    times: dict[str, list[float]] = {n: [] for n in paths}
    for r in range(rounds):
        order = list(paths)[r % len(paths):] + list(paths)[:r % len(paths)]
        for name in order:
            t = time.perf_counter()
            for _ in range(runs):
                sessions[name].run(None, feeds[name])
            times[name].append((time.perf_counter() - t) / runs)
    return {n: float(np.median(v)) for n, v in times.items()}


def size_and_speed(folder: Path, rounds: int) -> dict[str, Any]:
    from transformers import LlamaConfig

    from k3opt import optimize_file
    from k3opt.export import from_transformers

    raw = folder / "decode-raw.onnx"
    if not raw.exists():
        from_transformers(LlamaConfig(**DECODE_CONFIG, tie_word_embeddings=False), raw, use_cache=True,
                          seq_len=4, optimize=False, verify=False)
    fp32 = folder / "decode-fp32.onnx"
    optimize_file(raw, fp32, overwrite=True)
    paths = {"fp32 (k3opt)": fp32}
    for name, weights, group in (("k3opt int8", "int8", None), ("k3opt int4 g128", "int4", 128)):
        paths[name] = folder / f"decode-{name.replace(' ', '-')}.onnx"
        k3opt_quantize(fp32, paths[name], weights, group)
    paths["ort int4 g128"] = folder / "decode-ort-int4.onnx"
    ort_quantize(fp32, paths["ort int4 g128"], 4, 128)

    def size(p: Path) -> int:
        data = Path(str(p) + ".data")
        return p.stat().st_size + (data.stat().st_size if data.exists() else 0)

    sizes = {n: size(p) for n, p in paths.items()}
    lat = latency(paths, rounds)
    return {"sizes": sizes, "size_ratio": {n: s / sizes["fp32 (k3opt)"] for n, s in sizes.items()},
            "latency_s": lat, "latency_vs_fp32": {n: v / lat["fp32 (k3opt)"] for n, v in lat.items()},
            "int4_vs_ort_int4": lat["k3opt int4 g128"] / lat["ort int4 g128"]}


def markdown(res: dict[str, Any]) -> str:
    acc, sp = res["accuracy"], res["decode"]
    lines = [f"## Quantization ({res['time']})", "",
             f"Byte-level Llama trained {acc['steps']} steps ({acc['train_seconds']:.0f} s) on stdlib source; "
             f"held-out {acc['held_out_bytes']} bytes of {', '.join(HELD_OUT_FILES)}; GPTQ calibrated on "
             f"{acc['calibration_samples']} windows of {SEQ} training bytes.", "",
             "| model | perplexity | vs fp32 | next-token agreement | vs onnxruntime's, same bits (-2 SE, +2 SE) |",
             "|---|---|---|---|---|"]
    for name, row in acc["rows"].items():
        vs = row.get("vs_ort")
        lines.append(f"| {name} | {row['ppl']:.4f} | {row['ppl_ratio']:.4f}x | {row['agreement']:.2%} | "
                     + (f"{vs['ratio']:.5f}x ({vs['low']:.5f}, {vs['high']:.5f}) |" if vs else "|"))
    lines += ["", f"Decode model (vocabulary 128, hidden {DECODE_CONFIG['hidden_size']}, "
              f"{DECODE_CONFIG['num_hidden_layers']} layers), one token after {PAST}, one thread, ORT_ENABLE_ALL:", "",
              "| model | size | size vs fp32 | latency | vs fp32 |", "|---|---|---|---|---|"]
    for name in sp["sizes"]:
        lines.append(f"| {name} | {sp['sizes'][name] / 2**20:.1f} MiB | {sp['size_ratio'][name]:.3f}x | "
                     f"{sp['latency_s'][name] * 1e3:.2f} ms | {sp['latency_vs_fp32'][name]:.3f}x |")
    lines += ["", f"k3opt int4 g128 / onnxruntime's MatMulNBits int4 g128: {sp['int4_vs_ort_int4']:.3f}x", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--retrain", action="store_true", help="train the text model again even if one is kept")
    args = ap.parse_args(argv)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = args.out or CACHE / stamp
    out.mkdir(parents=True, exist_ok=True)
    models = CACHE / "models"
    models.mkdir(parents=True, exist_ok=True)
    res = {"time": stamp, "decode": size_and_speed(models, args.rounds), "accuracy": accuracy(models, args.steps, args.retrain)}
    (out / "results.json").write_text(json.dumps(res, indent=2))
    (out / "results.md").write_text(markdown(res))
    print(markdown(res))
    return res


if __name__ == "__main__":
    main()
