"""Block-by-block verification: an original and an optimized model compared one block pair at a time.

Both graphs are cut at the same layer boundaries (the original's residual stream tensors; k3opt's passes
keep their names, and a boundary the optimized graph lost is dropped, merging its two blocks). Each
original block runs on the boundary activations of the original's previous block; its optimized twin runs
on the same residual-stream values (its other inputs, such as a mask or rotary tables it computes its own
way, come from the optimized graph's earlier blocks), and every tensor both blocks output (the next
boundary, the graph outputs such as a layer's KV cache) is compared. Only one block's weights are in
memory at a time: blocks are grouped so that a group's weights stay under the budget's half.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np
import onnx

from ..pipeline import verify as verifier
from . import plan
from .session import Evaluator, block_model, run_block, value_types
from .structure import Block, find_boundaries, partition


class Cut:
    """An original and an optimized model cut at the same boundaries into block pairs."""

    def __init__(self, original: onnx.ModelProto, optimized: onnx.ModelProto, budget: int):
        self.original, self.optimized, self.budget = original, optimized, budget
        boundaries = find_boundaries(original.graph)  # raises NoLayers
        made = {y for n in optimized.graph.node for y in n.output}
        kept = [b for b in boundaries if b in made]
        self.dropped = [b for b in boundaries if b not in made]
        fine_o, fine_p = partition(original.graph, kept), partition(optimized.graph, kept)
        sizes = [max(a.weight_bytes, b.weight_bytes) for a, b in zip(fine_o, fine_p)]
        groups = plan.group_under(sizes, max(budget // 2, 1))  # raises TooLarge
        self.boundaries = [kept[g[-1]] for g in groups[:-1]]
        #: What each block holds, from the layer-wise blocks: "embeddings, layer 0", "layer 2", "layer 3, head".
        self.covers = [", ".join(_fine_name(i, len(fine_o)) for i in g) for g in groups]
        self.blocks_o: list[Block] = partition(original.graph, self.boundaries)
        self.blocks_p: list[Block] = partition(optimized.graph, self.boundaries)
        self.types_o, self.types_p = value_types(original), value_types(optimized)

    def __len__(self) -> int:
        return len(self.blocks_o)

    def weight_bytes(self, k: int) -> int:
        return max(self.blocks_o[k].weight_bytes, self.blocks_p[k].weight_bytes)


def _fine_name(i: int, count: int) -> str:
    return "embeddings" if i == 0 else "head" if i == count - 1 else f"layer {i - 1}"


def run_original(cut: Cut, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """The original model's outputs on ``feeds``, run block by block (a runner for choosing input sizes)."""
    env = dict(feeds)
    for k, block in enumerate(cut.blocks_o):
        env.update(run_block(block_model(cut.original, block, cut.types_o, f"block{k}"), env))
    return [env[o.name] for o in cut.original.graph.output]


