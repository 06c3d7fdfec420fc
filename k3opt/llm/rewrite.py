"""Turn a decode-step export (Concat-grown KV cache) into a serving pair: a prefill graph and a static decode graph.

Both are exact rewrites of the decode step as recognised by
:mod:`k3opt.llm.cache_form`:

* **prefill** (:func:`prefill_graph`): the step with an empty past. The past
  inputs become empty tensors, each ``Concat(past, new)`` becomes ``new``, so
  the presents are the prompt's k/v ``[B, Hkv, T, D]``; the lm_head runs on the
  last position only (:func:`last_row_logits`), logits ``[B, 1, V]``.
* **decode** (:func:`decode_graph`): one token per sequence over a fixed cache
  ``[B, Hkv, L, D]`` per tensor. The new k/v is written at ``position`` with
  ``ScatterElements`` (axis 2) instead of being concatenated, so the keys are
  always ``L`` long: the graph is told its past is ``L - 1`` long (key length
  ``L``, every shape static) while the token positions, read as
  ``Range(0, S) + P``, become ``Range(0, 1) + position``. The causal mask
  the graph builds from those positions (key ``j`` visible iff ``j <=
  position``) then hides every slot past the write, and ``attention_mask``
  ``[B, L]`` hides left padding. One graph per batch size: every dim static.

Position semantics are those of the export's own decode loop: the position of
a token is its slot in the cache (left padding included), as when the
original step is run from an empty cache.
"""
from __future__ import annotations

import copy
from typing import Optional

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import InputError
from .cache_form import CacheLayout, _attr, _consumers, constant_value, recognise

POSITION = "position"
_ROW_WISE = ("Add", "Sub", "Mul", "Div", "Tanh", "Cast", "Softcap")  # per-row ops an lm_head may end in
_INT64_MAX = np.iinfo(np.int64).max
#: Ops that carry a position on as an index (position_table follows these only).
_INDEX_OPS = ("Add", "Sub", "Cast", "Unsqueeze", "Squeeze", "Reshape", "Expand", "Identity", "Slice", "Concat")
_INT_TYPES = (TensorProto.INT32, TensorProto.INT64)


