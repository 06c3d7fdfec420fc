"""The benchmark's model set, built on demand and cached outside the repo.

- the test exports (``tests/zoo.py``: ``zoo_model(name, exporter)``, cached by the zoo), one entry per
  family and exporter, with the zoo's own inputs;
- a depth series of one Llama-style model (8, 16, 32, 64 layers, small hidden size, TorchScript export at
  opset 17), and the same series exported at opset 14 (``llama-depth64-op14``: many exporters' default, so
  k3opt's opset conversion is part of what is timed);
- ``llama-3gb``: the same architecture at hidden 2048 and 16 layers, 3.3 GB of fp32 weights in external
  data (opt-in: it takes disk and minutes);
- the third-party set: ONNX files that packages on PyPI ship inside their wheels (Silero VAD, PaddleOCR's
  PP-OCRv4 det/rec and its cls model via rapidocr-onnxruntime), graphs nobody here wrote; listed when the
  ``thirdparty`` extra is installed (``pip install -e '.[thirdparty]'``), with inputs of the size the
  packages feed them;
- the non-transformer corpus (``tests/cnn_zoo.py``: ``cnn-<name>-<exporter>``, CNN, OCR, detector, GRU,
  Conv1d audio, two of them behind an ``If``), cached by the test zoo, with its own inputs;
- the foreign forms (``tests/foreign_graphs.py``: ``foreign-<name>``, hand-built graphs in the shapes
  tf2onnx, Keras and older PyTorch exporters emit: issue #34's fewest-nodes cases), built in a moment,
  with their own seeded inputs (batch 2).

Builds run in a child process (``python -m bench.models NAME DST``) so torch's memory goes away with it.
The Llama cache key hashes what determines the graph (builder source, configs, torch/transformers
versions), so a changed builder rebuilds instead of benchmarking a stale file.
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
DEPTH_PREFIX = "llama-depth"
DEPTH_OPSET = 17
#: The depth series' second export: opset 14, the default of many exporters (k3opt raises it to 17).
LEGACY_OPSET = 14
LEGACY_SUFFIX = f"-op{LEGACY_OPSET}"
ENCODERS = {"bert": "bert", "vit": "vit"}
CNN_FAMILY = "cnn"
FOREIGN_FAMILY = "foreign"

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
    def is_zoo(self) -> bool:
        """A test export from ``tests/zoo.py`` or ``tests/cnn_zoo.py`` (which cache it themselves)."""
        return self.path is None and self.name != BIG and series_depth(self.name) is None

    @property
    def own_feeds(self) -> bool:
        """Its inputs come from :func:`zoo_feeds` (test exports, the corpus, the third-party set)."""
        return self.is_zoo or self.family in (THIRD_PARTY_FAMILY, FOREIGN_FAMILY)

    @property
    def is_cnn(self) -> bool:
        """A model of the non-transformer corpus (``tests/cnn_zoo.py``)."""
        return self.family == CNN_FAMILY and self.path is None

    @property
    def ort_model_type(self) -> str:
        """Model type for onnxruntime.transformers' optimizer: encoders as such, decoders as gpt2."""
        return ENCODERS.get(self.family, "gpt2")


def model_set(quick: bool = False, big: bool = False) -> list[ModelSpec]:
    """All known models (``quick``: one export per family and the two smallest depths)."""
    exporters = EXPORTERS[:1] if quick else EXPORTERS
    depths = DEPTHS[:2] if quick else DEPTHS
    specs = [ModelSpec(f"{fam}-{exp}", fam) for fam in ZOO_FAMILIES for exp in exporters]
    specs += [ModelSpec(f"{DEPTH_PREFIX}{d}", "llama") for d in depths]
    specs += [ModelSpec(f"{DEPTH_PREFIX}{d}{LEGACY_SUFFIX}", "llama") for d in depths]
    specs += [ModelSpec(f"{CNN_FAMILY}-{name}-{exp}", CNN_FAMILY) for name in cnn_names() for exp in exporters]
    specs += [ModelSpec(f"{FOREIGN_FAMILY}-{name}", FOREIGN_FAMILY) for name in foreign_names()]
    specs += third_party_specs()
    if big:
        specs.append(ModelSpec(BIG, "llama"))
    return specs


#: name -> (package, file inside it, {input: (dtype, shape or a fixed value)}) of the third-party set.
THIRD_PARTY = {
    "silero-vad": ("silero_vad", "data/silero_vad.onnx",
                   {"input": ("float32", (1, 512)), "state": ("zeros", (2, 1, 128)), "sr": ("int64", 16000)}),
    "silero-vad-16k-op15": ("silero_vad", "data/silero_vad_16k_op15.onnx",
                            {"input": ("float32", (1, 512)), "state": ("zeros", (2, 1, 128)), "sr": ("int64", 16000)}),
    "ppocr-v4-det": ("rapidocr_onnxruntime", "models/ch_PP-OCRv4_det_infer.onnx", {"x": ("float32", (1, 3, 96, 96))}),
    "ppocr-v4-rec": ("rapidocr_onnxruntime", "models/ch_PP-OCRv4_rec_infer.onnx", {"x": ("float32", (1, 3, 48, 320))}),
    "ppocr-mobile-cls": ("rapidocr_onnxruntime", "models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
                         {"x": ("float32", (1, 3, 48, 192))}),
}
THIRD_PARTY_FAMILY = "third-party"


