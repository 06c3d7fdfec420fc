"""``k3opt split PAIR_DIR``: a serving pair (docs/llm.md) cut into pipeline stages, every graph at the same places.

The prefill graph and each decode graph of a ``k3opt llm`` folder are cut at the same cut points (matched by
layer, kind and sublayer: :func:`k3opt.blocks.structure.find_stack` finds them in every graph), chosen as
``k3opt split`` chooses them on the decode graph of the largest batch (its weights plus its static KV cache,
the memory a card holds while serving). Stage ``i`` is the folder ``stage<i>/``: its part of every graph
(``prefill.onnx``, ``decode_b<B>.onnx``) and one ``weights.bin`` they all point into, each tensor once. A
layer's cache entries go with its attention, in the prefill graphs (``present.*`` out) and the decode graphs
(``past_key_values.*`` in and out) alike.

The manifest (``manifest.json``, format ``k3opt-pipeline/1``, ``kind`` ``llm-pair``) holds the pair's own
manifest (``pair``), the cuts, and per stage the layers, bytes, cache entries and, per graph, the file and the
tensors it takes and hands on. :func:`staged_runner` generates through the stages chained (``k3opt generate``
takes the folder); verification (on by default) is that the chained stages generate the same greedy tokens as
the unsplit pair, each run under the reference NPU ops for a cann pair.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import onnx

from .. import modelio
from ..blocks.split import (DEFAULT_BALANCE, FORMAT as SPLIT_FORMAT, MANIFEST, CutPoint, check_out_dir,
                            check_stage_bytes, choose_cuts, cache_bytes, inferred_types, publish, read_manifest, stage_model,
                            tensor_entry)
from ..blocks.structure import Stack, find_stack, partition
from ..errors import InputError
from ..graph.symbolic.relations import Lin, relations
from ..modelio.temp_folders import TempFolder
from .generate import PairRunner, session
from .manifest import FORMAT as PAIR_FORMAT, Manifest
from .pair import check_tokens, share_weights

KIND = "llm-pair"


def is_pair(path: Any) -> bool:
    """True for a ``k3opt llm`` folder (its manifest names the pair format)."""
    p = Path(path) / MANIFEST
    try:
        return p.is_file() and json.loads(p.read_text()).get("format") == PAIR_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _key(point: CutPoint) -> tuple[int, str, str]:
    return point.layer, point.kind, point.part


def split_pair(
    pair: Any, out_dir: Any, stages: Optional[int] = None, *, layers: Optional[Sequence[tuple[int, int]]] = None,
    balance: float = DEFAULT_BALANCE, max_stage_bytes: Optional[int] = None, verify: bool = True,
    overwrite: bool = False, progress: Optional[Callable[[str], None]] = None,
) -> dict[str, Any]:
    """Cut the pair in folder ``pair`` into ``stages`` stages (or the inclusive ``layers`` ranges) written into
    ``out_dir``; returns the manifest. Nothing is written when a check fails."""
    say = progress or (lambda _msg: None)
    out = check_out_dir(Path(out_dir), overwrite)
    folder = Path(pair)
    pm = Manifest.read(folder)
    files = [pm.prefill] + [pm.decode[b] for b in sorted(pm.decode)]
    say("loading the pair")
    models = {f: modelio.read_model(folder / f).model for f in files}
    ref = pm.decode[max(pm.decode)]
    stacks: dict[tuple[str, bool], Stack] = {}

    def stack(f: str, inner: bool) -> Stack:
        if (f, inner) not in stacks:
            stacks[f, inner] = find_stack(models[f].graph, inner)  # raises NoLayers
        return stacks[f, inner]

    def common(inner: bool) -> Stack:  # the decode graph's cut points that every graph has
        keys = [{_key(p) for p in stack(f, inner).points} for f in files]
        mine = stack(ref, inner)
        return Stack(mine.boundaries, [p for p in mine.points if all(_key(p) in k for k in keys)])

    counts = {f: len(stack(f, False).boundaries) - 1 for f in files}
    if len(set(counts.values())) > 1:
        raise InputError(f"{pair}: the pair's graphs have different layer counts ({counts}); cannot cut them alike")
    types = {f: inferred_types(m) for f, m in models.items()}
    gear_dims = _name_gear_dims(models[pm.prefill], types[pm.prefill], pm.ids)
    cuts = choose_cuts(models[ref].graph, common, types[ref], stages, layers, balance)
    tensors = {f: {_key(p): p.tensor for p in stack(f, any(c.kind == "inner" for c in cuts)).points} for f in files}
    blocks = {f: partition(models[f].graph, [tensors[f][_key(c)] for c in cuts]) for f in files}
    count = len(cuts) + 1
    sizes = []
    for i in range(count):
        weights = {t.name: modelio.tensor_nbytes(t) for f in files for t in models[f].graph.initializer
                   if t.name in set(blocks[f][i].weights)}
        sizes.append(sum(weights.values()) + cache_bytes(blocks[ref][i], types[ref]))
    check_stage_bytes(sizes, max_stage_bytes)
    temp = TempFolder.next_to(out)
    try:
        staged = temp.path / "stages"
        staged.mkdir()
        for i in range(count):
            say(f"writing stage {i}")
            (staged / f"stage{i}").mkdir()
            graphs = {f: stage_model(models[f], blocks[f][i], types[f], i, count) for f in files}
            share_weights(graphs, staged / f"stage{i}")
            for f, g in graphs.items():
                onnx.save(g, str(staged / f"stage{i}" / f))
        manifest = _manifest(folder, pm, models, blocks, types, cuts, counts[ref], sizes, ref)
        manifest["gear_dims"] = gear_dims
        (staged / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if verify:
            from ..api import reference_evaluator

            evaluator = reference_evaluator(pm.target)  # None: onnxruntime runs the graphs
            say("checking the stages chained generate the pair's tokens")
            whole = PairRunner(folder, evaluator=evaluator)
            check_tokens(whole.generate, staged_runner(staged, evaluator=evaluator), "the unsplit pair's")
            manifest["verification"] = {"status": "passed", "check": "greedy tokens of the chained stages equal "
                                        "the unsplit pair's (batch 1, and a left-padded batch 2)"}
        else:
            manifest["verification"] = {"status": "skipped", "reason": "--no-verify"}
        (staged / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        publish(staged, out, temp)
    finally:
        temp.remove()
    return manifest


def _name_gear_dims(model: onnx.ModelProto, types: dict[str, onnx.ValueInfoProto], ids: str) -> dict[str, str]:
    """Name in ``types`` the unnamed dims of the prefill's tensors that the symbolic shape walk proves equal to
    a dim of the input ids (batch, prompt length: the prefill's ATC gears) or to a number, so the tensors a
    stage hands on carry the gear dims; returns {dim name: gear} (``batch``, ``sequence``: the pair's gears)."""
    weights = {t.name for t in model.graph.initializer}
    declared = {vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
                for vi in model.graph.input if vi.name not in weights}
    gears = {d: g for d, g in zip(declared.get(ids, []), ("batch", "sequence")) if isinstance(d, str) and d}
    walked = relations(model.graph, declared).shapes
    symbols = {Lin.of(d): d for d in gears}
    for name, vi in types.items():
        dims, shape = vi.type.tensor_type.shape.dim, walked.get(name)
        if shape is None or len(shape) != len(dims) or name in weights:
            continue
        for d, lin in zip(dims, shape):
            if d.HasField("dim_value") or lin is None:
                continue
            if lin.is_const:
                d.dim_value = lin.const
            elif lin in symbols:
                d.dim_param = symbols[lin]
    return gears


def _manifest(pair: Path, pm: Manifest, models: dict[str, onnx.ModelProto], blocks: dict[str, list],
              types: dict[str, dict], cuts: list[CutPoint], layer_count: int, sizes: list[int],
              ref: str) -> dict[str, Any]:
    firsts = [0] + [c.layer for c in cuts]
    lasts = [c.layer - 1 if c.kind == "layer" else c.layer for c in cuts] + [layer_count - 1]
    cached = {e.past for e in pm.entries}
    stages = []
    for i in range(len(sizes)):
        graphs = {}
        for f, parts in blocks.items():
            made = {y: k for k, b in enumerate(parts) for y in b.outputs}
            b = parts[i]
            readers = {n: [j for j, later in enumerate(parts) if n in later.inputs] for n in b.outputs}
            graphs[f] = {
                "file": f"stage{i}/{f}", "nodes": len(b.nodes) + len(b.copied),
                "inputs": [dict(tensor_entry(n, types[f]), **{"from": made.get(n, "graph")}) for n in b.inputs],
                "outputs": [dict(tensor_entry(n, types[f]), to=readers[n]) for n in b.outputs],
            }
        owned = [e for e in pm.entries if e.past in blocks[ref][i].inputs]
        stages.append({"index": i, "device": i, "folder": f"stage{i}", "weights": f"stage{i}/weights.bin",
                       "layers": [firsts[i], lasts[i]], "bytes": sizes[i],
                       "cache": [{"past": e.past, "present": e.present} for e in owned if e.past in cached],
                       "graphs": graphs})
    return {"format": SPLIT_FORMAT, "kind": KIND, "source": str(pair), "target": pm.target, "pair": pm.to_json(),
            "outputs": {f: [o.name for o in m.graph.output] for f, m in models.items()},
            "boundaries": [c.tensor for c in cuts],
            "cuts": [{"tensor": c.tensor, "layer": c.layer, "kind": c.kind, "part": c.part} for c in cuts],
            "stages": stages, "balance": max(sizes) / max(min(sizes), 1)}


class _Chained:
    """One graph of the pair as its stages run in sequence: ``run(None, feeds)`` gives the unsplit graph's
    outputs, each stage fed from the feeds and the earlier stages."""

    def __init__(self, folder: Path, manifest: dict[str, Any], graph: str, threads: int,
                 evaluator: Optional[Callable[[onnx.ModelProto], Any]]) -> None:
        entries = [s["graphs"][graph] for s in manifest["stages"]]
        self.stages = [(session(folder / e["file"], threads, evaluator), [t["name"] for t in e["inputs"]],
                        [t["name"] for t in e["outputs"]]) for e in entries]
        self.outputs = manifest["outputs"][graph]

    def run(self, _outputs: Any, feeds: dict) -> list:
        env = dict(feeds)
        for sess, inputs, outputs in self.stages:
            env.update(zip(outputs, sess.run(None, {n: env[n] for n in inputs})))
        return [env[n] for n in self.outputs]


def staged_runner(folder: Any, threads: int = 1,
                  evaluator: Optional[Callable[[onnx.ModelProto], Any]] = None) -> PairRunner:
    """A PairRunner generating through the split pair in ``folder``, its stages chained."""
    folder = Path(folder)
    data = read_manifest(folder)
    if data.get("kind") != KIND:
        raise InputError(f"{folder}: not a split serving pair (k3opt split of a k3opt llm folder)")
    pm = Manifest.from_json(data["pair"], folder, folder / MANIFEST)
    return PairRunner(folder, threads, evaluator, manifest=pm,
                      open_graph=lambda graph: _Chained(folder, data, graph, threads, evaluator))


def is_split_pair(path: Any) -> Optional[str]:
    """The target of the split serving pair in folder ``path`` (``k3opt split`` of a ``k3opt llm`` folder), or
    None for anything else."""
    try:
        data = read_manifest(path) if Path(path).is_dir() else {}
    except InputError:
        return None
    return str(data.get("target")) if data.get("kind") == KIND else None
