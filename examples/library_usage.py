"""k3opt inside an export script you already have: two added lines after ``torch.onnx.export``.

The first half is a typical hand-written export of a (here tiny, random)
GPT-2; the second half is all k3opt needs: optimize the file with
verification, or optimize a ModelProto in memory::

    python examples/library_usage.py --out-dir build/ [--exporter dynamo]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence


def tiny_gpt2():
    """A small GPT-2 with random weights (seed 0)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                      use_cache=False)).eval()


def export_gpt2(path: Path, exporter: str) -> None:
    """The export script as users write it: build the model, wrap it to return logits, torch.onnx.export."""
    import torch

    model = tiny_gpt2()

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    ids = torch.randint(0, 256, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.int64)
    mask[1, -1] = 0  # a padded example keeps the mask in the TorchScript trace
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"}}
    with torch.no_grad():
        if exporter == "dynamo":
            batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence")
            torch.onnx.export(Logits(), (ids, mask), str(path), dynamo=True,
                              input_names=["input_ids", "attention_mask"], output_names=["logits"],
                              dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}))
        else:
            torch.onnx.export(Logits(), (ids, mask), str(path), dynamo=False, opset_version=14,
                              input_names=["input_ids", "attention_mask"], output_names=["logits"], dynamic_axes=axes)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default="build/gpt2", type=Path)
    parser.add_argument("--exporter", choices=["torchscript", "dynamo"], default="torchscript")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    exported = args.out_dir / "gpt2.onnx"
    export_gpt2(exported, args.exporter)

    # --- k3opt as a library -------------------------------------------------
    import onnx

    import k3opt

    report = k3opt.optimize_file(exported, args.out_dir / "gpt2.k3opt.onnx", verify=True)  # file to file
    print(report.table())
    in_memory = k3opt.optimize(onnx.load(exported), skip=["merge-sibling-matmuls"])  # ModelProto to ModelProto
    print(f"in memory: {len(in_memory.graph.node)} nodes (from {report.before.nodes})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
