"""The MoE export trap: a TorchScript trace of an eager experts loop keeps only the experts hit while tracing.

transformers' eager experts (``MixtralExperts.forward`` and its kin) loop over ``expert_hit =
nonzero(one_hot(top_k_index).sum(...))`` and, per expert hit, select its tokens with ``torch.where`` (NonZero)
and add their FFN output back. A trace unrolls that loop for the experts hit by the example: the graph has a
fixed number of NonZero-fed branches, each taking ``expert_hit[i]`` for a constant i. On another input it
silently drops the tokens of the experts past that count, or fails when fewer experts are hit. This module
recognises the shape (:func:`traced_experts_warnings`) so that ``k3opt optimize`` and ``k3opt check`` say so.
"""
from __future__ import annotations

from typing import Optional

import onnx
from onnx import numpy_helper

#: How many producers a branch's NonZero may be above the one-hot mask it selects from.
_DEPTH = 6


def traced_experts_warnings(model: onnx.ModelProto) -> list[str]:
    """One line per traced experts loop of the main graph (empty for anything else)."""
    nodes = list(model.graph.node)
    if not any(n.op_type == "OneHot" for n in nodes) or not any(n.op_type == "NonZero" for n in nodes):
        return []
    producer = {o: n for n in nodes for o in n.output}
    tables = {i.name: list(i.dims) for i in model.graph.initializer}
    found = []
    for hot in (n for n in nodes if n.op_type == "OneHot"):
        branches = [n for n in nodes if n.op_type == "NonZero" and _selects_from(n, hot, producer)]
        if not branches:
            continue
        experts = _experts(hot, nodes, producer, tables)
        of = f" of {experts}" if experts else ""
        found.append(
            f"MoE experts at '{hot.name}': a trace of the experts loop kept {len(branches)}{of} expert branches (the "
            "experts hit while tracing, NonZero-fed): other inputs silently drop the tokens of the missing experts, "
            "or fail; export with `k3opt export` (batched_mm experts) or the dynamo exporter with "
            "experts_implementation='batched_mm'")
    return found


def _selects_from(nonzero: onnx.NodeProto, hot: onnx.NodeProto, producer: dict) -> bool:
    """``NonZero([Cast](Gather(<the one-hot mask, permuted>, i)))``: one expert's rows of the mask."""
    n: Optional[onnx.NodeProto] = producer.get(nonzero.input[0])
    gather = None
    for _ in range(_DEPTH):
        if n is None:
            return False
        if n is hot:
            return gather is not None
        if n.op_type == "Gather" and gather is None:
            gather = n
        elif n.op_type not in ("Cast", "Transpose", "Gather", "Squeeze", "Unsqueeze", "Reshape"):
            return False
        n = producer.get(n.input[0])
    return False


def _experts(hot: onnx.NodeProto, nodes: list, producer: dict, tables: dict) -> Optional[int]:
    """The expert count: the one-hot depth minus transformers' extra class, checked against a rank-3 expert
    weight table gathered by expert (``gate_up_proj[expert_idx]``) when there is one."""
    depth = None
    source = producer.get(hot.input[1])
    if source is not None and source.op_type == "Constant" and source.attribute and source.attribute[0].name == "value":
        depth = int(numpy_helper.to_array(source.attribute[0].t).reshape(-1)[0])
    gathered = {len(t) == 3 and t[0] for n in nodes if n.op_type == "Gather" and n.input[0] in tables
                for t in [tables[n.input[0]]]} - {False}
    if len(gathered) == 1:
        return int(gathered.pop())
    return depth - 1 if depth else None
