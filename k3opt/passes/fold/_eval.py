"""Evaluating constant nodes for fold-constants: whole subgraphs in onnxruntime, with fallbacks.

A connected group of constant nodes is exported as one small model (its
constant inputs as initializers, the tensors the rest of the graph needs as
outputs) and run in a single onnxruntime session: far cheaper than a session
per node. Nodes numpy computes bit for bit as onnxruntime does
(:mod:`.fold_numpy`) skip the session. When the session fails, the caller
falls back node by node, first in onnxruntime, then in ``onnx.reference``
(ops onnxruntime lacks).

Dtypes stay exact: results whose element type numpy cannot hold (bfloat16,
float8, int4...) are widened with a ``Cast`` inside the model (always exact)
and narrowed back with ml_dtypes, and every folded value becomes a
``TensorProto`` built by ``onnx.numpy_helper.from_array`` and wrapped as a
lazily-read gs constant, so gs never re-encodes it.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

import numpy as np
import onnx
from ... import graph as gs
from onnx import TensorProto, helper, numpy_helper
from ...graph import OnnxExporter, dtypes

from ...graph.ir import Graph, Node, Tensor, outer_refs, peek, producer
from ..fold._numpy import KERNELS, numpy_values

# ORT type string -> (type to widen to inside the model, ONNX type to narrow back to).
_WIDEN = {
    "tensor(bfloat16)": (TensorProto.FLOAT, TensorProto.BFLOAT16),
    "tensor(float8e4m3fn)": (TensorProto.FLOAT, TensorProto.FLOAT8E4M3FN),
    "tensor(float8e4m3fnuz)": (TensorProto.FLOAT, TensorProto.FLOAT8E4M3FNUZ),
    "tensor(float8e5m2)": (TensorProto.FLOAT, TensorProto.FLOAT8E5M2),
    "tensor(float8e5m2fnuz)": (TensorProto.FLOAT, TensorProto.FLOAT8E5M2FNUZ),
    "tensor(float4e2m1)": (TensorProto.FLOAT, TensorProto.FLOAT4E2M1),
    "tensor(int4)": (TensorProto.INT8, TensorProto.INT4),
    "tensor(uint4)": (TensorProto.UINT8, TensorProto.UINT4),
}


class EvalError(Exception):
    """A group or node could not be evaluated (the caller leaves it unfolded)."""


def const_proto(t: Tensor) -> TensorProto:
    """The initializer for gs constant ``t``, with external data read in (the sub-model has no base path)."""
    proto = OnnxExporter.export_tensor_proto(t)
    if proto.data_location == TensorProto.EXTERNAL:
        proto = numpy_helper.from_array(np.asarray(peek(t)), t.name)
    return proto


def sub_model(
    graph: Graph,
    nodes: Sequence[Node],
    outputs: Sequence[str],
    known: dict[str, np.ndarray],
) -> onnx.ModelProto:
    """A model computing ``outputs`` from ``nodes``; inputs come from ``known`` values or graph constants."""
    produced = {t.name for n in nodes for t in n.outputs}
    inits: dict[str, TensorProto] = {}
    extra_nodes: list[onnx.NodeProto] = []
    for t in _external_inputs(nodes):
        if t.name in produced or t.name in inits or not t.name:
            continue
        if t.name in known:
            inits[t.name] = numpy_helper.from_array(np.asarray(known[t.name]), t.name)
        elif isinstance(t, gs.Constant):
            inits[t.name] = const_proto(t)
        elif (p := producer(t)) is not None and p.op == "Constant":
            extra_nodes.append(_export_node(p))
            produced.add(t.name)
        else:
            raise EvalError(f"input {t.name} is not constant")
    g = helper.make_graph(
        extra_nodes + [_export_node(n) for n in nodes],
        "k3opt_fold",
        [],
        [helper.make_value_info(o, onnx.TypeProto()) for o in outputs],
        list(inits.values()),
    )
    model = helper.make_model(g, opset_imports=_opset_imports(graph))
    model.ir_version = graph.ir_version or 10
    return model


def _export_node(node: Node) -> onnx.NodeProto:
    """gs's node export; what gs cannot write (e.g. a body with optional-typed values) is not foldable."""
    try:
        return OnnxExporter.export_node(node)
    except Exception as exc:  # gs raises assorted types (UnboundLocalError for optional types)
        raise EvalError(f"{node.op} cannot be exported for evaluation: {type(exc).__name__}") from exc


def _opset_imports(graph: Graph) -> list[onnx.OperatorSetIdProto]:
    imports = {d.domain: d.version for d in (graph.import_domains or [])}
    imports.setdefault("", graph.opset)
    imports.pop("ai.onnx", None)
    return [helper.make_opsetid(d, v) for d, v in imports.items()]


def _external_inputs(nodes: Iterable[Node]) -> Iterable[Tensor]:
    """Inputs of ``nodes``, including tensors their subgraphs read from the outer scope."""
    for n in nodes:
        yield from n.inputs
        yield from outer_refs(n)


