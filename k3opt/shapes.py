"""Shapes: fixing input dimensions (--input-shape) and refreshing inferred shapes on the graph.

Shape inference helps passes (broadcast checks, folding shape arithmetic)
but must never make a run fail: :class:`ShapeRefresher` returns False and
records why when onnx cannot infer a model, and the passes that need shapes
then decline (see docs/design.md).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import TensorProto
from onnx_graphsurgeon.exporters.onnx_exporter import dtype_to_onnx
from onnx_graphsurgeon.ir.tensor import LazyValues

from .errors import UsageError
from .io import EXTERNAL_THRESHOLD, weights_as_inputs

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
    if any(d <= 0 for d in values):
        raise UsageError(f"--input-shape '{spec}': dimensions must be positive")
    return name, values


def normalize_input_shapes(shapes: Optional[InputShapes]) -> dict[str, list[int]]:
    """Accept a mapping name -> dims or a list of ``NAME:D1,D2`` strings."""
    if not shapes:
        return {}
    if isinstance(shapes, Mapping):
        return {str(k): [int(d) for d in v] for k, v in shapes.items()}
    if isinstance(shapes, str):
        shapes = [shapes]
    return dict(parse_input_shape(s) for s in shapes)


def fix_inputs(model: onnx.ModelProto, shapes: Optional[InputShapes]) -> None:
    """Set graph-input dimensions in place; unknown names or a wrong rank are a UsageError."""
    fixed = normalize_input_shapes(shapes)
    inits = {t.name for t in model.graph.initializer}
    inputs = {vi.name: vi for vi in model.graph.input if vi.name not in inits}
    for name, dims in fixed.items():
        if name not in inputs:
            raise UsageError(f"--input-shape: '{name}' is not a graph input; inputs: {', '.join(inputs)}")
        shape = inputs[name].type.tensor_type.shape
        if len(shape.dim) != len(dims):
            raise UsageError(f"--input-shape: '{name}' has rank {len(shape.dim)}, got {len(dims)} dimensions")
        for dim, value in zip(shape.dim, dims):
            if dim.HasField("dim_value") and dim.dim_value != value:
                raise UsageError(f"--input-shape: '{name}' has fixed dimension {dim.dim_value}, not {value}")
        for dim, value in zip(shape.dim, dims):
            dim.Clear()
            dim.dim_value = value


def infer_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnx shape inference (with data propagation) on a copy whose big weights are left out.

    Big initializers become typed graph inputs: onnx would otherwise
    materialize them (gigabytes for a large model) just to read their shape.
    """
    light, _ = weights_as_inputs(model)
    plain = onnx.shape_inference.infer_shapes(light, strict_mode=True)
    if _has_long_vector(plain.graph):
        return plain
    return onnx.shape_inference.infer_shapes(light, strict_mode=True, data_prop=True)


#: onnx's data propagation materializes 1-D tensors; past this length it costs gigabytes.
DATA_PROP_MAX_LEN = 2**16


def _has_long_vector(graph: onnx.GraphProto) -> bool:
    for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
        dims = vi.type.tensor_type.shape.dim
        if len(dims) == 1 and (not dims[0].HasField("dim_value") or dims[0].dim_value > DATA_PROP_MAX_LEN):
            return True
    return False


class ShapeRefresher:
    """``(graph) -> bool`` for the PassManager: refresh tensor shapes/dtypes in place.

    Failures are recorded in ``notes`` (once each) instead of raised.
    """

    def __init__(self) -> None:
        self.notes: list[str] = []
        self.calls = 0

    def __call__(self, graph: gs.Graph) -> bool:
        self.calls += 1
        try:
            with _weights_hidden(graph):
                model = gs.export_onnx(graph, do_type_check=False)
            del model.graph.value_info[:]  # stale after rewrites; re-infer from scratch
            inferred = infer_model(model)
        except Exception as exc:  # onnx raises many types here; a failure only loses shapes
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            note = f"shape inference failed ({type(exc).__name__}: {first}); passes that need shapes declined"
            if note not in self.notes:
                self.notes.append(note)
            return False
        apply_shapes(graph, inferred.graph)
        return True


class _TypeOnly(LazyValues):
    """Stands in for a big constant during export: dims and type, no data."""

    def __init__(self, values: Any):
        self.shape, self.dtype, self.nbytes = values.shape, values.dtype, values.nbytes
        self.tensor = TensorProto(data_type=dtype_to_onnx(values.dtype), dims=[int(d) for d in values.shape])

    def load(self) -> np.ndarray:  # pragma: no cover - never loaded: swapped back right after export
        raise RuntimeError("a type-only stand-in has no values")


@contextlib.contextmanager
def _weights_hidden(graph: gs.Graph) -> Iterator[None]:
    """Export-time stand-ins for big constants, so shape refreshes never read or build weights."""
    swapped = []
    for t in graph.tensors().values():
        values = getattr(t, "_values", None)
        if isinstance(t, gs.Constant) and getattr(values, "nbytes", 0) >= EXTERNAL_THRESHOLD \
                and np.dtype(_np_dtype(values.dtype)).kind in "fiucb":
            swapped.append((t, values))
            t._values = _TypeOnly(values)
    try:
        yield
    finally:
        for t, values in swapped:
            t._values = values


def _np_dtype(dtype: Any) -> Any:
    return onnx.helper.tensor_dtype_to_np_dtype(dtype) if isinstance(dtype, int) else dtype


def apply_shapes(graph: gs.Graph, inferred: onnx.GraphProto) -> None:
    """Copy inferred dtypes and shapes onto the graph's variables (graph inputs untouched)."""
    infos = {vi.name: vi for vi in list(inferred.value_info) + list(inferred.output)}
    inputs = {id(t) for t in graph.inputs}
    for name, tensor in graph.tensors().items():
        vi = infos.get(name)
        if vi is None or isinstance(tensor, gs.Constant) or id(tensor) in inputs:
            continue
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type") or tt.elem_type == TensorProto.UNDEFINED:
            continue
        tensor.dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
        if tt.HasField("shape"):
            tensor.shape = [
                d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim
            ]
