"""``split``: a transformer cut into pipeline stages, one ONNX model per card.

Each stage is a valid ONNX model with its own external data (weights streamed from the source, never all in
memory), its inputs the tensors it reads from the graph inputs or earlier stages and its outputs those that
later stages or the graph outputs read. The embeddings go to the first stage and the final norm and lm_head
to the last; each layer's KV-cache inputs and outputs go with its attention. The stages meet at the cut points
of :func:`k3opt.blocks.structure.find_stack`: layer boundaries, the stream between a layer's attention and
its MLP, and, only where those cannot bring the stages within ``balance``, an activation inside a sublayer.
They are balanced by weight bytes plus the KV-cache bytes of static cache inputs
(:func:`k3opt.blocks.plan.balanced`), or given by hand as layer ranges. A manifest (``manifest.json``)
records the stage order, the cuts (where, of which kind, what they hand on), the tensors handed from stage
to stage (names, dtypes, shapes), the cache tensors each stage owns, its bytes and its device index. Stages
with IR version 10 or later also carry ONNX's own pipeline metadata (a ``configuration`` and each node's
``pipeline_stage``). Verification runs the written stages in sequence in onnxruntime against the whole model
(run block by block when over ``verify_memory``).
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import onnx

from .. import modelio
from ..errors import InputError, OutputError, UsageError, VerificationError
from ..graph import dtypes
from ..modelio.temp_folders import TempFolder
from ..pipeline import shapes, verify as verifier
from ..targets import get_target
from . import plan
from .run_hook import DEFAULT_BUDGET
from .session import Evaluator, block_model, run_block, value_types
from .structure import Block, CutPoint, Stack, find_boundaries, find_stack, partition

MANIFEST = "manifest.json"
FORMAT = "k3opt-pipeline/1"
CONFIGURATION = "k3opt-pipeline"
_PIPELINE_IR = 10  # onnx's DeviceConfigurationProto and NodeDeviceConfigurationProto.pipeline_stage
#: --balance: the largest / smallest stage a split aims for (issue #32: stages within 10% of each other).
DEFAULT_BALANCE = 1.1


def parse_layers(text: str) -> list[tuple[int, int]]:
    """``0-3,4-7,8`` -> [(0, 3), (4, 7), (8, 8)] (inclusive layer ranges); raises UsageError."""
    ranges = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise UsageError(f"--layers: '{part}' is not a layer range such as 0-3") from None
        ranges.append((a, b))
    return ranges


def split_model(
    model: str | os.PathLike, out_dir: str | os.PathLike, stages: Optional[int] = None, *,
    layers: Optional[Sequence[tuple[int, int]]] = None, max_stage_bytes: Optional[int] = None,
    balance: float = DEFAULT_BALANCE, verify: bool = True, verify_memory: Optional[int] = None,
    input_data: Any = None, seed: int = 0, rtol: Optional[float] = None, atol: Optional[float] = None,
    overwrite: bool = False, target: str = "onnx", input_shapes: Any = None,
    progress: Optional[Callable[[str], None]] = None,
) -> dict[str, Any]:
    """Cut the model file ``model`` into ``stages`` stages (or the inclusive ``layers`` ranges) written into
    ``out_dir`` with ``manifest.json``; returns the manifest. Nothing is written when a check fails.

    ``input_shapes`` (``{name: dims}`` or ``NAME:D1,D2`` strings) fixes graph inputs' dims first: with every
    dim fixed, the manifest gives every handed tensor's static shape (``k3opt compile`` needs no
    ``--input-shape`` then). ``target="cann"`` first optimizes and lowers the whole model for Ascend
    (verified as ``k3opt optimize --target cann`` verifies it), then cuts the lowered model; its stages are
    verified chained under the target's reference NPU ops against the source model.
    """
    out = check_out_dir(Path(out_dir), overwrite)
    check = _Check(verify_memory, input_data, seed, rtol, atol) if verify else None
    options = dict(layers=layers, max_stage_bytes=max_stage_bytes, balance=balance, progress=progress)
    found = get_target(target)
    if not found.lowers:
        return _split(Path(model), out, stages, check=check, input_shapes=input_shapes, **options)
    from ..api import optimize_file

    temp = TempFolder.next_to(out)
    try:
        lowered = temp.path / f"{Path(model).stem}.{found.name}.onnx"
        report = optimize_file(model, lowered, target=found.name, verify=verify, verify_memory=verify_memory,
                               input_data=input_data, seed=seed, rtol=rtol, atol=atol, input_shapes=input_shapes,
                               progress=progress)
        if check is not None:  # the stages under the target's reference ops, chained, against the source model
            tolerances = report.lowering_verification if (report.lowering_verification or {}).get("rtol") else {}
            check = dataclasses.replace(check, reference=Path(model), input_shapes=input_shapes,
                                        evaluator=found.reference_evaluator(), target=found.name,
                                        rtol=tolerances.get("rtol", rtol), atol=tolerances.get("atol", atol))
        about = {"source": str(model), "target": found.name,
                 "optimization": {"verification": report.verification,
                                  "lowering_verification": report.lowering_verification}}
        return _split(lowered, out, stages, check=check, input_shapes=None, about=about, **options)
    finally:
        temp.remove()


def check_out_dir(out: Path, overwrite: bool) -> Path:
    """``out`` if a split may be written there: absent, empty, or (``overwrite``) a folder; else OutputError."""
    if out.exists() and not (out.is_dir() and (overwrite or not any(out.iterdir()))):
        raise OutputError(f"{out}: exists; pass --overwrite to replace it" if out.is_dir() else
                          f"{out}: exists and is not a folder")
    if not out.parent.is_dir():
        raise OutputError(f"{out}: its folder {out.parent} does not exist")
    return out


def check_stage_bytes(sizes: Sequence[int], limit: Optional[int]) -> None:
    """UsageError naming the largest stage when it is over ``limit`` (--max-stage-bytes)."""
    worst = int(np.argmax(sizes))
    if limit is not None and sizes[worst] > limit:
        raise UsageError(f"stage {worst} holds {sizes[worst] / 2**20:.1f} MB, over --max-stage-bytes "
                         f"({limit / 2**20:.1f} MB): use more stages")


def publish(staged: Path, out: Path, temp: TempFolder) -> None:
    """Move the complete folder ``staged`` to ``out``; an existing ``out`` goes into ``temp`` first."""
    if out.exists():  # --overwrite (checked before): the old folder goes only once the new one is complete
        os.rename(out, temp.path / "old")
    os.rename(staged, out)


@dataclasses.dataclass(frozen=True)
class _Check:
    """How the written stages are verified: chained, against ``reference`` (default: the model cut), each run
    by onnxruntime or by ``evaluator`` (a lowering target's reference ops)."""

    budget: Optional[int]
    input_data: Any
    seed: int
    rtol: Optional[float]
    atol: Optional[float]
    reference: Optional[Path] = None
    input_shapes: Any = None  # the reference's fixed input dims (those the model cut was given)
    evaluator: Optional[Evaluator] = None
    target: Optional[str] = None


def _split(model: Path, out: Path, stages: Optional[int], *, layers: Optional[Sequence[tuple[int, int]]],
           max_stage_bytes: Optional[int], balance: float, check: Optional[_Check], input_shapes: Any,
           progress: Optional[Callable[[str], None]], about: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    say = progress or (lambda _msg: None)
    say("loading")
    loaded = modelio.read_model(model)
    proto = loaded.model
    shapes.fix_inputs(proto, input_shapes)
    stack = find_stack(proto.graph)  # raises NoLayers
    types = inferred_types(proto)
    cuts = choose_cuts(proto.graph, lambda inner: find_stack(proto.graph, inner=True) if inner else stack, types,
                       stages, layers, balance)
    blocks = partition(proto.graph, [c.tensor for c in cuts])
    sizes = [b.weight_bytes + cache_bytes(b, types) for b in blocks]
    check_stage_bytes(sizes, max_stage_bytes)
    temp = TempFolder.next_to(out)
    try:
        staged = temp.path / "stages"
        staged.mkdir()
        files = []
        for i, block in enumerate(blocks):
            say(f"writing stage {i}")
            stage = stage_model(proto, block, types, i, len(blocks))
            path = staged / f"stage{i}.onnx"
            modelio.save(stage, path, external_data=True)
            files.append(path)
        manifest = _manifest(Path(model), blocks, cuts, len(stack.boundaries) - 1, types, sizes, files)
        manifest.update(about or {})
        if check is not None:
            runner = "onnxruntime" if check.evaluator is None else f"the {check.target} reference ops"
            say(f"verifying the stages chained ({runner}) against the whole model")
            result, seen = _verify(check, proto, stack.boundaries, files, types)
            manifest["verification"] = dict(result, stages_run_by=runner)
            if result["status"] == "failed":
                raise VerificationError(f"the stages chained ({runner}) differ from the whole model ("
                                        f"{verifier.failure_detail(result)}); nothing was written")
            if _static_inputs(proto):  # every dim is fixed: the handed tensors' shapes are those seen
                for stage in manifest["stages"]:
                    for t in stage["inputs"] + stage["outputs"]:
                        t["shape"] = seen.get(t["name"], t["shape"])
        else:
            manifest["verification"] = verifier.skipped("--no-verify")
        (staged / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        publish(staged, out, temp)
    finally:
        temp.remove()
    return manifest


def _static_inputs(model: onnx.ModelProto) -> bool:
    """Every graph input's dims are fixed numbers."""
    inits = {t.name for t in model.graph.initializer}
    return all(d.HasField("dim_value") for vi in model.graph.input if vi.name not in inits
               for d in vi.type.tensor_type.shape.dim)


#: Among equally balanced cuts, layer boundaries first, then the stream between sublayers.
_RANK = {"layer": 0, "sublayer": 1, "inner": 2}


def choose_cuts(graph: onnx.GraphProto, stack_of: Callable[[bool], Stack], types: Mapping[str, onnx.ValueInfoProto],
                stages: Optional[int], layers: Optional[Sequence[tuple[int, int]]], balance: float) -> list[CutPoint]:
    """Where the stages meet: at the given layer ranges' starts, or the balanced cut (:func:`_balanced_cuts`) of
    ``stack_of(False)``'s points, or, when those cannot reach ``balance``, of ``stack_of(True)``'s (inner cuts
    too)."""
    stack = stack_of(False)
    count = len(stack.boundaries) - 1
    if layers:
        ranges = [range(a, b + 1) for a, b in layers]
        if [i for r in ranges for i in r] != list(range(count)):
            raise UsageError(f"--layers must cover layers 0..{count - 1} in order, each once; got "
                             + ",".join(f"{r.start}-{r.stop - 1}" for r in ranges))
        if stages is not None and stages != len(ranges):
            raise UsageError(f"--stages {stages} but --layers gives {len(ranges)} ranges")
        starts = {p.layer: p for p in stack.points if p.kind == "layer"}
        return [starts[r.start] for r in ranges[1:]]
    if stages is None or stages < 1:
        raise UsageError("give --stages N (N >= 1) or --layers")
    if stages > count:
        raise UsageError(f"{stages} stages but the model has {count} decoder layers: at most {count} stages")
    cuts, ratio = _balanced_cuts(graph, stack, types, stages, balance)
    if ratio > balance:  # the stream alone cannot: cuts inside sublayers too, as few as reach the balance
        cuts, ratio = _balanced_cuts(graph, stack_of(True), types, stages, balance)
    return cuts


def _balanced_cuts(graph: onnx.GraphProto, stack: Stack, types: Mapping[str, onnx.ValueInfoProto], stages: int,
                   balance: float) -> tuple[list[CutPoint], float]:
    """The cut among ``stack.points`` of :func:`k3opt.blocks.plan.balanced` (by weight bytes plus static
    KV-cache bytes), and its largest / smallest stage."""
    points = stack.points
    fine = partition(graph, [stack.boundaries[0]] + [p.tensor for p in points] + [stack.boundaries[-1]])
    sizes = [b.weight_bytes + cache_bytes(b, types) for b in fine]
    units = sizes[1:-1]  # unit j lies between points j - 1 and j; the embeddings and the head join the ends
    units[0] += sizes[0]
    units[-1] += sizes[-1]
    ranges = plan.balanced(units, stages, within=balance, extra=[p.hands for p in points],
                           rank=[_RANK[p.kind] for p in points])
    totals = [sum(units[i] for i in r) for r in ranges]
    return [points[r.start - 1] for r in ranges[1:]], max(totals) / max(min(totals), 1)


def inferred_types(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Types and shapes of the model's tensors, by onnx's shape inference on its structure (weights as inputs)."""
    light, _ = modelio.weights_as_inputs(model)
    try:
        light = onnx.shape_inference.infer_shapes(light)
    except Exception:  # noqa: BLE001 -- a model onnx cannot infer keeps the value_info it has
        pass
    return value_types(light)


def cache_bytes(block: Block, types: Mapping[str, onnx.ValueInfoProto]) -> int:
    """Bytes of the block's KV-cache inputs whose shapes are static (a dynamic cache counts nothing)."""
    total = 0
    for name in block.inputs:
        vi = types.get(name)
        if vi is None or "past" not in name:
            continue
        dims = vi.type.tensor_type.shape.dim
        if dims and all(d.HasField("dim_value") for d in dims):
            total += int(np.prod([d.dim_value for d in dims])) * dtypes.numpy_dtype(vi.type.tensor_type.elem_type).itemsize
    return total


def stage_model(model: onnx.ModelProto, block: Block, types: Mapping[str, onnx.ValueInfoProto], index: int,
                count: int) -> onnx.ModelProto:
    """``block`` of ``model`` as stage ``index`` of ``count``: a model with the source's metadata and the
    pipeline-stage metadata (k3opt's, and ONNX's own from IR version 10)."""
    stage = block_model(model, block, types, f"{model.graph.name or 'model'}_stage{index}")
    stage.ir_version = model.ir_version
    for field in ("producer_name", "producer_version", "domain", "model_version"):
        setattr(stage, field, getattr(model, field))
    stage.metadata_props.extend(model.metadata_props)
    for key, value in (("k3opt.pipeline_stage", index), ("k3opt.pipeline_stages", count)):
        stage.metadata_props.add(key=key, value=str(value))
    if stage.ir_version >= _PIPELINE_IR:
        stage.configuration.add(name=CONFIGURATION, num_devices=count, device=[f"device{i}" for i in range(count)])
        for node in stage.graph.node:
            node.device_configurations.add(configuration_id=CONFIGURATION, pipeline_stage=index)
    return stage


def tensor_entry(name: str, types: Mapping[str, onnx.ValueInfoProto]) -> dict[str, Any]:
    """The manifest's ``{"name", "dtype", "shape"}`` of a tensor (a dim: its size, its name, or None)."""
    vi = types.get(name)
    if vi is None:
        return {"name": name, "dtype": None, "shape": None}
    t = vi.type.tensor_type
    shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim] \
        if t.HasField("shape") else None
    return {"name": name, "dtype": str(dtypes.numpy_dtype(t.elem_type)), "shape": shape}


def _manifest(source: Path, blocks: list[Block], cuts: list[CutPoint], count: int,
              types: Mapping[str, onnx.ValueInfoProto], sizes: list[int], files: list[Path]) -> dict[str, Any]:
    made = {}
    for i, b in enumerate(blocks):
        made.update((y, i) for y in b.outputs)
    firsts = [0] + [c.layer for c in cuts]
    lasts = [c.layer - 1 if c.kind == "layer" else c.layer for c in cuts] + [count - 1]
    stages = []
    for i, (b, f) in enumerate(zip(blocks, files)):
        inputs = [dict(tensor_entry(n, types), **{"from": made.get(n, "graph")}) for n in b.inputs]
        readers = {n: [j for j, later in enumerate(blocks) if n in later.inputs] for n in b.outputs}
        outputs = [dict(tensor_entry(n, types), to=readers[n]) for n in b.outputs]
        stages.append({
            "index": i, "device": i, "file": f.name, "data": modelio.data_path(f).name,
            "layers": [firsts[i], lasts[i]], "nodes": len(b.nodes) + len(b.copied), "copied_constants": len(b.copied),
            "weight_bytes": b.weight_bytes, "bytes": sizes[i],
            "cache_inputs": [n for n in b.inputs if n.startswith("past")],
            "cache_outputs": [n for n in b.outputs if n.startswith("present")],
            "inputs": inputs, "outputs": outputs,
        })
    return {"format": FORMAT, "source": str(source), "boundaries": [c.tensor for c in cuts],
            "cuts": [{"tensor": c.tensor, "layer": c.layer, "kind": c.kind, "part": c.part,
                      "hands": [n for n in blocks[k + 1].inputs if made.get(n) == k]} for k, c in enumerate(cuts)],
            "stages": stages, "balance": max(sizes) / max(min(sizes), 1)}


def _verify(check: _Check, model: onnx.ModelProto, boundaries: list[str], files: list[Path],
            types: Mapping[str, onnx.ValueInfoProto]) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """The written stages, chained, against the whole model (``check.reference``, else ``model``); the result,
    and the shape of every tensor the run saw.

    A model within the budget runs whole and each stage from its file (external data beside it). A bigger
    one runs layer by layer, the whole model's blocks and each written stage's (read back from its file,
    cut at the layer boundaries inside it): one layer's weights in memory at a time either way. The stages
    run in onnxruntime, or under ``check.evaluator`` (a lowered model's NPU ops).
    """
    budget = DEFAULT_BUDGET if check.budget is None else check.budget
    if check.reference is not None:
        model = modelio.read_model(check.reference).model
        shapes.fix_inputs(model, check.input_shapes)
        types = value_types(model)
    names = [o.name for o in model.graph.output]
    small = 3 * modelio.proto_size(model) <= budget
    whole: Callable[[Mapping[str, np.ndarray]], list[np.ndarray]]
    try:
        if small:
            session = verifier.session(model)
            whole = lambda feeds: verifier.run(session, feeds)  # noqa: E731
        else:
            fine = partition(model.graph, boundaries if check.reference is None else find_boundaries(model.graph))
            whole = lambda feeds: _run_blocks(model, fine, types, feeds)  # noqa: E731
        feeds = verifier.make_feeds(model, seed=check.seed, input_data=check.input_data, run=whole)
    except verifier.Unrunnable as exc:
        return verifier.skipped(f"onnxruntime cannot run the model: {exc}"), {}
    except Exception as exc:  # noqa: BLE001 -- ORT's own errors, no input sizes it runs at, no layers
        return verifier.skipped(f"onnxruntime cannot run the whole model: {verifier.first_line(exc)}"), {}
    expected = feeds.outputs if feeds.outputs is not None else whole(feeds)
    env = dict(feeds)
    for f in files:
        if small:
            env.update(_run_stage(f, env, check.evaluator))
            continue
        stage = modelio.read_model(f).model
        made = {y for n in stage.graph.node for y in n.output}
        inner = partition(stage.graph, [b for b in boundaries if b in made])
        _run_blocks(stage, inner, value_types(stage), env, into=env, evaluator=check.evaluator)
    result = verifier.compare(expected, [env[n] for n in names], names, rtol=check.rtol, atol=check.atol)
    if not small:
        result["mode"] = "block-wise"
    return result, {n: [int(d) for d in np.shape(v)] for n, v in env.items()}


def _run_stage(path: Path, env: Mapping[str, np.ndarray], evaluator: Optional[Evaluator]) -> dict[str, np.ndarray]:
    """A stage file run on the values of ``env`` it reads (its external data beside it); its outputs by name."""
    if evaluator is None:
        session = verifier.session(path)
        wanted = [i.name for i in session.get_inputs()]
        return dict(zip([o.name for o in session.get_outputs()], verifier.run(session, {n: env[n] for n in wanted})))
    stage = onnx.load(str(path))
    inits = {t.name for t in stage.graph.initializer}
    wanted = [vi.name for vi in stage.graph.input if vi.name not in inits]
    return dict(zip([o.name for o in stage.graph.output], evaluator(stage).run(None, {n: env[n] for n in wanted})))


def _run_blocks(model: onnx.ModelProto, blocks: list[Block], types: Mapping[str, onnx.ValueInfoProto],
                feeds: Mapping[str, np.ndarray], into: Optional[dict] = None,
                evaluator: Optional[Evaluator] = None) -> list[np.ndarray]:
    """``model`` run block by block on ``feeds`` (values land in ``into`` when given); its outputs."""
    env = dict(feeds) if into is None else into
    for block in blocks:
        if block.outputs:  # a stage ending at a boundary leaves an empty block after it
            env.update(run_block(block_model(model, block, types), env, evaluator))
    return [env[o.name] for o in model.graph.output]


def is_split(path: str | os.PathLike) -> bool:
    """True for a ``k3opt split`` output folder or its manifest file."""
    p = Path(path)
    p = p / MANIFEST if p.is_dir() else p
    if p.suffix != ".json" or not p.is_file():
        return False
    try:
        return json.loads(p.read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """A split's manifest (the file, or its folder); raises InputError for anything else."""
    p = Path(path)
    if p.is_dir():
        p = p / MANIFEST
    try:
        manifest = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: not a k3opt split manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise InputError(f"{path}: not a k3opt split manifest (format {FORMAT} expected)")
    manifest["folder"] = str(p.parent)
    return manifest