def _session(data: bytes) -> "onnxruntime.InferenceSession":
    import onnxruntime as ort  # here: a model whose constants numpy computes never needs it (a costly import)

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 4
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"], enable_fallback=0)


def run_model(model: onnx.ModelProto, feeds: Optional[dict[str, np.ndarray]] = None) -> list[object]:
    """Outputs of ``model`` in onnxruntime (no graph optimizations), every dtype exact.

    Outputs numpy cannot hold (bfloat16, float8, int4...) are widened by a
    ``Cast`` appended to a copy of the model (exact) and narrowed back with ml_dtypes.
    """
    data = model.SerializeToString()
    sess = _session(data)
    narrow = {}
    widened: Optional[onnx.ModelProto] = None
    for i, o in enumerate(sess.get_outputs()):
        if o.type in _WIDEN:
            widened = widened or onnx.ModelProto.FromString(data)
            wide, narrow[i] = _WIDEN[o.type]
            cast = helper.make_node("Cast", [o.name], [o.name + "__k3opt_wide"], to=wide)
            widened.graph.node.append(cast)
            widened.graph.output[i].name = cast.output[0]
            if widened.graph.output[i].type.HasField("tensor_type"):
                widened.graph.output[i].type.tensor_type.elem_type = wide
    if widened is not None:
        sess = _session(widened.SerializeToString())
    values = sess.run(None, feeds or {})
    for i, onnx_type in narrow.items():
        values[i] = np.asarray(values[i]).astype(dtypes.numpy_dtype(onnx_type))
    return values


def run_ort(graph: Graph, nodes: Sequence[Node], outputs: Sequence[str], known: dict) -> dict[str, object]:
    """Evaluate ``nodes`` in one onnxruntime session; returns ``{output name: value}``.

    Values are numpy arrays for tensors, anything else (sequences, empty
    optionals) as onnxruntime returns it; the caller folds only arrays.
    Nodes numpy computes exactly (:mod:`.fold_numpy`) are computed there:
    onnxruntime's cost is per node of the session. Those reading known
    values go first; those reading what the session computes, with no reader
    in it, go after it (onnxruntime takes back any numpy refuses).
    """
    moved = numpy_values(graph, nodes, known)
    rest = [n for n in nodes if not all(t.name in moved for t in n.outputs if t.name)]
    readers = {id(t) for n in rest for t in [*n.inputs, *outer_refs(n)]}
    tail = [n for n in rest if n.op in KERNELS and not any(id(t) in readers for t in n.outputs)]
    in_tail = {id(n) for n in tail}
    body = [n for n in rest if id(n) not in in_tail]
    made = {t.name for n in body for t in n.outputs if t.name}
    late = {t.name for n in tail for t in n.outputs if t.name}
    need = list(dict.fromkeys(t.name for n in tail for t in n.inputs if t.name in made))
    wanted = list(dict.fromkeys([o for o in outputs if o not in moved and o not in late] + need))
    values = {**known, **moved, **_in_session(graph, body, wanted, {**known, **moved})}
    after = numpy_values(graph, tail, values)
    left = [n for n in tail if not all(t.name in after for t in n.outputs if t.name)]
    values.update(after)
    if left:
        arrays = {k: a for k, v in values.items() if (a := as_array(v)) is not None}
        values.update(_in_session(graph, left, [t.name for n in left for t in n.outputs if t.name], arrays))
    return {o: values[o] for o in outputs}


def _in_session(graph: Graph, nodes: Sequence[Node], outputs: Sequence[str], known: dict) -> dict[str, object]:
    """``outputs`` of ``nodes`` from one onnxruntime session (none for no nodes and no outputs)."""
    if not nodes and not outputs:
        return {}
    model = sub_model(graph, nodes, outputs, known)
    try:
        values = run_model(model)
    except Exception as exc:  # any ORT failure means "not foldable this way"
        raise EvalError(str(exc)) from exc
    return dict(zip(outputs, values))


def run_reference(graph: Graph, node: Node, known: dict) -> dict[str, object]:
    """Evaluate one node with ``onnx.reference`` (ops or types onnxruntime lacks)."""
    from onnx.reference import ReferenceEvaluator

    outputs = [t.name for t in node.outputs if t.name]
    model = sub_model(graph, [node], outputs, known)
    try:
        with np.errstate(all="ignore"):  # an overflow is a value (inf) here, as in onnxruntime: not a warning
            values = ReferenceEvaluator(model).run(None, {})
    except Exception as exc:
        raise EvalError(str(exc)) from exc
    return dict(zip(outputs, values))


def as_array(value: object) -> Optional[np.ndarray]:
    """``value`` as a foldable numpy array, or None (sequences, optionals, odd objects)."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, np.generic):
        return np.asarray(value)
    return None
