"""The benchmark's model set, built on demand and cached outside the repo.

- the test exports (``tests/zoo.py``: ``zoo_model(name, exporter)``), one entry per family and exporter;
- a depth series of one Llama-style model (8, 16, 32, 64 layers, small hidden size, TorchScript export);
- ``llama-3gb``: the same architecture at hidden 2048 and 16 layers, 3.3 GB of fp32 weights in external
  data (opt-in: it takes disk and minutes).

Builds run in a child process (``python -m bench.models NAME DST``) so torch's memory goes away with it.
The cache key hashes what determines the graph (builder source, zoo source, torch/transformers versions),
so a changed exporter or zoo rebuilds instead of benchmarking a stale file.
"""
from __future__ import annotations

import fnmatch
import hashlib
import inspect
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .procs import python_module, run_measured, write_result

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("K3OPT_BENCH_CACHE", Path.home() / ".cache" / "k3opt-bench"))
ZOO_FAMILIES = ("bert", "gpt2", "llama", "qwen2", "deepseek_v3", "vit")
EXPORTERS = ("torchscript", "dynamo")
DEPTHS = (8, 16, 32, 64)
BIG = "llama-3gb"
ENCODERS = {"bert": "bert", "vit": "vit"}

# Llama-style configs: the depth series is small and fast; the big one is TinyLlama-sized (3.3 GB fp32).
SMALL_LLAMA = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256)
BIG_LLAMA = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_attention_heads=32,
                 num_key_value_heads=4, max_position_embeddings=2048, num_hidden_layers=16)


@dataclass(frozen=True)
class ModelSpec:
    """One benchmark model: ``family`` picks the onnxruntime transformer-optimizer model type."""

    name: str
    family: str
    path: Optional[Path] = None  # a user-given file: no build, no cache

    @property
    def ort_model_type(self) -> str:
        """Model type for onnxruntime.transformers' optimizer: encoders as such, decoders as gpt2."""
        return ENCODERS.get(self.family, "gpt2")


def model_set(quick: bool = False, big: bool = False) -> list[ModelSpec]:
    """All known models (``quick``: one export per family and the two smallest depths)."""
    exporters = EXPORTERS[:1] if quick else EXPORTERS
    depths = DEPTHS[:2] if quick else DEPTHS
    specs = [ModelSpec(f"{fam}-{exp}", fam) for fam in ZOO_FAMILIES for exp in exporters]
    specs += [ModelSpec(f"llama-d{d}", "llama") for d in depths]
    if big:
        specs.append(ModelSpec(BIG, "llama"))
    return specs


def select(specs: list[ModelSpec], patterns: Optional[list[str]]) -> list[ModelSpec]:
    """Specs whose name matches any glob in ``patterns`` (all when none given)."""
    if not patterns:
        return specs
    return [s for s in specs if any(fnmatch.fnmatch(s.name, p) for p in patterns)]


def _cache_key(name: str) -> str:
    """Hash of what determines the graph ``name`` builds into (builder, configs, zoo, torch versions)."""
    import torch
    import transformers

    parts = [torch.__version__, transformers.__version__]
    if name.startswith("llama-"):
        parts += [inspect.getsource(_export_llama), repr(SMALL_LLAMA), repr(BIG_LLAMA)]
    else:
        zoo = REPO / "tests" / "zoo.py"
        parts.append(zoo.read_text() if zoo.exists() else "")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def cached_path(spec: ModelSpec) -> Path:
    """Where ``spec``'s model file lives (built or not): one folder per model and cache key."""
    if spec.path is not None:
        return spec.path
    return CACHE / "models" / f"{spec.name}-{_cache_key(spec.name)}" / "model.onnx"


def ensure_built(spec: ModelSpec, timeout_s: float = 1800) -> tuple[Optional[Path], str]:
    """Build ``spec`` into the cache unless present; returns (path, "") or (None, why it failed)."""
    path = cached_path(spec)
    if path.exists():
        return path, ""
    res = run_measured(python_module("bench.models", spec.name, str(path)), timeout_s)
    if res.status != "ok" or not path.exists():
        return None, f"build {res.status}: {res.error}"
    return path, ""


def _export_llama(tmp: Path, **config: int) -> None:
    """TorchScript export of a random-weight LlamaForCausalLM (no KV cache, dynamic batch/sequence)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**config)
    cfg.use_cache = False
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 16))
    mask = torch.ones(1, 16, dtype=torch.int64)
    dyn = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"}}
    with torch.no_grad():
        torch.onnx.export(model, (ids, mask), str(tmp), input_names=["input_ids", "attention_mask"],
                          output_names=["logits"], dynamic_axes=dyn, opset_version=17, dynamo=False)


def _export_zoo(name: str, tmp: Path) -> None:
    """Export ``family-exporter`` with the test zoo (``tests/zoo.py``) into ``tmp``."""
    import onnx

    sys.path.insert(0, str(REPO))
    from tests.zoo import zoo_model

    family, exporter = name.rsplit("-", 1)
    model = zoo_model(family, exporter)
    if isinstance(model, (str, os.PathLike)):
        model = onnx.load(str(model))
    onnx.save(model, str(tmp))


def _store(tmp: Path, dst: Path) -> None:
    """Re-save the export ``tmp`` as ``dst``, weights in one ``model.onnx.data`` file when over 2 GB."""
    import onnx

    model = onnx.load(str(tmp))
    dst.parent.mkdir(parents=True, exist_ok=True)
    if sum(p.stat().st_size for p in tmp.parent.iterdir()) > 1_800_000_000:
        onnx.save(model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=dst.name + ".data", size_threshold=1024)
    else:
        onnx.save(model, str(dst))


def build(name: str, dst: Path) -> None:
    """Build model ``name`` at ``dst`` (in the child process), exporting into a scratch folder first."""
    CACHE.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=name + "-", dir=CACHE))
    try:
        tmp = scratch / "export.onnx"
        if name == BIG:
            _export_llama(tmp, **BIG_LLAMA)
        elif name.startswith("llama-d"):
            _export_llama(tmp, num_hidden_layers=int(name[len("llama-d"):]), **SMALL_LLAMA)
        else:
            _export_zoo(name, tmp)
        _store(tmp, dst)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    build(sys.argv[1], Path(sys.argv[2]))
    write_result({"path": sys.argv[2]})
