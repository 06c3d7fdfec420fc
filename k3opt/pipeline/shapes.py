"""Shapes: fixing input dimensions (--input-shape) and refreshing inferred shapes on the graph.

Shape inference helps passes (broadcast checks, folding shape arithmetic)
but must never make a run fail: :class:`ShapeRefresher` returns False and
records why when onnx cannot infer a model, and the passes that need shapes
then decline (see docs/design.md).
"""
from __future__ import annotations

from typing import Callable, Mapping, NamedTuple, Optional, Sequence, Union

import numpy as np
import onnx
from .. import graph as gs
from onnx import TensorProto
from onnx.external_data_helper import uses_external_data
from ..graph import OnnxExporter, dtypes
from ..graph import SparseValues

from ..errors import UsageError
from ..graph.gs_export import import_domains, node_bytes, write_value_info
from ..graph.wire import copy_fields, field, varint
from ..modelio import EXTERNAL_THRESHOLD, inline_copy, is_weight
from ..graph.ir import declared_symbols, stored_values, tensor_map

InputShapes = Union[Mapping[str, Sequence[int]], Sequence[str]]


def parse_input_shape(spec: str) -> tuple[str, list[int]]:
    """``"NAME:D1,D2,..."`` -> (name, dims); the name may itself contain ':'."""
    name, sep, dims = spec.rpartition(":")
    if not sep or not name:
        raise UsageError(f"--input-shape '{spec}': expected NAME:D1,D2,... (e.g. input_ids:1,128)")
    try:
        values = [int(d) for d in dims.split(",")]
    except ValueError:
        raise UsageError(f"--input-shape '{spec}': dimensions must be integers") from None
    if any(d <= 0 or d >= 2**63 for d in values):
        raise UsageError(f"--input-shape '{spec}': dimensions must be positive int64 values")
    return name, values


def normalize_input_shapes(shapes: Optional[InputShapes]) -> dict[str, list[int]]:
    """Accept a mapping name -> dims or a list of ``NAME:D1,D2`` strings."""
    if not shapes:
        return {}
    if isinstance(shapes, Mapping):
        return {str(k): [int(d) for d in v] for k, v in shapes.items()}
    if isinstance(shapes, str):
        shapes = [shapes]
    out: dict[str, list[int]] = {}
    for name, dims in map(parse_input_shape, shapes):
        if out.setdefault(name, dims) != dims:
            raise UsageError(f"--input-shape: '{name}' given twice, as {_dims_text(out[name])} and {_dims_text(dims)}")
    return out


def _dims_text(dims: Sequence[int]) -> str:
    return ",".join(map(str, dims))


def fix_inputs(model: onnx.ModelProto, shapes: Optional[InputShapes]) -> None:
    """Set graph-input dimensions in place; unknown names or a wrong rank are a UsageError."""
    fixed = normalize_input_shapes(shapes)
    inits = {t.name for t in model.graph.initializer}
    inputs = {vi.name: vi for vi in model.graph.input if vi.name not in inits}
    symbols: dict[str, tuple[int, str]] = {}  # a named dim's size, and the input that gave it
    for name, dims in fixed.items():
        if name not in inputs:
            raise UsageError(f"--input-shape: '{name}' is not a graph input; inputs: {', '.join(inputs)}")
        shape = inputs[name].type.tensor_type.shape
        if len(shape.dim) != len(dims):
            raise UsageError(f"--input-shape: '{name}' has rank {len(shape.dim)}, got {len(dims)} dimensions")
        for dim, value in zip(shape.dim, dims):
            if dim.HasField("dim_value") and dim.dim_value != value:
                raise UsageError(f"--input-shape: '{name}' has fixed dimension {dim.dim_value}, not {value}")
            if dim.HasField("dim_param") and dim.dim_param:
                size, given_by = symbols.setdefault(dim.dim_param, (value, name))
                if size != value:
                    raise UsageError(f"--input-shape: dimension '{dim.dim_param}' is {size} for '{given_by}' "
                                     f"but {value} for '{name}'; one dimension has one size")
    for name, dims in fixed.items():
        shape = inputs[name].type.tensor_type.shape
        for dim, value in zip(shape.dim, dims):
            dim.Clear()
            dim.dim_value = value


