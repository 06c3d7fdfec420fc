"""Peak memory of ``k3opt optimize`` with verification on (issue #26 item 9), against ``--no-verify`` and
onnxslim, on a 12-layer Llama of about 258 MB (fp32, random weights, TorchScript export via k3opt.export).

    python -m bench.memory_verify                 # build (cached) and measure: k3opt, k3opt --no-verify, onnxslim
    python -m bench.memory_verify --rounds 3      # more runs of each (the medians are reported)
    python -m bench.memory_verify --model m.onnx  # another model

Each figure is a fresh child process's peak RSS (the kernel's VmHWM, which exec resets; bench/procs.py),
reported in MB and as a multiple of the model's bytes (the goal: the default run under 3x).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from bench.models import CACHE, _logits_only
from bench.procs import memory_mb, run_measured

#: ~258 MB of fp32 weights in 12 layers (vocab 25000 x hidden 512 twice, 3.2 M per layer).
LLAMA_12 = dict(vocab_size=25000, hidden_size=512, intermediate_size=1408, num_attention_heads=8,
                num_key_value_heads=8, max_position_embeddings=512, num_hidden_layers=12)
RUNS = {
    "k3opt": ["k3opt", "-q"],
    "k3opt --no-verify": ["k3opt", "-q", "--no-verify"],
    "onnxslim": ["onnxslim"],
}


def build(path: Path) -> Path:
    """Export the 12-layer Llama to ``path`` (once: the file is cached)."""
    if path.exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from k3opt.export import export_onnx

    torch.manual_seed(0)
    cfg = LlamaConfig(**LLAMA_12)
    cfg.use_cache = False
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 16))
    mask = torch.ones(1, 16, dtype=torch.int64)
    dyn = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"}}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.onnx")
    with torch.no_grad():
        export_onnx(_logits_only(model), (ids, mask), tmp, input_names=list(dyn), output_names=["logits"],
                    dynamic_axes=dyn, exporter="torchscript", opset=17)
    os.replace(tmp, path)
    return path


def child(tool: str, src: str, dst: str, flags: list[str]) -> None:
    """Optimize ``src`` into ``dst`` in this process, then report this process's peak RSS."""
    if tool == "k3opt":
        from k3opt.cli import main

        try:
            main(["optimize", src, dst, *flags], prog_name="k3opt")
        except SystemExit as exc:
            if exc.code:
                raise
    else:
        import onnxslim

        onnxslim.slim(src, dst)
    with open(os.environ["BENCH_RESULT"], "w") as f:
        json.dump({"vmhwm_mb": memory_mb()[1]}, f)


def measure(model: Path, rounds: int) -> dict[str, list[float]]:
    """Peak RSS (MB) of each of :data:`RUNS` on ``model``, ``rounds`` times, interleaved."""
    peaks: dict[str, list[float]] = {name: [] for name in RUNS}
    out = model.with_name("out.onnx")
    for _ in range(rounds):
        for name, (tool, *flags) in RUNS.items():
            cmd = [sys.executable, "-m", "bench.memory_verify", "--child", tool, str(model), str(out), *flags]
            result = run_measured(cmd, timeout_s=1800)
            if result.status != "ok":
                raise SystemExit(f"{name}: {result.status}: {result.error}")
            peaks[name].append(result.peak_rss_mb)
    out.unlink(missing_ok=True)
    return peaks


def table(model: Path, peaks: dict[str, list[float]]) -> str:
    """The markdown table: median peak RSS of each run and its multiple of the model's bytes."""
    size_mb = model.stat().st_size / 2**20
    lines = [f"model: {model.name}, {size_mb:.0f} MB", "", "| run | peak RSS MB (median) | x model bytes | runs |",
             "|---|---|---|---|"]
    for name, values in peaks.items():
        median = statistics.median(values)
        lines.append(f"| {name} | {median:.0f} | {median / size_mb:.2f} | {', '.join(f'{v:.0f}' for v in values)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="measure this model instead of the 12-layer Llama")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        tool, src, dst, *flags = args.child
        return child(tool, src, dst, flags)
    model = args.model or build(CACHE / "models" / "llama12-258mb" / "model.onnx")
    print(table(model, measure(model, args.rounds)))


if __name__ == "__main__":
    main()
