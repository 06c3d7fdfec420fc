"""A transformer's layer structure: the residual stream between decoder layers, and the blocks it cuts.

The residual stream is the longest chain of ``Add(r, f(r))`` nodes (``r`` read by the Add and, through
the sublayer ``f``, by its other operand). A sublayer that holds an attention (a fused attention op, or a
Softmax feeding a MatMul of two activations) starts a decoder layer, so the layer boundaries are the
stream tensors entering each attention sublayer, plus the last one (the final norm and the head follow).
:func:`find_stack` also lists where else a pipeline split may cut: the stream between a layer's sublayers,
and activations inside a sublayer that are all a cut there hands on besides the stream. Nothing here reads
a weight: it works on the structure of a model of any size, original or optimized
(k3opt's passes keep the residual Adds and their output names; the cann MoE lowering's
NPUMoeFinalizeRouting, which takes over a residual Add, keeps its output name and is read as a stream step).

:func:`partition` puts every node in one block: block 0 computes the first boundary (the embeddings),
block ``k`` the ``k``-th, the last block what follows the last boundary (final norm, lm_head). A node
no boundary needs goes to the first block that reads it, or, read by none (a graph output), to the last
block among its inputs'. Side computations (from the graph inputs and small constants alone: Constant
nodes, the attention mask, rotary tables, positions) are copied into every other block that reads them,
so the tensors crossing a boundary are the residual stream, KV caches and little else.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from typing import Iterable, Mapping, Optional

import onnx

from ..errors import InputError
from ..modelio import EXTERNAL_THRESHOLD, tensor_nbytes

#: Fused attention ops (ONNX Attention-23, onnxruntime's contrib ops, the NPU ops of the cann target).
ATTENTION_OPS = frozenset(("Attention", "MultiHeadAttention", "GroupQueryAttention", "PackedAttention",
                           "NPUPromptFlashAttention", "NPUIncreFlashAttention", "NPUFusedAttentionScore",
                           "PromptFlashAttention", "IncreFlashAttention", "FusedInferAttentionScore"))
#: Nodes searched back from an Add's operand for its residual input (a sublayer is far smaller).
_SEARCH_LIMIT = 20_000
_PASSTHROUGH = frozenset(("Cast", "Identity"))


class NoLayers(InputError):
    """No layer structure was found: the model cannot be cut into blocks."""


@dataclasses.dataclass
class Block:
    """Nodes (indices into ``graph.node``, in graph order) and the tensors that cross the block's edges."""

    nodes: list[int]
    inputs: list[str]  # read, produced elsewhere: graph inputs and earlier blocks' tensors (no initializers)
    outputs: list[str]  # produced here, read by later blocks or graph outputs
    weights: list[str]  # initializers read
    weight_bytes: int
    copied: list[int] = dataclasses.field(default_factory=list)  # Constant nodes copied from other blocks


def node_inputs(node: onnx.NodeProto) -> list[str]:
    """A node's inputs, with the outer-scope names its subgraphs (If/Loop/Scan bodies) read."""
    names = [x for x in node.input if x]
    for attr in node.attribute:
        for g in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
            names += _outer_names(g)
    return names


def _outer_names(g: onnx.GraphProto) -> list[str]:
    inner = {i.name for i in g.input} | {t.name for t in g.initializer}
    outer = []
    for node in g.node:
        outer += [x for x in node_inputs(node) if x not in inner]
        inner.update(node.output)
    return outer + [o.name for o in g.output if o.name not in inner]


class _Index:
    """Producers and consumers of a graph's tensors."""

    def __init__(self, graph: onnx.GraphProto):
        self.graph = graph
        self.initializers = {t.name for t in graph.initializer}
        self.producer: dict[str, int] = {}
        self.consumers: dict[str, list[int]] = {}
        self.inputs = [node_inputs(n) for n in graph.node]
        for i, node in enumerate(graph.node):
            for x in self.inputs[i]:
                self.consumers.setdefault(x, []).append(i)
            for y in node.output:
                if y:
                    self.producer[y] = i

    def constant(self, name: str) -> bool:
        p = self.producer.get(name)
        return name in self.initializers or (p is not None and self.graph.node[p].op_type == "Constant")

    def stream_source(self, name: str) -> str:
        """``name`` followed up through Casts and Identities (a norm reads the stream through a Cast)."""
        while name in self.producer:
            node = self.graph.node[self.producer[name]]
            if node.op_type not in _PASSTHROUGH or not node.input:
                break
            name = node.input[0]
        return name

    def ancestors(self, name: str, floor: int) -> Optional[set[int]]:
        """Nodes above ``name`` produced after node ``floor`` (None past the search limit)."""
        seen: set[int] = set()
        todo = [name]
        while todo:
            p = self.producer.get(todo.pop())
            if p is None or p <= floor or p in seen:
                continue
            seen.add(p)
            if len(seen) > _SEARCH_LIMIT:
                return None
            todo += self.inputs[p]
        return seen