class Light(NamedTuple):
    """A model serialized for shape inference, big weights left out; and whether it holds a long 1-D tensor
    data propagation could read: a graph input or output, a weight, or (seed only) a Constant node's value.

    Serialized because onnx takes bytes: a refresh joins the bytes of each
    node and constant instead of building (copying) a ModelProto.
    """

    data: bytes
    long_io: bool


def _infer(light: Light, propagate_first: bool = False, strict: bool = True) -> tuple[Inferred, bool]:
    """Inference with data propagation unless a 1-D tensor is long (then without); and whether it propagated.

    ``propagate_first`` (the caller knows of no long vector: the last inference
    of this graph propagated) tries data propagation alone first, one run
    instead of two; the result (or error) is the same, since the usual two
    runs are still made whenever that one fails or shows a long vector.
    """
    propagated = None
    if propagate_first and not light.long_io:
        try:
            propagated = _run(light, data_prop=True, strict=strict)
        except Exception:  # noqa: BLE001 -- the usual order below reports the error as before
            propagated = None
        if propagated is not None and not propagated.long:
            return propagated, True
    plain = _run(light, strict=strict)
    if plain.long:
        return plain, False
    if propagated is not None:
        return propagated, True
    return _run(light, data_prop=True, strict=strict), True


def _run(light: Light, data_prop: bool = False, strict: bool = True) -> Inferred:
    return inferred_types(onnx.shape_inference.infer_shapes(light.data, strict_mode=strict, data_prop=data_prop).graph)


#: onnx's data propagation materializes 1-D tensors; past this length it costs gigabytes.
DATA_PROP_MAX_LEN = 2**16


def _has_long_vector(graph: onnx.GraphProto) -> bool:
    return any(_long_type(vi.type) for infos in (graph.input, graph.value_info, graph.output) for vi in infos)


def _long_type(tp: onnx.TypeProto) -> bool:
    dims = tp.tensor_type.shape.dim
    return len(dims) == 1 and dims[0].dim_value > DATA_PROP_MAX_LEN  # 0 when not set


class Inferred(NamedTuple):
    """An inferred graph's value_info and output types by name, serialized (a name's last entry wins);
    a TypeProto for each distinct type; whether the graph holds a long 1-D tensor.

    Each entry's type is serialized once, for both uses: the long-vector check
    looks at each distinct type once (16k entries, ~2k types on the 64-layer
    Llama), and :func:`apply_shapes` converts types by these bytes.
    """

    types: dict[str, bytes]
    protos: dict[bytes, onnx.TypeProto]
    long: bool
    #: The inferred graph itself: its If/Loop/Scan bodies hold their own value_info (see :func:`apply_shapes`).
    graph: Optional[onnx.GraphProto] = None


def inferred_types(graph: onnx.GraphProto) -> Inferred:
    """The :class:`Inferred` view of ``graph``; ``long`` is :func:`_has_long_vector` (inputs read as they are)."""
    types: dict[str, bytes] = {}
    protos: dict[bytes, onnx.TypeProto] = {}
    for vi in list(graph.value_info) + list(graph.output):
        tp = vi.type
        key = types[vi.name] = tp.SerializeToString()
        if key not in protos:
            protos[key] = tp
    long = any(map(_long_type, protos.values())) or any(_long_type(vi.type) for vi in graph.input)
    return Inferred(types, protos, long, graph)


#: Types a run knows of some of its tensors by an op's definition, by name (see :class:`ShapeRefresher`).
ShapeFacts = Mapping[str, onnx.TypeProto]