def verify(cut: Cut, feeds: Mapping[str, np.ndarray], *, rtol: Optional[float] = None,
           atol: Optional[float] = None, stop_after: Optional[int] = None,
           evaluator: Optional[Evaluator] = None, originals: Optional[list] = None) -> dict[str, Any]:
    """Compare ``cut``'s block pairs in order on ``feeds``; the verification record (see :func:`record`).

    ``evaluator`` runs the optimized blocks (a lowered model's, under the target's reference ops).
    ``originals`` keeps the original blocks' outputs: filled by a first run, read by a later one on the same
    feeds and original blocks (the lowering's check after the optimization's), which then runs none."""
    env_o: dict[str, np.ndarray] = dict(feeds)
    env_p: dict[str, np.ndarray] = dict(feeds)
    stream = set(cut.boundaries)
    graph_outputs = [o.name for o in cut.original.graph.output]
    per_block, finals = [], {}
    last = len(cut) - 1 if stop_after is None else min(stop_after, len(cut) - 1)
    for k in range(last + 1):
        bo, bp = cut.blocks_o[k], cut.blocks_p[k]
        if originals is not None and k < len(originals):
            out_o = originals[k]
        else:
            out_o = run_block(block_model(cut.original, bo, cut.types_o, f"block{k}"), env_o)
            if originals is not None:
                originals.append(out_o)
        env_o.update(out_o)
        feeds_p = {n: env_o[n] if n in stream or n not in env_p else env_p[n] for n in bp.inputs}
        try:
            out_p = run_block(block_model(cut.optimized, bp, cut.types_p, f"block{k}"), feeds_p, evaluator)
        except Exception as exc:  # noqa: BLE001 -- ORT's own exception types: the optimized block fails
            runner = "onnxruntime" if evaluator is None else "the reference evaluator"
            entry = verifier.failed(f"{runner} cannot run the optimized block: {verifier.first_line(exc)}",
                                    rtol, atol)
            per_block.append(_entry(k, cut, entry))
            break
        env_p.update(out_p)
        names = [n for n in bo.outputs if n in out_p]
        result = verifier.compare([out_o[n] for n in names], [out_p[n] for n in names], names, rtol=rtol, atol=atol)
        missing = [n for n in bo.outputs if n in graph_outputs and n not in out_p]
        if missing:
            result = verifier.failed(f"the optimized block does not compute {', '.join(missing)}", rtol, atol)
        per_block.append(_entry(k, cut, result))
        finals.update((o["name"], o) for o in result["outputs"] if o["name"] in graph_outputs)
        for n in bo.inputs:  # activations no later block reads are dropped
            if not any(n in b.inputs for b in cut.blocks_o[k + 1:]) and n not in feeds:
                env_o.pop(n, None)
        if result["status"] != "passed":
            break
    return record(per_block, [finals[n] for n in graph_outputs if n in finals], cut, rtol, atol)


def _entry(k: int, cut: Cut, result: dict[str, Any]) -> dict[str, Any]:
    entry = {"block": k, "covers": cut.covers[k], "status": result["status"], "weight_bytes": cut.weight_bytes(k),
             "ends_at": cut.boundaries[k] if k < len(cut.boundaries) else "graph outputs",
             "tol_fraction": result.get("tol_fraction", float("inf")), "max_abs": result.get("max_abs", float("inf"))}
    if result["status"] != "passed":
        entry["detail"] = verifier.failure_detail(result)
    return entry


def record(per_block: list[dict], outputs: list[dict], cut: Cut, rtol: Optional[float],
           atol: Optional[float]) -> dict[str, Any]:
    """The report's verification record: the graph outputs' figures, and ``blocks`` (one entry per block)."""
    bad = next((b for b in per_block if b["status"] != "passed"), None)
    status = "failed" if bad is not None else "passed"
    out = {"status": status, "mode": "block-wise", "outputs": outputs, "blocks": per_block,
           "rtol": max((o["rtol"] for o in outputs), default=rtol or 1e-4),
           "atol": max((o["atol"] for o in outputs), default=atol or 1e-5),
           "tol_fraction": max((b["tol_fraction"] for b in per_block), default=0.0),
           "max_abs": max((b["max_abs"] for b in per_block), default=0.0)}
    if bad is not None:
        out["first_diverging_block"] = bad["block"]
        out["reason"] = f"block {bad['block']} ({bad['covers']}; ends at {bad['ends_at']}) differs: {bad['detail']}"
    if cut.dropped:
        out["merged_boundaries"] = list(cut.dropped)
    return out


def summary(v: Mapping[str, Any]) -> str:
    """One line for the report: how many blocks were compared and how they came out."""
    blocks = v.get("blocks", [])
    if v["status"] == "passed":
        return f"verified block by block: {len(blocks)} block(s) equal ({verifier.error_figures(v)})"
    return f"verified block by block: first diverging block {v.get('first_diverging_block')}"