class _Names:
    """Fresh value/node names with a k3opt prefix, unique in ``graph``."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.used = {v for n in graph.node for v in list(n.input) + list(n.output)}
        self.used |= {i.name for i in graph.input} | {t.name for t in graph.initializer}
        self.count = 0

    def __call__(self, stem: str) -> str:
        while True:
            self.count += 1
            name = f"k3opt_llm/{stem}_{self.count}"
            if name not in self.used:
                self.used.add(name)
                return name


def _const(graph: onnx.GraphProto, names: _Names, stem: str, value: np.ndarray) -> str:
    name = names(stem)
    graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
    return name


def _node(nodes: list, names: _Names, op: str, inputs: list[str], stem: str, **attrs) -> str:
    out = names(stem)
    nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
    return out


def _set_dims(vi: onnx.ValueInfoProto, dims: list) -> None:
    shape = vi.type.tensor_type.shape
    shape.ClearField("dim")
    for d in dims:
        dim = shape.dim.add()
        if isinstance(d, int):
            dim.dim_value = d
        else:
            dim.dim_param = d


def _rename_uses(graph: onnx.GraphProto, old: str, new: str) -> None:
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new


def _insert_after_producers(graph: onnx.GraphProto, extra: list[onnx.NodeProto]) -> None:
    """Put ``extra`` first: they read graph inputs/initializers or each other only (ordered)."""
    nodes = extra + list(graph.node)
    graph.ClearField("node")
    graph.node.extend(nodes)


def _toposort(graph: onnx.GraphProto) -> None:
    """Reorder nodes so every input is produced before use (the rewrites add nodes that read later values)."""
    known = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    pending, ordered = list(graph.node), []
    while pending:
        rest = []
        for node in pending:
            if all(i in known for i in node.input):
                ordered.append(node)
                known.update(node.output)
            else:
                rest.append(node)
        if len(rest) == len(pending):
            raise InputError("the rewritten graph has a cycle (a cache input feeds its own update)")
        pending = rest
    graph.ClearField("node")
    graph.node.extend(ordered)


def _drop_inputs(graph: onnx.GraphProto, drop: set[str]) -> None:
    kept = [i for i in graph.input if i.name not in drop]
    graph.ClearField("input")
    graph.input.extend(kept)


def _bypass(graph: onnx.GraphProto, node: onnx.NodeProto, value: str) -> None:
    """Remove ``node`` (one output), its readers reading ``value`` instead; a graph output keeps its name."""
    out = node.output[0]
    graph.node.remove(node)
    if out in {o.name for o in graph.output}:
        graph.node.append(helper.make_node("Identity", [value], [out], name=out + "/k3opt_llm_identity"))
    else:
        _rename_uses(graph, out, value)


# ----------------------------------------------------------------------------- prefill

def prefill_graph(model: onnx.ModelProto) -> onnx.ModelProto:
    """The prompt step: ids and mask ``[B, T]`` in, last-position logits ``[B, 1, V]`` and the prompt's k/v out."""
    out = copy.deepcopy(model)
    graph = out.graph
    layout = recognise(out)
    names, extra = _Names(graph), []
    ids_shape = _node(extra, names, "Shape", [layout.ids], "ids_shape")
    zero = _const(graph, names, "zero", np.array([0], dtype=np.int64))
    one = _const(graph, names, "one", np.array([1], dtype=np.int64))
    batch = _node(extra, names, "Slice", [ids_shape, zero, one], "batch")
    for entry in layout.entries:
        empty = _const(graph, names, "empty_cache",
                       np.zeros((1, entry.heads, 0, entry.dim), dtype=onnx.helper.tensor_dtype_to_np_dtype(layout.dtype)))
        ones = _const(graph, names, "ones3", np.ones(3, dtype=np.int64))
        shape = _node(extra, names, "Concat", [batch, ones], "empty_shape", axis=0)
        past = _node(extra, names, "Expand", [empty, shape], "empty_past")
        _rename_uses(graph, entry.past, past)
        entry.concat.input[0] = past  # dropped next: the present is the new k/v alone
        _bypass(graph, entry.concat, entry.new)
    _insert_after_producers(graph, extra)
    _drop_inputs(graph, {e.past for e in layout.entries})
    for vi in graph.input:
        if vi.name == layout.mask:
            dims = [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
            ids = next(i for i in graph.input if i.name == layout.ids)
            _set_dims(vi, [dims[0], ids.type.tensor_type.shape.dim[1].dim_param or "sequence"])
    for o in graph.output:
        if o.name in {e.present for e in layout.entries}:
            entry = next(e for e in layout.entries if e.present == o.name)
            _set_dims(o, ["batch", entry.heads, "sequence", entry.dim])
    last_row_logits(out)
    _toposort(graph)
    return out


def last_row_logits(model: onnx.ModelProto, logits: str = "logits") -> None:
    """Compute the lm_head on the last position only: a Slice on its input row, or on the logits as a last resort.

    Walks back from ``logits`` through row-wise ops with a constant operand
    (bias, scale, softcap) to a MatMul whose weight is a constant matrix (or its
    Transpose, as dynamo writes it), and
    slices its ``[B, T, E]`` activation to ``[B, 1, E]``: every op on the way
    treats rows independently, so the result is the last row of the original.
    """
    graph = model.graph
    producers = {o: n for n in graph.node for o in n.output}
    names = _Names(graph)
    value = logits
    while True:
        node = producers.get(value)
        if node is None:
            break
        if node.op_type == "MatMul" and _constant_matrix(graph, node.input[1], producers) and \
                constant_value(graph, node.input[0], producers) is None:
            node.input[0] = _slice_last(graph, names, node.input[0])
            _relabel_logits(graph, logits)
            return
        consts = [constant_value(graph, i, producers) is not None for i in node.input]
        if node.op_type in _ROW_WISE and consts.count(False) == 1 and all(
                _broadcasts_per_row(constant_value(graph, i, producers)) for i, c in zip(node.input, consts) if c):
            value = node.input[consts.index(False)]
            continue
        break
    # no lm_head MatMul found: slice the logits themselves (exact, but the head still runs on every row)
    out_vi = next(o for o in graph.output if o.name == logits)
    full = names("full_logits")
    producers[logits].output[list(producers[logits].output).index(logits)] = full
    _rename_uses(graph, logits, full)
    sliced = _slice_last(graph, names, full)
    graph.node.append(helper.make_node("Identity", [sliced], [logits], name=logits + "/k3opt_llm_identity"))
    del out_vi
    _relabel_logits(graph, logits)


def _constant_matrix(graph: onnx.GraphProto, name: str, producers: dict[str, onnx.NodeProto]) -> bool:
    """``name`` is a constant 2-D weight: an initializer or Constant, or ``Transpose(perm=[1, 0])`` of one (how the
    dynamo exporter writes ``nn.Linear``). Read by its dims alone: an lm_head may be a GB."""
    node = producers.get(name)
    if node is not None and node.op_type == "Transpose" and _attr(node, "perm", None) in (None, [1, 0]):
        return _constant_matrix(graph, node.input[0], producers)
    init = next((t for t in graph.initializer if t.name == name), None)
    if init is not None:
        return len(init.dims) == 2
    if node is not None and node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
        return len(node.attribute[0].t.dims) == 2
    return False


def _broadcasts_per_row(value: Optional[np.ndarray]) -> bool:
    return value is not None and (value.ndim <= 1 or all(d == 1 for d in value.shape[:-1]))


def _slice_last(graph: onnx.GraphProto, names: _Names, value: str) -> str:
    starts = _const(graph, names, "last_start", np.array([-1], dtype=np.int64))
    ends = _const(graph, names, "last_end", np.array([_INT64_MAX], dtype=np.int64))
    axes = _const(graph, names, "last_axis", np.array([1], dtype=np.int64))
    out = names("last_row")
    graph.node.append(helper.make_node("Slice", [value, starts, ends, axes], [out], name=out))
    return out


def _relabel_logits(graph: onnx.GraphProto, logits: str) -> None:
    for o in graph.output:
        if o.name == logits:
            dims = [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim]
            if len(dims) == 3:
                _set_dims(o, [dims[0], 1, dims[2]])


# ----------------------------------------------------------------------------- decode

def decode_graph(model: onnx.ModelProto, max_seq: int, batch: int) -> onnx.ModelProto:
    """The static one-token step over a ``[batch, Hkv, max_seq, D]`` cache written in place at ``position``."""
    out = copy.deepcopy(model)
    graph = out.graph
    layout = recognise(out)
    names, extra = _Names(graph), []
    scalar = _const(graph, names, "scalar_shape", np.zeros(0, dtype=np.int64))
    pos = _node(extra, names, "Reshape", [POSITION, scalar], "position_scalar")
    if not _redirect_positions(graph, layout, pos, names, extra):
        raise InputError("cache layout not recognised: no token position is computed from the past length "
                         "(expected Range(0, S) + past length)")
    for shape in layout.shape_nodes:  # the graph's view of its past: L - 1 tokens, so its keys are L long
        start, end = _attr(shape, "start", 0), _attr(shape, "end", None)
        entry = _entry_of_shape(layout, shape)
        dims = np.array([batch, entry.heads, max_seq - 1, entry.dim], dtype=np.int64)[start:end]
        shape.CopyFrom(helper.make_node("Constant", [], [shape.output[0]], name=shape.name or shape.output[0],
                                        value=numpy_helper.from_array(dims)))
    index_shape = _const(graph, names, "index_shape", np.ones(4, dtype=np.int64))
    pos4 = _node(extra, names, "Reshape", [pos, index_shape], "position_4d")
    for entry in layout.entries:
        new_shape = names("new_shape")
        index = names("write_index")
        entry.concat.CopyFrom(helper.make_node(
            "ScatterElements", [entry.concat.input[0], index, entry.new], [entry.concat.output[0]],
            name=entry.concat.name or entry.concat.output[0], axis=2))
        graph.node.extend([helper.make_node("Shape", [entry.new], [new_shape], name=new_shape),
                           helper.make_node("Expand", [pos4, new_shape], [index], name=index)])
    _insert_after_producers(graph, extra)
    graph.input.append(helper.make_tensor_value_info(POSITION, TensorProto.INT64, [1]))
    for vi in graph.input:
        if vi.name == layout.ids:
            _set_dims(vi, [batch, 1])
        elif vi.name == layout.mask:
            _set_dims(vi, [batch, max_seq])
        else:
            entry = next((e for e in layout.entries if e.past == vi.name), None)
            if entry is not None:
                _set_dims(vi, [batch, entry.heads, max_seq, entry.dim])
    for o in graph.output:
        entry = next((e for e in layout.entries if e.present == o.name), None)
        if entry is not None:
            _set_dims(o, [batch, entry.heads, max_seq, entry.dim])
        elif o.type.tensor_type.shape.dim and len(o.type.tensor_type.shape.dim) == 3:
            _set_dims(o, [batch, 1, o.type.tensor_type.shape.dim[2].dim_value or "vocab"])
    _toposort(graph)
    return out


def _entry_of_shape(layout: CacheLayout, shape: onnx.NodeProto):
    """The cache entry a Shape node reads (through the aliases recognise followed)."""
    for entry in layout.entries:
        if shape.input[0] in (entry.past, entry.concat.input[0]):
            return entry
    return layout.entries[0]  # every cache tensor has the same batch and length; heads/dim matter only if sliced


def _redirect_positions(graph: onnx.GraphProto, layout: CacheLayout, pos: str, names: _Names, extra: list) -> bool:
    """Make every ``Add(Range(...), P)`` read ``position`` instead of the past length ``P``; True if any did."""
    consumers = _consumers(graph)
    producers = {o: n for n in graph.node for o in n.output}
    found, todo, seen = False, [(v, pos) for v in layout.lengths], set()
    while todo:
        value, replacement = todo.pop()
        if value in seen:
            continue
        seen.add(value)
        for node in consumers[value]:
            if node.op_type == "Cast":
                cast = _node(extra, names, "Cast", [replacement], "position_cast", to=_attr(node, "to"))
                todo.append((node.output[0], cast))
            elif node.op_type == "Add" and len(node.input) == 2:
                other = node.input[1] if node.input[0] == value else node.input[0]
                if other in producers and producers[other].op_type == "Range":
                    node.input[list(node.input).index(value)] = replacement
                    found = True
    return found


def position_table(decode: onnx.ModelProto) -> Optional[int]:
    """Rows of the smallest constant table the decode graph indexes with a value computed from ``position``
    (GPT-2's learned position embeddings), or None when positions index no table (RoPE computed on the fly)."""
    graph = decode.graph
    consumers = _consumers(graph)
    inits = {t.name: t for t in graph.initializer}
    reached, todo, rows = {POSITION}, [POSITION], []
    while todo:
        for node in consumers[todo.pop()]:
            if node.op_type == "Gather" and node.input[0] in inits and node.input[1] in reached:
                rows.append(int(inits[node.input[0]].dims[_attr(node, "axis", 0)]))
            if node.op_type not in _INDEX_OPS or (node.op_type == "Cast" and _attr(node, "to") not in _INT_TYPES):
                continue
            for out in node.output:
                if out not in reached:
                    reached.add(out)
                    todo.append(out)
    return min(rows) if rows else None
