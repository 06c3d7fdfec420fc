"""BERT exported with the TorchScript exporter at opset 14, then optimized by k3opt.

The TorchScript exporter writes every LayerNorm as ReduceMean/Sub/Pow/
ReduceMean/Add/Sqrt/Div/Mul/Add; k3opt raises the opset to 17 and fuses
each back into one LayerNormalization (and the biased projections into Gemm),
verifying the outputs in onnxruntime::

    python examples/bert_opset14.py --out bert.onnx [--exporter dynamo]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence


def tiny_bert():
    """A small BERT encoder with random weights (seed 0): 2 layers, hidden 64."""
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=128)
    return BertModel(config).eval()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="build/bert.onnx", type=Path)
    parser.add_argument("--exporter", choices=["torchscript", "dynamo"], default="torchscript")
    args = parser.parse_args(argv)

    from k3opt.export import from_transformers

    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = from_transformers(tiny_bert(), args.out, task="feature-extraction", exporter=args.exporter,
                               opset=14 if args.exporter == "torchscript" else None, verify=True)
    print(report.table())
    fused = report.after.ops.get("LayerNormalization", 0)
    print(f"opset {report.before.opset} -> {report.after.opset}; {fused} LayerNormalization node(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