@dataclasses.dataclass(frozen=True)
class CutPoint:
    """A tensor a split may cut the stack at (the next stage receives it), and where it lies."""

    tensor: str
    layer: int  # the layer it starts (kind "layer") or lies in
    kind: str  # "layer": a layer boundary; "sublayer": the stream after a sublayer; "inner": inside a sublayer
    part: str  # the sublayer it follows ("sublayer") or lies in ("inner"): "attention" or "mlp"; "" for "layer"
    hands: int  # activations it hands on besides the residual stream (1 for "inner", else 0)


@dataclasses.dataclass
class Stack:
    """A decoder stack's layer boundaries (:func:`find_boundaries`) and every place a split may cut it."""

    boundaries: list[str]
    points: list[CutPoint]  # in order; neither before layer 0 nor after the last layer (the tables join them)


def find_boundaries(graph: onnx.GraphProto) -> list[str]:
    """The residual-stream tensors at the decoder-layer boundaries, in order; raises NoLayers."""
    return find_stack(graph).boundaries


def find_stack(graph: onnx.GraphProto, inner: bool = False) -> Stack:
    """The layer boundaries and cut points of ``graph``; raises NoLayers.

    The cut points are the layer boundaries after layer 0 and, inside each layer, the stream between its
    sublayers (after the attention's residual Add: the layer's KV cache stays with its attention). With
    ``inner``, also the activations inside a sublayer that are, with the stream, all a cut there hands on
    (:func:`_inner_points`: in a SwiGLU MLP, ``act(gate(x)) * up(x)`` before the down projection).
    """
    index = _Index(graph)
    chain, segments = _residual_chain(index)
    if len(chain) < 3:
        raise NoLayers("no layer structure found: looked for a residual stream (a chain of at least two "
                       "Add(x, f(x)) nodes between decoder layers)")
    attention = [_has_attention(index, seg) for seg in segments]
    starts = [i for i, a in enumerate(attention) if a] or list(range(len(segments)))
    sizes = {t.name: tensor_nbytes(t) for t in graph.initializer} if inner else {}
    side = _side_nodes(index, set(chain)) if inner else set()
    points = []
    for layer, start in enumerate(starts):
        end = starts[layer + 1] if layer + 1 < len(starts) else len(segments)
        if layer:
            points.append(CutPoint(chain[start], layer, "layer", "", 0))
        for i in range(start, end):
            part = "attention" if attention[i] else "mlp"
            if inner:
                add = index.producer[chain[i + 1]]
                points += [CutPoint(t, layer, "inner", part, 1) for t in _inner_points(index, segments[i], add, side,
                                                                                       sizes)]
            if i + 1 < end:
                points.append(CutPoint(chain[i + 1], layer, "sublayer", part, 0))
    return Stack([chain[i] for i in starts] + [chain[-1]], points)


def _inner_points(index: _Index, segment: set[int], add: int, side: set[int], sizes: Mapping[str, int]) -> list[str]:
    """Tensors ``t`` of a sublayer (its nodes ``segment``, its residual Add ``add``) such that ``t`` is the only
    tensor the nodes ``t`` depends on hand to the rest of the sublayer (side computations and constants are
    copied, not handed), with weights of at least 1 KiB on both sides: a cut at ``t`` hands on ``t`` and the
    stream. Of the tensors splitting the weights the same way, the last in graph order."""
    graph = index.graph
    members = [i for i in sorted(segment) if i not in side and graph.node[i].op_type != "Constant"]
    inside = set(members)

    def weights(nodes: Iterable[int]) -> frozenset[str]:
        return frozenset(x for i in nodes for x in index.inputs[i] if sizes.get(x, 0) >= EXTERNAL_THRESHOLD)

    found: dict[frozenset[str], tuple[int, str]] = {}
    for p in members:
        outs = [y for y in graph.node[p].output if y]
        if len(outs) != 1:
            continue
        above: set[int] = set()
        todo = [p]
        while todo:
            q = todo.pop()
            if q in above or q not in inside:
                continue
            above.add(q)
            todo += [index.producer[x] for x in index.inputs[q] if x in index.producer]
        below = (inside - above) | {add}
        handed = {y for q in above for y in graph.node[q].output if any(c in below for c in index.consumers.get(y, ()))}
        first, rest = weights(above), weights(inside - above)
        if handed == set(outs) and first and rest - first:
            found[first] = (p, outs[0])
    return [t for _, t in sorted(found.values())]


