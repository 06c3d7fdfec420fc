"""``k3opt compile OUT_DIR/manifest.json``: one ``.om`` per pipeline stage of a split (``PREFIX_stage<i>.om``).

Each stage goes through :func:`k3opt.cann_bridge.compile.compile_model` as a model of its own. ATC needs a
shape for every input, taken in this order: ``--input-shape``; the manifest's shapes (static once the split's
graph inputs were fixed, else with named dims such as ``batch``, bound by the ``--input-shape`` of a graph
input that has them); onnx's shape inference of the earlier stages on those shapes; a run of the split's
source model on inputs of those sizes (block by block, its weights streamed as verification streams them).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from .. import modelio
from ..cann_bridge.atc_command import AtcOptions
from ..cann_bridge.compile import CompileResult, compile_model
from ..errors import UsageError
from ..pipeline import shapes
from ..pipeline import verify as verifier
from .session import block_model, run_block, value_types
from .split import read_manifest
from .structure import partition


def compile_stages(manifest_path: str, output: str, options: AtcOptions, **kwargs: Any) -> list[CompileResult]:
    """Compile every stage of the split at ``manifest_path`` (its manifest.json or folder) to ``OUTPUT_stage<i>``."""
    manifest = read_manifest(manifest_path)
    if manifest.get("kind") == "llm-pair":
        raise UsageError(f"{manifest_path}: a serving pair split into stages; compile it with "
                         "k3opt.llm.compile_pair.compile_pair (k3opt compile takes its folder)")
    folder = Path(manifest["folder"])
    known = _manifest_shapes(manifest, {s.name: list(s.dims) for s in options.shapes()})
    ran_source = False
    results = []
    for stage in manifest["stages"]:
        names = [t["name"] for t in stage["inputs"]]
        if not ran_source and any(n not in known for n in names):
            known.update({k: v for k, v in _source_shapes(manifest, known).items() if k not in known})
            ran_source = True
        known.update({k: v for k, v in _inferred_outputs(folder / stage["file"], known).items() if k not in known})
        stage_shapes = tuple(f"{n}:{','.join(str(d) for d in known[n])}" for n in names if n in known)
        stage_options = dataclasses.replace(options, input_shapes=stage_shapes)
        results.append(compile_model(str(folder / stage["file"]), f"{output}_stage{stage['index']}", stage_options,
                                     **kwargs))
    return results


def _manifest_shapes(manifest: dict, given: dict[str, list]) -> dict[str, list]:
    """The ``given`` dims, then every stage tensor's dims in the manifest whose named dims (``batch``...) the
    given dims of a tensor with the same named dims bind."""
    known: dict[str, list] = {n: [str(d) for d in dims] for n, dims in given.items()}
    tensors = [t for s in manifest["stages"] for t in s["inputs"] + s["outputs"] if t.get("shape") is not None]
    bound: dict[str, str] = {}
    for t in tensors:
        dims = known.get(t["name"])
        if dims is not None and len(dims) == len(t["shape"]):
            bound.update((d, g) for d, g in zip(t["shape"], dims) if isinstance(d, str) and g.isdigit())
    for t in tensors:
        dims = [str(d) if isinstance(d, int) else bound.get(d) for d in t["shape"]]
        if t["name"] not in known and all(d is not None for d in dims):
            known[t["name"]] = dims
    return known


def _source_shapes(manifest: dict, known: dict[str, list]) -> dict[str, list]:
    """Stage inputs' dims from a run of the source model (block by block, weights streamed) on inputs of the
    ``known`` graph inputs' sizes; none when those are not all static or the source does not run here."""
    source = Path(manifest.get("source", ""))
    if not source.is_file():
        return {}
    model = modelio.read_model(source).model
    inputs = {vi.name for vi in model.graph.input}
    static = {n: [int(d) for d in dims] for n, dims in known.items()
              if n in inputs and all(str(d).isdigit() for d in dims)}
    if not static:
        return {}
    shapes.fix_inputs(model, static)
    wanted = {t["name"] for s in manifest["stages"] for t in s["inputs"]}
    try:
        blocks = partition(model.graph, [b for b in manifest["boundaries"] if b in wanted])
        env = dict(verifier.make_feeds(model))
        types = value_types(model)
        for block in blocks:
            env.update(run_block(block_model(model, block, types), env))
    except Exception:  # noqa: BLE001 -- the source does not run here: the boundaries stay dynamic
        return {}
    return {name: [str(d) for d in np.shape(env[name])] for name in wanted if name in env}


def _inferred_outputs(path: Path, known: dict[str, list]) -> dict[str, list]:
    """The static output shapes onnx's shape inference gives for a stage file with its inputs' ``known`` dims
    (a tensor a cann lowering made, which the source does not have, is sized this way)."""
    model = onnx.load(str(path), load_external_data=False)
    light, _ = modelio.weights_as_inputs(model)
    for vi in light.graph.input:
        dims = known.get(vi.name)
        if dims is not None and all(str(d).isdigit() for d in dims):
            shape = vi.type.tensor_type.shape
            shape.ClearField("dim")
            for d in dims:
                shape.dim.add().dim_value = int(d)
    try:
        light = onnx.shape_inference.infer_shapes(light, data_prop=True)
    except Exception:  # noqa: BLE001 -- no inference: nothing learned
        return {}
    out = {}
    for vi in light.graph.output:
        dims = vi.type.tensor_type.shape.dim
        if vi.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            out[vi.name] = [str(d.dim_value) for d in dims]
    return out