def third_party_specs() -> list[ModelSpec]:
    """The third-party models whose package is installed (found without importing it)."""
    import importlib.util

    specs = []
    for name, (package, file, _) in THIRD_PARTY.items():
        found = importlib.util.find_spec(package)
        for folder in (found.submodule_search_locations or []) if found else []:
            if (Path(folder) / file).is_file():
                specs.append(ModelSpec(name, THIRD_PARTY_FAMILY, path=Path(folder) / file))
                break
    return specs


def _third_party_feeds(name: str) -> dict:
    import numpy as np

    rng = np.random.default_rng(0)
    feeds = {}
    for input_name, (kind, spec) in THIRD_PARTY[name][2].items():
        if kind == "zeros":
            feeds[input_name] = np.zeros(spec, np.float32)
        elif kind == "int64":
            feeds[input_name] = np.array(spec, np.int64)
        else:
            feeds[input_name] = rng.standard_normal(spec).astype(kind)
    return feeds


def cnn_names() -> tuple[str, ...]:
    """The corpus's model names (``tests/cnn_zoo.py``; importing it needs no torch)."""
    sys.path.insert(0, str(REPO))
    from tests.cnn_zoo import NAMES

    return NAMES


def foreign_names() -> tuple[str, ...]:
    """The foreign forms' names (``tests/foreign_graphs.py``; importing it needs onnx only)."""
    sys.path.insert(0, str(REPO))
    from tests.foreign_graphs import GRAPHS

    return tuple(GRAPHS)


def _cnn_parts(name: str) -> tuple[str, str]:
    """``cnn-gru-if-dynamo`` -> (``gru-if``, ``dynamo``)."""
    model, exporter = name[len(CNN_FAMILY) + 1:].rsplit("-", 1)
    return model, exporter


def depth_of(name: str) -> Optional[int]:
    """Layer count of an opset-17 depth-series model name (``llama-depth16`` -> 16), else None (the
    scaling goal's series)."""
    tail = name[len(DEPTH_PREFIX):] if name.startswith(DEPTH_PREFIX) else ""
    return int(tail) if tail.isdigit() else None


def series_depth(name: str) -> Optional[int]:
    """Layer count of a depth-series model of either export (``llama-depth16-op14`` -> 16), else None."""
    return depth_of(name[:-len(LEGACY_SUFFIX)] if name.endswith(LEGACY_SUFFIX) else name)


def export_opset(name: str) -> int:
    """The opset a depth-series model is exported at."""
    return LEGACY_OPSET if name.endswith(LEGACY_SUFFIX) else DEPTH_OPSET


def select(specs: list[ModelSpec], patterns: Optional[list[str]]) -> list[ModelSpec]:
    """Specs whose name matches any glob in ``patterns`` (all when none given)."""
    if not patterns:
        return specs
    return [s for s in specs if any(fnmatch.fnmatch(s.name, p) for p in patterns)]