class ShapeRefresher:
    """``(graph) -> bool`` for the PassManager: refresh tensor shapes/dtypes in place.

    Failures are recorded in ``notes`` (once each) instead of raised.

    ``facts``: types known of tensors by the definition of the op that computed them before the run wrote it
    decomposed (:mod:`k3opt.modelio.opset23_down`), given to onnx's inference as the value_info of those
    tensors wherever the graph still has them: a pass keeps a value under its name, so its shape holds, and
    inference carries the symbols on where the decomposed form's broadcasts would lose them. Inference that
    fails with them is tried again without them, for good (and noted).
    """

    def __init__(self, facts: Optional[ShapeFacts] = None) -> None:
        self.facts = dict(facts or {})
        self.notes: list[str] = []
        self.calls = 0
        #: The last inference propagated data (no long 1-D tensor): it is tried first next time.
        self._short = False
        #: Inferred types converted for gs, reused by the next refreshes (see apply_shapes).
        self._types: dict[frozenset, _Converted] = {}

    def __call__(self, graph: gs.Graph) -> bool:
        tensors = tensor_map(graph)  # one walk of the graph for export and update
        return self._refresh(graph, tensors, lambda: export_for_inference(graph, tensors, self.facts))

    def seed(self, graph: gs.Graph, model: onnx.ModelProto, tensors: Optional[dict[str, gs.Tensor]] = None) -> bool:
        """Refresh ``graph`` freshly imported from ``model`` by inferring ``model`` itself.

        Same result as calling the refresher, without exporting the graph
        again (the first export is the costliest: nothing is folded yet).
        Data propagation is tried first unless the model holds a long 1-D
        tensor (see :func:`model_for_inference`): only such a tensor's data
        can grow long as it propagates (Shape, Concat, Gather... of short
        vectors stay short), and a long result still falls back as usual.
        ``tensors``: ``tensor_map(graph)`` when the caller has it.
        """
        tensors = tensor_map(graph) if tensors is None else tensors
        return self._refresh(graph, tensors, lambda: model_for_inference(model, self.facts), True)

    def _refresh(self, graph: gs.Graph, tensors: dict[str, gs.Tensor], model: Callable[[], Light],
                 propagate_first: bool = False) -> bool:
        self.calls += 1
        try:
            inferred, self._short = _infer(model(), propagate_first or self._short)
        except Exception as exc:  # onnx raises many types here; a failure only loses shapes
            inferred = self._without_facts(graph, tensors) if self.facts else None
            if inferred is None:
                inferred = self._tolerant(graph, tensors, exc)
            if inferred is None:
                return False
        apply_shapes(graph, inferred, tensors, self._types)
        return True

    def _without_facts(self, graph: gs.Graph, tensors: dict[str, gs.Tensor]) -> Optional[Inferred]:
        """Inference without the facts, which are dropped for good when it succeeds; None when it fails too."""
        try:
            inferred = self._infer_graph(graph, tensors, True)
        except Exception:  # noqa: BLE001 -- not the facts' fault: the usual fallback follows
            return None
        self._note(f"the decomposed opset-23 nodes' output shapes ({len(self.facts)}) contradict shape inference: "
                   "not used")
        self.facts = {}
        return inferred

    def _tolerant(self, graph: gs.Graph, tensors: dict[str, gs.Tensor], exc: Exception) -> Optional[Inferred]:
        """Inference after strict inference failed with ``exc``.

        Declared output dims that cannot be sizes (a ``-1`` written as a dim) are dropped and strict
        inference runs again. If it still fails, every shape the graph holds but its inputs' is dropped
        (declared or stale: a contradiction cannot say which side is wrong) and inference runs without
        strict mode: a node it cannot type keeps no shape, the others get theirs, so a pass that needs a
        shape declines only where the shape is missing. The graph's outputs keep their declared shapes.
        """
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        dropped = [t.name for t in graph.outputs if t.shape is not None
                   and any(isinstance(d, (int, np.integer)) and d < 0 for d in t.shape)]
        if dropped:
            for t in graph.outputs:
                if t.name in dropped:
                    t.shape = [None if isinstance(d, (int, np.integer)) and d < 0 else d for d in t.shape]
            self._note(f"declared output shape(s) of {', '.join(dropped)} held negative dims: dropped")
            try:
                return self._infer_graph(graph, tensors, True)
            except Exception:  # noqa: BLE001 -- inferred without strict mode below
                pass
        # the graph's inputs and outputs keep what they declare: the interface is not k3opt's to change (onnx's
        # checker refuses a graph output without a shape, as an opset-1 model inferred without strict mode lost)
        interface = {id(t) for t in graph.inputs} | {id(t) for t in graph.outputs}
        kept = [(t, t.shape) for t in tensors.values() if not isinstance(t, gs.Constant) and id(t) not in interface]
        for t, _ in kept:
            t.shape = None
        try:
            inferred = self._infer_graph(graph, tensors, False)
        except Exception:  # noqa: BLE001 -- the note says what the first failure was
            for t, shape in kept:  # nothing inferred: the graph keeps what it declared
                t.shape = shape
            self._note(f"shape inference failed ({type(exc).__name__}: {first}); passes that need shapes declined")
            return None
        self._note(f"strict shape inference failed ({type(exc).__name__}: {first}); declared shapes dropped and "
                   "shapes inferred without strict mode")
        return inferred

    def _infer_graph(self, graph: gs.Graph, tensors: dict[str, gs.Tensor], strict: bool) -> Inferred:
        inferred, self._short = _infer(export_for_inference(graph, tensors), False, strict)
        return inferred

    def _note(self, note: str) -> None:
        if note not in self.notes:
            self.notes.append(note)


