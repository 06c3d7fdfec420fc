"""A Kimi-K2-architecture model (DeepSeek-V3: MLA attention + MoE with shared and routed experts), end to end.

Small random-weight version of the Kimi K2 layout (no download): exported
with k3opt.export, optimized and verified, lowered for Ascend with
``k3opt optimize --target cann`` and checked for ATC with ``k3opt check
--target cann``, then compiled with ``k3opt compile --dry-run`` (prints the
ATC command; drop --dry-run on a machine with CANN)::

    python examples/kimi_k2_compile.py --out-dir build/ [--exporter dynamo]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

SEQ = 8


def kimi_k2_config(vocab_size: int = 256):
    """Kimi K2's layout scaled down: 1 dense layer then MoE, MLA with q/kv LoRA ranks, 1 shared expert, top-2."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, head_dim=8,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        routed_scaling_factor=2.827, max_position_embeddings=128, use_cache=False, tie_word_embeddings=False,
    )


def k3opt_cli(*args: str) -> subprocess.CompletedProcess:
    """Run the ``k3opt`` command line (as a user would) and echo what it prints."""
    proc = subprocess.run([sys.executable, "-m", "k3opt", *args], capture_output=True, text=True)
    print(f"$ k3opt {' '.join(args)}\n{proc.stdout}{proc.stderr}".rstrip())
    return proc


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default="build/kimi_k2", type=Path)
    parser.add_argument("--exporter", choices=["torchscript", "dynamo"], default="torchscript")
    parser.add_argument("--soc-version", default="Ascend910B3")
    args = parser.parse_args(argv)

    from k3opt.export import from_transformers

    args.out_dir.mkdir(parents=True, exist_ok=True)
    onnx_path = args.out_dir / "kimi_k2.onnx"
    report = from_transformers(kimi_k2_config(), onnx_path, task="text-generation", seq_len=SEQ,
                               exporter=args.exporter, verify=True)
    print(report.table())

    shapes = ["--input-shape", f"input_ids:1,{SEQ}", "--input-shape", f"attention_mask:1,{SEQ}"]
    cann_path = args.out_dir / "kimi_k2_cann.onnx"
    if k3opt_cli("optimize", str(onnx_path), "--target", "cann", "-o", str(cann_path), "--overwrite").returncode != 0:
        return 1
    if k3opt_cli("check", "--target", "cann", str(cann_path), *shapes).returncode != 0:
        return 1
    compiled = k3opt_cli("compile", str(onnx_path), "--soc-version", args.soc_version,
                         "-o", str(args.out_dir / "kimi_k2_npu"), "--dry-run", *shapes)
    return compiled.returncode


if __name__ == "__main__":
    sys.exit(main())