def _residual_chain(index: _Index) -> tuple[list[str], list[set[int]]]:
    """The longest chain of stream tensors r0 -> r1 ... (r_{i+1} = Add(r_i, f(r_i))), and each f's nodes."""
    nxt: dict[str, tuple[str, set[int]]] = {}
    for i, node in enumerate(index.graph.node):
        step = _stream_step(index, node)
        if step is None:
            continue
        out, pairs = step
        for r, others in pairs:
            if index.constant(r) or any(index.constant(o) for o in others) or len(index.consumers.get(r, ())) < 2:
                continue
            floor = index.producer.get(r, -1)
            found = [index.ancestors(o, floor) for o in others]
            branch = set().union(*found) if all(b is not None for b in found) else None
            if branch and any(r in index.inputs[j] for j in branch):
                source = index.stream_source(r)
                if source not in nxt:
                    nxt[source] = (out, branch)
                    break
    targets = {t for t, _ in nxt.values()}
    best: tuple[list[str], list[set[int]]] = ([], [])
    for start in nxt:
        if start in targets:
            continue
        chain, segments, t = [start], [], start
        while t in nxt and len(chain) <= len(nxt):
            t, branch = nxt[t]
            chain.append(t)
            segments.append(branch)
        if len(chain) > len(best[0]):
            best = (chain, segments)
    return best


def _stream_step(index: _Index, node: onnx.NodeProto) -> Optional[tuple[str, list[tuple[str, list[str]]]]]:
    """A node that may add a sublayer to the stream: its output and the (stream input, other inputs) pairs to try.

    An ``Add(r, f(r))``; or the cann target's ``NPUMoeFinalizeRouting``, which adds its skip inputs ``x1``/``x2``
    (the residual among them, flattened to (tokens, hidden) by a Reshape, its result unflattened by one) to the
    MoE experts' weighted sum (k3opt.targets.cann.passes.lower_moe_npu folds the residual Add into it).
    """
    if node.op_type == "Add" and len(node.input) == 2 and node.output[0]:
        a, b = node.input
        return node.output[0], [(a, [b]), (b, [a])]
    if node.op_type != "NPUMoeFinalizeRouting" or not node.output or not node.output[0]:
        return None
    out = node.output[0]
    readers = index.consumers.get(out, ())
    if len(readers) == 1 and index.graph.node[readers[0]].op_type == "Reshape":
        out = index.graph.node[readers[0]].output[0]
    pairs = []
    for slot in (1, 2):
        if len(node.input) > slot and node.input[slot]:
            r = _unflattened(index, node.input[slot])
            pairs.append((r, [x for j, x in enumerate(node.input) if x and j != slot and not index.constant(x)]))
    return out, pairs


def _unflattened(index: _Index, name: str) -> str:
    """``name``, or the input of the Reshape that computes it (read by nothing else)."""
    p = index.producer.get(name)
    if p is not None and index.graph.node[p].op_type == "Reshape" and len(index.consumers.get(name, ())) == 1:
        return index.graph.node[p].input[0]
    return name


def _has_attention(index: _Index, nodes: Iterable[int]) -> bool:
    """A fused attention op, or a Softmax whose output reaches (within 3 nodes) a MatMul of two activations."""
    graph = index.graph
    for i in nodes:
        op = graph.node[i].op_type
        if op in ATTENTION_OPS:
            return True
        if op != "Softmax":
            continue
        frontier = deque([(graph.node[i].output[0], 0)])
        while frontier:
            name, depth = frontier.popleft()
            for c in index.consumers.get(name, ()):
                node = graph.node[c]
                if node.op_type == "MatMul" and not any(index.constant(x) for x in node.input):
                    return True
                if depth < 3:
                    frontier.extend((y, depth + 1) for y in node.output)
    return False