def export_for_inference(graph: gs.Graph, tensors: Optional[dict[str, gs.Tensor]] = None,
                         facts: Optional[ShapeFacts] = None) -> Light:
    """The graph as a model for onnx shape inference, built without reading any big weight.

    No value_info (stale after rewrites: everything is re-inferred) but ``facts`` (see
    :class:`ShapeRefresher`) of the tensors the graph computes, and
    constants of 1 KB or more are typed graph inputs instead of initializers.
    The bytes are the graph's fields serialized one by one and joined
    (protobuf merges repeated fields in order), which parses as the model
    onnx.helper would build. Nothing is kept for the next refresh: reusing
    an unchanged node's bytes cost about as much as writing them again.
    """
    io = onnx.GraphProto(name=graph.name or "k3opt")
    for t in graph.inputs:
        write_value_info(t, io.input)
    for t in graph.outputs:
        write_value_info(t, io.output)
    tensors = tensors if tensors is not None else tensor_map(graph)
    if facts:
        _add_facts(io, facts, {n for n, t in tensors.items() if not isinstance(t, gs.Constant) and t.inputs})
    fields = [io.SerializeToString()]  # first: the weights' inputs follow the graph's own
    long_io = _has_long_vector(io)
    for t in tensors.values():
        if not isinstance(t, gs.Constant) or isinstance(stored_values(t), SparseValues):
            continue
        if getattr(stored_values(t), "nbytes", 0) >= EXTERNAL_THRESHOLD:
            fields.append(_weight_input_field(t))
            shape = stored_values(t).shape
            long_io = long_io or (len(shape) == 1 and shape[0] > DATA_PROP_MAX_LEN)
        else:  # small: shape constants, axes... inference reads their values
            fields.append(_initializer_field(t))
    nodes = list(map(node_bytes, graph.nodes))
    plain = None not in nodes  # then no node holds a subgraph (see _import_domains)
    if not plain:  # gs's own export (which raises where gs does)
        nodes = [OnnxExporter.export_node(n).SerializeToString() if data is None else data
                 for n, data in zip(graph.nodes, nodes)]
    fields += _repeated_field(_GRAPH_NODE, nodes)
    head = onnx.helper.make_model(onnx.GraphProto(), opset_imports=_import_domains(graph, plain),
                                  functions=[OnnxExporter.export_function(f) for f in graph.functions])
    if graph.ir_version is not None:
        head.ir_version = graph.ir_version
    head.ClearField("graph")
    return Light(_model_bytes(head, fields), long_io)


def _add_facts(io: onnx.GraphProto, facts: ShapeFacts, computed: set[str]) -> None:
    """Append to ``io.value_info`` the facts of the names in ``computed`` that are no graph output (declared)."""
    outputs = {vi.name for vi in io.output}
    io.value_info.extend(onnx.helper.make_value_info(name, tp) for name, tp in facts.items()
                         if name in computed and name not in outputs)


def model_for_inference(model: onnx.ModelProto, facts: Optional[ShapeFacts] = None) -> Light:
    """``io.weights_as_inputs(model)`` without value_info (everything is re-inferred, as after an export) but
    ``facts`` (see :func:`export_for_inference`), serialized.

    Joined from the model's parts like :func:`export_for_inference`:
    weights_as_inputs copies the whole model, weights included, only to drop
    them.
    """
    g = model.graph
    head, rest = onnx.ModelProto(), onnx.GraphProto()
    copy_fields(model, head, skip=("graph",))
    copy_fields(g, rest, skip=("node", "initializer", "value_info"))
    big = {t.name: t for t in g.initializer if is_weight(t)}
    declared = {vi.name for vi in g.input}
    rest.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                      for t in big.values() if t.name not in declared)
    if facts:
        _add_facts(rest, facts, {o for n in g.node for o in n.output})
    fields = [rest.SerializeToString()]
    fields += [field(_GRAPH_INITIALIZER, _inline_bytes(t)) for t in g.initializer if t.name not in big]
    nodes = list(map(onnx.NodeProto.SerializeToString, g.node))
    fields += _repeated_field(_GRAPH_NODE, nodes)
    long_data = _has_long_vector(rest) or any(
        _long_constant(n) for n, data in zip(g.node, nodes)
        if _CONSTANT_OP in data and _may_be_long(data) and n.op_type == "Constant")
    return Light(_model_bytes(head, fields), long_data)


