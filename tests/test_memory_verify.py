"""Issue #26 item 9: the default run (verification on) stays under 3x the model's bytes in peak memory.

A 4-layer Llama of 100 MB (random weights, fp32, TorchScript export via k3opt.export) is optimized by ``k3opt optimize``
in a child process, which reports its peak RSS (the kernel's VmHWM) above what it held once k3opt and its
libraries were imported: what the run itself added, against the model file's size. Before the fix the run
held the original's serialized bytes, two onnxruntime sessions' copies of the weights (and their prepacked
MatMul weights) and the input proto through the save's read-back: about 8x.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import json, sys
from k3opt.cli import main
import onnxruntime, onnx_graphsurgeon  # what a run loads anyway: part of the baseline, not of the run


def memory():
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                found[key] = int(value.split()[0]) * 1024
    return found


base = memory()["VmRSS"]
try:
    main(["optimize", *sys.argv[1:]], prog_name="k3opt")
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "base": base, "peak": memory()["VmHWM"]}))
"""


def llama(path: Path) -> Path:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from bench.models import _logits_only
    from k3opt.export import export_onnx

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=24000, hidden_size=384, intermediate_size=1056, num_attention_heads=6,
                                   num_key_value_heads=6, max_position_embeddings=256, num_hidden_layers=4)
    cfg.use_cache = False
    model = transformers.LlamaForCausalLM(cfg).eval()

    dyn = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"}}
    with torch.no_grad():
        export_onnx(_logits_only(model), (torch.randint(0, 24000, (1, 8)), torch.ones(1, 8, dtype=torch.int64)), path,
                    input_names=list(dyn), output_names=["logits"], dynamic_axes=dyn, opset=17)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("flags", [[], ["--no-verify"]])
def test_the_run_adds_less_than_three_times_the_model(tmp_path, flags):
    model = llama(tmp_path / "m.onnx")
    size = model.stat().st_size
    proc = subprocess.run([sys.executable, "-c", CHILD, str(model), str(tmp_path / "o.onnx"), "-q", *flags],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["code"] in (0, None), proc.stderr
    added = result["peak"] - result["base"]
    assert added < 3 * size, f"the run added {added / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB model"