def _cache_key() -> str:
    """Hash of what determines the Llama graphs (builder code, configs, torch/transformers versions)."""
    import torch
    import transformers

    parts = [torch.__version__, transformers.__version__, repr(SMALL_LLAMA), repr(BIG_LLAMA)]
    parts += [inspect.getsource(f) for f in (_export_llama, _logits_only, _placeholder_llama, _weights_to_external_data)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def cached_path(spec: ModelSpec) -> Path:
    """Where a Llama model lives (built or not): one folder per model and cache key."""
    return CACHE / "models" / f"{spec.name}-{_cache_key()}" / "model.onnx"


def ensure_built(spec: ModelSpec, timeout_s: float = 1800) -> tuple[Optional[Path], str]:
    """Path of ``spec``'s model, building it in a child process if needed; (None, why) when that fails."""
    if spec.path is not None:
        return spec.path, ""
    path = None if spec.is_zoo else cached_path(spec)
    if path is not None and path.exists():
        return path, ""
    res = run_measured(python_module("bench.models", spec.name, str(path or "")), timeout_s)
    if res.status != "ok":
        return None, f"build {res.status}: {res.error}"
    return Path(res.payload["path"]), ""


def zoo_feeds(spec: ModelSpec) -> dict:
    """The zoo's own seeded inputs for a test export (batch 2, a padded row, so masks matter; the corpus's)."""
    if spec.family == THIRD_PARTY_FAMILY:
        return _third_party_feeds(spec.name)
    sys.path.insert(0, str(REPO))
    if spec.is_cnn:
        from tests.cnn_zoo import cnn_inputs

        return cnn_inputs(_cnn_parts(spec.name)[0])
    if spec.family == FOREIGN_FAMILY:
        from tests.foreign_graphs import GRAPHS

        return GRAPHS[spec.name[len(FOREIGN_FAMILY) + 1:]][1](2)
    from tests.zoo import zoo_inputs

    return zoo_inputs(spec.family)


def _logits_only(model):
    """Wrap ``model`` as ``forward(input_ids, attention_mask) -> logits``: the export gets exactly those inputs."""
    import torch

    class LogitsOnly(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    return LogitsOnly()


def _placeholder_llama(cfg):
    """A LlamaForCausalLM whose weights take no memory: each is a distinct scalar broadcast to its shape.

    Good for tracing the graph only (distinct values keep the exporter from merging equal weights).
    """
    import torch
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    count = 0
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                count += 1
                value = torch.full((), 0.01 + count * 1e-4).expand(param.shape)
                module._parameters[name] = torch.nn.Parameter(value, requires_grad=False)
    model.model.rotary_emb = LlamaRotaryEmbedding(cfg)
    return model


def _export_llama(tmp: Path, stream_weights: bool = False, opset: int = DEPTH_OPSET, **config: int) -> None:
    """TorchScript export of a random-weight LlamaForCausalLM (no KV cache, dynamic batch/sequence) at ``opset``.

    ``stream_weights``: trace with placeholder weights, export the graph alone, then write seeded random
    weights tensor by tensor into external data, so a multi-GB model never sits in memory.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**config)
    cfg.use_cache = False
    model = (_placeholder_llama(cfg) if stream_weights else LlamaForCausalLM(cfg)).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 16))
    mask = torch.ones(1, 16, dtype=torch.int64)
    dyn = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"}}
    with torch.no_grad():
        torch.onnx.export(_logits_only(model), (ids, mask), str(tmp), input_names=list(dyn), output_names=["logits"],
                          dynamic_axes=dyn, opset_version=opset, dynamo=False, export_params=not stream_weights)
    if stream_weights:
        _weights_to_external_data(tmp, keep=set(dyn))


def _weights_to_external_data(path: Path, keep: set[str]) -> None:
    """Turn every graph input not in ``keep`` into an initializer with seeded random external data.

    Norm weights are ones, everything else N(0, 0.02) like transformers' init; one tensor in memory at a time.
    """
    import numpy as np
    import onnx

    model = onnx.load(str(path))
    rng = np.random.default_rng(0)
    location = path.name + ".data"
    weights = [vi for vi in model.graph.input if vi.name not in keep]
    with open(path.parent / location, "wb") as data:
        for vi in weights:
            shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
            if "norm" in vi.name:
                values = np.ones(shape, np.float32)
            else:
                values = (rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02))
            tensor = onnx.TensorProto(name=vi.name, data_type=onnx.TensorProto.FLOAT, dims=shape,
                                      data_location=onnx.TensorProto.EXTERNAL)
            for key, value in (("location", location), ("offset", data.tell()), ("length", values.nbytes)):
                tensor.external_data.add(key=key, value=str(value))
            data.write(values.tobytes())
            model.graph.initializer.append(tensor)
    inputs = [vi for vi in model.graph.input if vi.name in keep]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    onnx.save(model, str(path))


def _store(tmp: Path, dst: Path) -> None:
    """Move the export ``tmp`` (and its one external-data file, if any) to ``dst``."""
    import onnx

    dst.parent.mkdir(parents=True, exist_ok=True)
    data = tmp.parent / (tmp.name + ".data")
    if not data.exists():
        os.replace(tmp, dst)
        return
    model = onnx.load(str(tmp), load_external_data=False)
    os.replace(data, dst.parent / (dst.name + ".data"))
    for init in model.graph.initializer:
        for entry in init.external_data:
            if entry.key == "location":
                entry.value = dst.name + ".data"
    onnx.save(model, str(dst))


def build(name: str, dst: Path) -> None:
    """Export Llama model ``name`` to ``dst`` (in the child process) through a scratch folder."""
    CACHE.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=name + "-", dir=CACHE))
    try:
        tmp = scratch / "export.onnx"
        if name == BIG:
            _export_llama(tmp, stream_weights=True, **BIG_LLAMA)
        else:
            _export_llama(tmp, opset=export_opset(name), num_hidden_layers=series_depth(name), **SMALL_LLAMA)
        _store(tmp, dst)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main(name: str, dst: str) -> None:
    """Child entry: a zoo export (``dst`` empty: the zoo's cached path) or a Llama build at ``dst``."""
    if dst:
        build(name, Path(dst))
        write_result({"path": dst})
        return
    sys.path.insert(0, str(REPO))
    if name.startswith(CNN_FAMILY + "-"):
        from tests.cnn_zoo import cnn_model

        write_result({"path": str(cnn_model(*_cnn_parts(name)))})
        return
    if name.startswith(FOREIGN_FAMILY + "-"):
        import onnx
        from tests.foreign_graphs import GRAPHS

        folder = CACHE / "models" / "foreign-graphs"  # rebuilt every time: a moment, and never stale
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{name}.onnx"
        onnx.save(GRAPHS[name[len(FOREIGN_FAMILY) + 1:]][0](), str(path))
        write_result({"path": str(path)})
        return
    from tests.zoo import zoo_model

    family, exporter = name.rsplit("-", 1)
    write_result({"path": str(zoo_model(family, exporter))})


if __name__ == "__main__":
    main(*sys.argv[1:3])