def _model_bytes(head: onnx.ModelProto, fields: list[bytes]) -> bytes:
    """``head`` serialized, then ``fields`` joined as its graph: one join, where adding up the
    pieces copied the seed model three more times (fresh memory, page faults)."""
    parts = [head.SerializeToString(), varint(_MODEL_GRAPH << 3 | 2), varint(sum(map(len, fields)))]
    parts += fields
    return b"".join(parts)


#: Bytes every serialized Constant node holds (its op_type field): reading op_type from every
#: other node costs more than finding these in their bytes.
_CONSTANT_OP = field(4, b"Constant")


def _repeated_field(number: int, payloads: list[bytes]) -> list[bytes]:
    """``[field(number, p) for p in payloads]`` as key, payload, key, payload...: each distinct length's key
    is encoded once."""
    keys: dict[int, bytes] = {}
    tag = varint(number << 3 | 2)
    parts: list[Optional[bytes]] = [None] * (2 * len(payloads))
    parts[::2] = [keys.get(n) or keys.setdefault(n, tag + varint(n)) for n in map(len, payloads)]
    parts[1::2] = payloads
    return parts


#: Fewest bytes a node holding a long inline 1-D value takes: its elements at 2 bits each (int2, the
#: narrowest ONNX type; value_ints take a byte each).
_LONG_VALUE_BYTES = DATA_PROP_MAX_LEN // 4


def _may_be_long(data: bytes) -> bool:
    """Whether a node's bytes may hold a long 1-D value (:func:`_long_constant`): bytes enough for one
    inline, or a value whose elements are not all in the node (external data, a sparse tensor)."""
    return len(data) > _LONG_VALUE_BYTES or b"location" in data or b"sparse_value" in data


def _long_constant(node: onnx.NodeProto) -> bool:
    """A Constant node whose value is a 1-D tensor longer than data propagation takes (any other value is short)."""
    for a in node.attribute:
        if a.name == "value_ints" and len(a.ints) > DATA_PROP_MAX_LEN:
            return True
        if a.name in ("value", "sparse_value"):
            dims = a.t.dims if a.name == "value" else a.sparse_tensor.dims
            if len(dims) == 1 and dims[0] > DATA_PROP_MAX_LEN:
                return True
    return False


def _inline_bytes(t: TensorProto) -> bytes:
    """``io.inline_copy(t)`` serialized, copying ``t`` only when it has external data to read in."""
    return (inline_copy(t) if uses_external_data(t) else t).SerializeToString()


#: Field numbers of ModelProto.graph and GraphProto.node, .initializer and .input (onnx.proto).
_MODEL_GRAPH, _GRAPH_NODE, _GRAPH_INITIALIZER, _GRAPH_INPUT = 7, 1, 5, 11


def _initializer_field(t: gs.Constant) -> bytes:
    return field(_GRAPH_INITIALIZER, _inline_bytes(OnnxExporter.export_tensor_proto(t)))


def _weight_input_field(t: gs.Constant) -> bytes:
    """A big constant as a typed graph input: inference needs only its type."""
    values = stored_values(t)
    shape = [int(d) for d in values.shape]
    vi = onnx.helper.make_tensor_value_info(t.name, dtypes.onnx_type(values.dtype), shape)
    return field(_GRAPH_INPUT, vi.SerializeToString())


def _import_domains(graph: gs.Graph, plain: bool) -> list[onnx.OperatorSetIdProto]:
    """:func:`~k3opt.graph.gs_export.import_domains`; ``plain`` (every node written by ``node_bytes``: plain
    or constant attributes) means no subgraph, so the walk for them is saved too."""
    return import_domains(graph, [graph] if plain else None)


_Converted = dict[bytes, Optional[tuple[np.dtype, Optional[tuple]]]]


