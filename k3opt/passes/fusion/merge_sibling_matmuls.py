"""merge-sibling-matmuls: projections of the same activation become one MatMul and a Split.

Q/K/V (GQA's unequal sizes included), SwiGLU gate/up, MLA's q_a/kv_a and
each MoE expert's gate/up are MatMuls with constant 2-D weights reading one
activation ``x``. They become ``MatMul(x, concat(W_i, axis=-1))`` followed by
a ``Split`` on the last axis (sizes as an input from opset 13, an attribute
before). When every sibling feeds a constant bias ``Add`` broadcasting over
the last axis only, the Adds become one Add before the Split, which
fuse-matmul-add (order 700) then turns into a Gemm. The Split's outputs are
the siblings' own output tensors, so names and graph outputs are unchanged.

Not a single-rooted pattern (a group is found from the shared input), so
the pass works on gs directly. Merged weights of external-data models are
lazy: nothing is read or copied until the model is saved (k3opt/modelio/concat_values.py).
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
from ... import graph as gs

from ...graph.ir import Graph, Node, const_tensor, disconnect, is_graph_output, peek, rank, stored_values
from ...graph.dtypes import PACKED_BITS, onnx_type
from ...modelio.concat_values import concat_last_axis
from ...patterns.matcher import describe
from ...pipeline.analyses import Shapes
from ...pipeline.pass_base import Hints, Pass, PassContext


def _projection_weight(node: Node) -> Optional[gs.Constant]:
    """The constant 2-D weight of ``MatMul(x, W)`` with a non-constant ``x``, else None."""
    if node.op != "MatMul" or node.domain not in (None, "", "ai.onnx"):
        return None
    if len(node.inputs) != 2 or len(node.outputs) != 1:
        return None
    x, w = node.inputs
    weight = const_tensor(w)
    if weight is None or isinstance(x, gs.Constant) or const_tensor(x) is not None:
        return None
    if len(weight.shape) != 2 or onnx_type(weight.dtype) in PACKED_BITS:
        return None
    return weight


def _sibling_groups(graph: Graph, ctx: PassContext) -> list[list[tuple[Node, gs.Constant]]]:
    """Groups of projections of the same activation, same dtype and K, whose merge saves a node, in graph
    order (MatMuls from the census ``ctx`` shares at this graph version; a scan when it has none).
    """
    groups: dict[tuple, list[tuple[Node, gs.Constant]]] = {}
    for node in ctx.nodes_of(graph, ("MatMul",)):
        weight = _projection_weight(node)
        if weight is not None:
            key = (id(node.inputs[0]), onnx_type(weight.dtype), int(weight.shape[0]))
            groups.setdefault(key, []).append((node, weight))
    return [g for g in groups.values() if _worth_merging(graph, g, ctx.target)]


def _worth_merging(graph: Graph, group: list[tuple[Node, gs.Constant]], target: Any) -> bool:
    """n siblings become one MatMul and a Split (and their n bias Adds one Add): a pair without the bias merge
    keeps the node count and only adds the Split, which copies the whole merged output (onnxruntime CPU:
    SwiGLU's gate/up pair merged made a Llama prefill of 512 tokens 4-10 % slower, docs/benchmarks.md), so
    the onnx target leaves it. The cann target merges it (``Target.merges_projection_pairs``): Ascend's LLM
    implementations run gate and up as one matmul (MindIE/ATB's merged gate_up weight, torch_npu's npu_swiglu
    over the merged output), one bigger Cube call instead of two."""
    if len(group) > 2 or (len(group) == 2 and target.merges_projection_pairs):
        return True
    return len(group) == 2 and all(_bias_add(graph, n, w) is not None for n, w in group)


def _record_declined(graph: Graph, ctx: PassContext) -> None:
    """Report each MatMul that shares its activation with another MatMul but is no projection, and why.

    (A projection left alone has no sibling projection: the other readers are such MatMuls, reported.)
    """
    readers: dict[int, list[Node]] = {}
    for node in ctx.nodes_of(graph, ("MatMul",)):
        if node.inputs:
            readers.setdefault(id(node.inputs[0]), []).append(node)
    for nodes in readers.values():
        for node in nodes if len(nodes) > 1 else ():
            if _projection_weight(node) is None:
                ctx.site(describe(node), "declined", "not a projection: its weight is not a constant 2-D tensor "
                                                     "of an unpacked type, or its activation is constant")


def _bias_add(graph: Graph, node: Node, weight: gs.Constant) -> Optional[tuple[Node, np.ndarray]]:
    """``(Add, bias as 1-D (N,))`` when the MatMul's only use is a constant bias Add over the last axis."""
    out = node.outputs[0]
    if is_graph_output(graph, out) or len(out.outputs) != 1:
        return None
    add = out.outputs[0]
    if add.op != "Add" or len(add.inputs) != 2 or add.inputs[0] is add.inputs[1]:
        return None
    bias = const_tensor(add.inputs[1] if add.inputs[0] is out else add.inputs[0])
    if bias is None or onnx_type(bias.dtype) != onnx_type(weight.dtype):
        return None
    n = int(weight.shape[1])
    shape = tuple(bias.shape)
    x_rank = rank(node.inputs[0])
    out_rank = x_rank if x_rank is not None else 1  # unknown x: only a 1-D bias is surely not widening
    if len(shape) > out_rank or any(d != 1 for d in shape[:-1]) or (shape and shape[-1] not in (1, n)):
        return None
    return add, np.broadcast_to(peek(bias).reshape(-1), (n,))  # peek: never cached on the Constant


def _merge(graph: Graph, ctx: PassContext, group: list[tuple[Node, gs.Constant]],
           split_sizes: dict[tuple[int, ...], gs.Constant]) -> tuple[list[Node], list[Node]]:
    """Rewire one group through a merged MatMul (+ Add) and Split; returns (new nodes, replaced nodes).

    Groups with the same sizes share one sizes constant (``split_sizes``): every layer has the same,
    and equal copies would only leave CSE a merge per layer and the pass manager another round.
    """
    nodes = [n for n, _ in group]
    weights = [w for _, w in group]
    x = nodes[0].inputs[0]
    sizes = [int(w.shape[1]) for w in weights]
    base = nodes[0].name or "projection"

    def variable(suffix: str) -> gs.Variable:
        shape = None if x.shape is None else list(x.shape[:-1]) + [sum(sizes)]
        return gs.Variable(ctx.fresh_name(f"{base}_{suffix}"), dtype=x.dtype or weights[0].dtype, shape=shape)

    merged_w = gs.Constant(
        ctx.fresh_name(f"{base}_merged_weight"),
        concat_last_axis([stored_values(w) for w in weights]),
    )
    mm_out = variable("merged")
    new = [gs.Node("MatMul", ctx.fresh_name(f"{base}_merged"), inputs=[x, merged_w], outputs=[mm_out])]
    split_in, outputs = mm_out, [n.outputs[0] for n in nodes]
    biases = [_bias_add(graph, n, w) for n, w in group]
    if all(b is not None for b in biases):
        adds = [add for add, _ in biases]
        bias = gs.Constant(ctx.fresh_name(f"{base}_merged_bias"), np.concatenate([b for _, b in biases]))
        split_in = variable("merged_biased")
        new.append(gs.Node("Add", ctx.fresh_name(f"{base}_merged_bias_add"), inputs=[mm_out, bias], outputs=[split_in]))
        outputs = [add.outputs[0] for add in adds]
        nodes += adds
    for n in nodes:
        disconnect(n)  # by identity: gs's clear() finds each entry with the structural Node.__eq__
    if ctx.opset >= 13:
        sizes_t = split_sizes.get(tuple(sizes))
        if sizes_t is None:
            sizes_t = split_sizes[tuple(sizes)] = gs.Constant(ctx.fresh_name(f"{base}_split_sizes"),
                                                              np.array(sizes, dtype=np.int64))
        split = gs.Node("Split", ctx.fresh_name(f"{base}_split"), attrs={"axis": -1}, inputs=[split_in, sizes_t])
    else:
        split = gs.Node("Split", ctx.fresh_name(f"{base}_split"), attrs={"axis": -1, "split": sizes}, inputs=[split_in])
    split.outputs = outputs
    new.append(split)
    ctx.count("sibling_matmuls_merged", len(group))
    ctx.site(describe(group[0][0]), "applied")
    return new, nodes


class MergeSiblingMatMuls(Pass):
    """Merge MatMuls with constant 2-D weights that read the same activation (see module doc)."""

    name = "merge-sibling-matmuls"
    description = "MatMuls with constant weights reading one activation -> one MatMul (+ bias Add) and a Split"
    order = 600
    _hints = Hints(adds_bodies=False)
    preserves = frozenset({Shapes})
    min_opset = 11  # Split with a negative axis
    anchor_ops = frozenset({"MatMul", "Gemm"})

    def run(self, graph: Graph, ctx: PassContext) -> int:
        """Merge in the graph and in every If/Loop/Scan body (a body's siblings may read an outer activation)."""
        return sum(self._merge_in(g, ctx) for g in ctx.graphs(graph))

    def _merge_in(self, graph: Graph, ctx: PassContext) -> int:
        groups = _sibling_groups(graph, ctx)
        _record_declined(graph, ctx)
        if not groups:
            return 0
        replaced: dict[int, list[Node]] = {}  # id(first sibling) -> new nodes, placed where it was
        gone: set[int] = set()
        split_sizes: dict[tuple[int, ...], gs.Constant] = {}
        for group in groups:
            new, old = _merge(graph, ctx, group, split_sizes)
            replaced[id(old[0])] = new
            gone.update(id(n) for n in old)
        nodes: list[Node] = []
        for n in graph.nodes:
            nodes.extend(replaced.get(id(n), ()))
            if id(n) not in gone:
                nodes.append(n)
        graph.nodes = nodes
        return len(groups)
