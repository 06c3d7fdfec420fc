"""``k3opt compile OUT_DIR/manifest.json``: one ``.om`` per pipeline stage of a split (``PREFIX_stage<i>.om``).

Each stage goes through :func:`k3opt.cann_bridge.compile.compile_model` as a model of its own. ATC needs a
shape for every input: the graph inputs' come from ``--input-shape``, the tensors handed between stages
get theirs from a run of the split's source model on inputs of those sizes (block by block, its weights
streamed as verification streams them).
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
from ..pipeline import shapes
from ..pipeline import verify as verifier
from .session import block_model, run_block, value_types
from .split import read_manifest
from .structure import partition


def compile_stages(manifest_path: str, output: str, options: AtcOptions, **kwargs: Any) -> list[CompileResult]:
    """Compile every stage of the split at ``manifest_path`` (its manifest.json or folder) to ``OUTPUT_stage<i>``."""
    manifest = read_manifest(manifest_path)
    folder = Path(manifest["folder"])
    given = {s.name: s.dims for s in options.shapes()}
    known = _boundary_shapes(manifest, given)
    results = []
    for stage in manifest["stages"]:
        known.update({k: v for k, v in _inferred_outputs(folder / stage["file"], known).items() if k not in known})
        names = [t["name"] for t in stage["inputs"]]
        stage_shapes = tuple(f"{n}:{','.join(str(d) for d in known[n])}" for n in names if n in known)
        stage_options = dataclasses.replace(options, input_shapes=stage_shapes)
        results.append(compile_model(str(folder / stage["file"]), f"{output}_stage{stage['index']}", stage_options,
                                     **kwargs))
    return results


def _boundary_shapes(manifest: dict, given: dict[str, list]) -> dict[str, list]:
    """Every stage input's dims: the given graph inputs', then those of a run of the source model (block by
    block, weights streamed) on inputs of the given sizes; -1 where neither tells."""
    known: dict[str, list] = dict(given)
    static = {n: [int(d) for d in dims] for n, dims in given.items() if all(d.isdigit() for d in dims)}
    source = Path(manifest.get("source", ""))
    if not static or not source.is_file():
        return known
    model = modelio.read_model(source).model
    inputs = {vi.name for vi in model.graph.input}
    shapes.fix_inputs(model, {n: d for n, d in static.items() if n in inputs})
    wanted = {t["name"] for s in manifest["stages"] for t in s["inputs"]}
    try:
        blocks = partition(model.graph, [b for b in manifest["boundaries"] if b in wanted])
        env = dict(verifier.make_feeds(model))
        types = value_types(model)
        for block in blocks:
            env.update(run_block(block_model(model, block, types), env))
    except Exception:  # noqa: BLE001 -- the source does not run here: the boundaries stay dynamic
        return known
    for name in wanted:
        if name not in known and name in env:
            known[name] = [str(d) for d in np.shape(env[name])]
    return known


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