def apply_shapes(graph: gs.Graph, inferred: Union[onnx.GraphProto, Inferred],
                 tensors: Optional[dict[str, gs.Tensor]] = None,
                 memo: Optional[dict[frozenset, _Converted]] = None) -> None:
    """Copy inferred dtypes and shapes onto the graph's variables (graph inputs untouched).

    ``inferred``: the inferred graph, or its :func:`inferred_types`. Most
    tensors share a few distinct types: each is converted once, keyed by its
    serialized proto; ``memo`` keeps the conversions for the next call (per
    set of declared symbols, the only other thing they depend on).

    Only symbolic dimensions the graph's inputs and outputs declare are kept;
    the ones onnx makes up for unknown dimensions (``unk__N``) become None.
    onnx hands one made-up symbol to several tensors whose sizes differ (the
    SequenceAt outputs of an uneven SplitToSequence share their sequence's
    element type), and onnxruntime trusts equal symbols to mean equal sizes.
    """
    if isinstance(inferred, onnx.GraphProto):
        inferred = inferred_types(inferred)
    if tensors is None:
        tensors = tensor_map(graph)
    declared = declared_symbols(graph)
    converted = {} if memo is None else memo.setdefault(declared, {})
    _apply_types(inferred, tensors, {id(t) for t in graph.inputs}, declared, converted)
    if inferred.graph is not None:
        _apply_bodies(graph, inferred.graph, declared, converted)


#: Ops whose bodies onnx's inference types (value_info inside the body).
BODY_OPS = frozenset({"If", "Loop", "Scan"})


def _apply_bodies(graph: gs.Graph, proto: onnx.GraphProto, declared: frozenset[str], converted: _Converted) -> None:
    """:func:`apply_shapes` on the bodies of ``graph``'s If/Loop/Scan nodes, from the inferred ``proto``.

    The inferred graph lists the nodes in the gs graph's order (both the seed and the refresh export them
    so); a node whose op differs there is skipped. Only tensors a body's own nodes compute are updated
    (its inputs are declared; outer tensors belong to the enclosing graph). Symbols are the main graph's.
    """
    holders = [(i, n) for i, n in enumerate(graph.nodes) if n.op in BODY_OPS]
    if not holders or len(proto.node) != len(graph.nodes):
        return
    for i, node in holders:
        if proto.node[i].op_type != node.op:
            continue
        for attr in proto.node[i].attribute:
            body = node.attrs.get(attr.name)
            if attr.type != onnx.AttributeProto.GRAPH or not isinstance(body, gs.Graph):
                continue
            local = {t.name: t for n in body.nodes for t in n.outputs if t.name}
            _apply_types(inferred_types(attr.g), local, {id(t) for t in body.inputs}, declared, converted)
            _apply_bodies(body, attr.g, declared, converted)


def _apply_types(inferred: Inferred, tensors: dict[str, gs.Tensor], inputs: set[int], declared: frozenset[str],
                 converted: _Converted) -> None:
    """Set each of ``tensors`` (but constants and ``inputs``) to its inferred dtype and shape."""
    for name, key in inferred.types.items():  # fewer than the tensors: no constants, no graph inputs
        tensor = tensors.get(name)
        if tensor is None or isinstance(tensor, gs.Constant) or id(tensor) in inputs:
            continue
        info = converted.get(key, _UNSEEN)
        if info is _UNSEEN:
            info = converted[key] = _dtype_and_shape(inferred.protos[key], declared)
        if info is not None:
            fields = tensor.__dict__  # what gs's Tensor.__setattr__ does for these two, without its Python frame
            fields["dtype"] = info[0]
            if info[1] is not None:
                fields["shape"] = list(info[1])


_UNSEEN = object()


def _dtype_and_shape(tp: onnx.TypeProto, declared: frozenset[str]) -> Optional[tuple[np.dtype, Optional[tuple]]]:
    """(numpy dtype, dims or None when unranked) of a tensor type; None when it is no tensor or has no elem type."""
    tt = tp.tensor_type
    if not tp.HasField("tensor_type") or tt.elem_type == TensorProto.UNDEFINED:
        return None
    dtype = dtypes.numpy_dtype(tt.elem_type)
    if not tt.HasField("shape"):
        return dtype, None
    return dtype, tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param if d.dim_param in declared else None)
                        for d in tt.shape.dim)
