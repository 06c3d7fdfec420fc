"""Hand the decode graph's flash attentions the cache's valid length, so the kernel reads no slot past it.

The cann target's :meth:`~k3opt.targets.base.Target.bound_cache_reads`, for ``k3opt llm``'s serving pair. In a
lowered decode graph every attention reads the whole fixed cache ``[B, Hkv, L, D]``; the graph's own mask
already hides the slots past ``position`` (the graph input holding the step's slot).
``NPUPromptFlashAttention`` also takes ``actual_seq_lengths_kv`` (input 7 in the plugin's groups,
[PFA-plugin] in :mod:`k3opt.targets.cann.npu_contract`): per batch, the keys from that length
on are not computed ([PFA-doc] "actualSeqLengthsKv"; one value applies to
every batch). Passing ``position + 1`` changes no number (those keys were
masked) and lets the kernel skip the cache's unwritten tail: torchair's Llama
guide passes the valid length the same way to IncreFlashAttention
(``npu_tuned_model/llm/llama/README.md``). IncreFlashAttention nodes (an MQA
cache without a mask) are left as they are: the reference op does not model
their ``actual_seq_lengths`` yet.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

_PFA = "NPUPromptFlashAttention"
_KV_LENGTHS = 6  # input index of actual_seq_lengths_kv


def pass_valid_lengths(model: onnx.ModelProto, position: str) -> int:
    """Set ``actual_seq_lengths_kv = position + 1`` on every PromptFlashAttention of decode graph ``model``
    (in place) that has no lengths and no quantization inputs; ``position`` names the graph input holding the
    step's cache slot. Returns how many it set."""
    graph = model.graph
    one, length = "k3opt_llm/one_slot", "k3opt_llm/valid_length"
    count = 0
    for node in graph.node:
        if node.op_type != _PFA or len(node.input) > _KV_LENGTHS + 1:
            continue
        if any(node.input[i] for i in range(5, len(node.input))):
            continue
        while len(node.input) < _KV_LENGTHS:
            node.input.append("")
        node.input[_KV_LENGTHS:] = [length]
        count += 1
    if count:
        graph.initializer.append(numpy_helper.from_array(np.array([1], dtype=np.int64), one))
        graph.node.insert(0, helper.make_node("Add", [position, one], [length], name=length))
    return count