def _side_nodes(index: _Index, boundaries: set[str]) -> set[int]:
    """Nodes computed from the graph inputs and small constants alone (a mask, rotary tables, positions): a block
    that reads one recomputes it instead of receiving it. A KV-cache input (``past*``) or a weight read
    makes a node no side node (a stage gets only its own layers' caches); so does a boundary output."""
    side: set[int] = set()
    graph = index.graph
    small = {t.name for t in graph.initializer if tensor_nbytes(t) < EXTERNAL_THRESHOLD}
    inputs = {vi.name for vi in graph.input if not vi.name.startswith("past")}
    for i, node in enumerate(graph.node):
        if any(y in boundaries for y in node.output):
            continue
        if all(x in small or (x in inputs and x not in index.initializers) or index.producer.get(x) in side
               for x in index.inputs[i]):
            side.add(i)
    return side


def partition(graph: onnx.GraphProto, boundaries: list[str]) -> list[Block]:
    """Cut ``graph`` at ``boundaries`` (in order) into ``len(boundaries) + 1`` blocks."""
    index = _Index(graph)
    nodes = graph.node
    owner: dict[int, int] = {}
    for k, name in enumerate(boundaries):
        if name not in index.producer:
            raise NoLayers(f"boundary tensor '{name}' is not produced by a node")
        todo = [index.producer[name]]
        while todo:
            i = todo.pop()
            if i in owner or nodes[i].op_type == "Constant":
                continue
            owner[i] = k
            todo += [index.producer[x] for x in index.inputs[i] if x in index.producer]
    last = len(boundaries)
    after = {boundaries[-1]} if boundaries else set()
    for i, node in enumerate(nodes):  # what follows the last boundary (final norm, head) is the last block's
        if i not in owner and node.op_type != "Constant" and any(x in after for x in index.inputs[i]):
            owner[i] = last
            after.update(node.output)
    for i in range(len(nodes) - 1, -1, -1):  # the rest where first read (a mask computed where it is used)
        if i in owner or nodes[i].op_type == "Constant":
            continue
        readers = [owner[c] for y in nodes[i].output for c in index.consumers.get(y, ()) if c in owner]
        if readers:
            owner[i] = min(readers)
    for i, node in enumerate(nodes):  # read by none (a graph output such as a KV cache): with its inputs
        if i not in owner and node.op_type != "Constant":
            owner[i] = max((owner.get(index.producer[x], 0) for x in index.inputs[i] if x in index.producer),
                           default=0)
    blocks = [Block([], [], [], [], 0) for _ in range(last + 1)]
    for i, node in enumerate(nodes):
        if node.op_type == "Constant":
            readers = [owner[c] for y in node.output for c in index.consumers.get(y, ()) if c in owner]
            owner[i] = min(readers, default=last)
        blocks[owner[i]].nodes.append(i)
    pure = _side_nodes(index, set(boundaries))
    for k, block in enumerate(blocks):  # side computations read from another block are recomputed here
        todo = [index.producer[x] for i in block.nodes for x in index.inputs[i] if x in index.producer]
        copied: set[int] = set()
        while todo:
            p = todo.pop()
            if p in copied or owner[p] == k or p not in pure:
                continue
            copied.add(p)
            todo += [index.producer[x] for x in index.inputs[p] if x in index.producer]
        block.copied = sorted(copied)
    sizes = {t.name: tensor_nbytes(t) for t in graph.initializer}
    graph_outputs = [o.name for o in graph.output]
    for block in blocks:
        mine = set(block.nodes) | set(block.copied)
        made = {y for i in mine for y in nodes[i].output if y}
        read: dict[str, None] = {}
        for i in sorted(mine):
            read.update((x, None) for x in index.inputs[i])
        block.weights = [x for x in read if x in sizes and x not in made]
        block.weight_bytes = sum(sizes[x] for x in block.weights)
        block.inputs = [x for x in read if x not in made and x not in sizes]
    later: set[str] = set(graph_outputs)
    for block in reversed(blocks):
        block.outputs = [y for i in block.nodes for y in nodes[i].output if y in later]
        later.update(block.inputs)
    return blocks
