"""External-data tensors: where their bytes are, reading them, and inline copies."""
from __future__ import annotations

import os
from typing import Iterator, Optional, Union

import numpy as np
import onnx
from onnx import TensorProto
from onnx.external_data_helper import uses_external_data

from ..errors import InputError
from ..graph import LazyValues
from . import data_location
from .spill_regions import materialize

PathLike = Union[str, os.PathLike]

#: Tensors at least this big go to the data file when saving with external data.
EXTERNAL_THRESHOLD = 1024


_A = onnx.AttributeProto
#: Attribute types that may hold tensors or subgraphs (UNDEFINED: a sloppy writer may have left it unset).
MAY_HOLD_TENSORS = frozenset((_A.UNDEFINED, _A.TENSOR, _A.TENSORS, _A.GRAPH, _A.GRAPHS))


def all_tensors(model: onnx.ModelProto) -> Iterator[TensorProto]:
    """Every TensorProto of the model: initializers and tensor attributes, subgraphs included."""
    def graph_tensors(g: onnx.GraphProto) -> Iterator[TensorProto]:
        yield from g.initializer
        for node in g.node:
            for attr in node.attribute:
                if attr.type not in MAY_HOLD_TENSORS:  # one field read for the common int/float/ints attrs
                    continue
                if attr.HasField("t"):
                    yield attr.t
                yield from attr.tensors
                if attr.HasField("g"):
                    yield from graph_tensors(attr.g)
                for sub in attr.graphs:
                    yield from graph_tensors(sub)

    yield from graph_tensors(model.graph)


def external_info(t: TensorProto) -> dict[str, str]:
    """The tensor's external_data entries as a dict (location, offset, length...)."""
    return {e.key: e.value for e in t.external_data}


def set_external(t: TensorProto, location: str, offset: int, length: int) -> None:
    del t.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    t.data_location = TensorProto.EXTERNAL


def external_tensor(name: str, data_type: int, dims, location: str, offset: int, length: int) -> TensorProto:
    """A TensorProto whose data is ``length`` bytes at ``offset`` of file ``location``."""
    t = TensorProto(name=name, data_type=data_type, dims=[int(d) for d in dims])
    set_external(t, location, offset, length)
    return t


def tensor_nbytes(t: TensorProto) -> int:
    """Bytes of the tensor's data as stored in raw/external form."""
    if t.external_data:  # most tensors keep their data inline: no entries to read
        info = external_info(t)
        if "length" in info:
            return int(info["length"])
    if t.HasField("raw_data"):
        return len(t.raw_data)
    if t.data_type == TensorProto.STRING:
        return sum(len(s) for s in t.string_data)
    return data_location.claimed_bytes(t) or 0


def is_weight(t: TensorProto) -> bool:
    """A weight-sized tensor (not strings, at least :data:`EXTERNAL_THRESHOLD` bytes): shape inference and
    the version converter get it as a typed graph input, not its value (:func:`weights_as_inputs`); a
    smaller one they read as it is."""
    return t.data_type != TensorProto.STRING and tensor_nbytes(t) >= EXTERNAL_THRESHOLD


def external_span(t: TensorProto) -> tuple[str, int, int]:
    info = external_info(t)
    return info["location"], int(info.get("offset", 0)), tensor_nbytes(t)


def read_external_bytes(t: TensorProto, start: int = 0, length: Optional[int] = None) -> bytes:
    """The raw bytes of a tensor whose (absolute) location k3opt resolved (``length`` bytes from ``start``)."""
    location, offset, size = external_span(t)
    length = size - start if length is None else length
    materialize(location, offset)
    with open(location, "rb") as f:
        f.seek(offset + start)
        data = f.read(length)
    if len(data) != length:
        raise InputError(f"external data file {location} is too short for tensor '{t.name}'")
    return data


def inline_copy(t: TensorProto) -> TensorProto:
    """A copy of ``t`` with its external data read into ``raw_data``."""
    out = TensorProto()
    out.CopyFrom(t)
    if uses_external_data(t):
        out.raw_data = read_external_bytes(t)
        del out.external_data[:]
        out.ClearField("data_location")
    return out


def weights_as_inputs(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, TensorProto]]:
    """A copy of ``model`` whose big or external initializers are typed graph inputs instead.

    onnx's shape inference and version converter only need their types;
    given the data they would read or materialize it. Small initializers
    stay, with any external data read in. Returns the copy and the original
    initializers taken out, by name.
    """
    big = {t.name: t for t in model.graph.initializer if is_weight(t)}
    light = onnx.ModelProto()
    light.CopyFrom(model)
    g = light.graph
    declared = {vi.name for vi in g.input}
    # small ones (shape constants, axes...) stay, inlined: onnx cannot read external data
    small = [inline_copy(t) for t in g.initializer if t.name not in big]
    del g.initializer[:]
    g.initializer.extend(small)
    g.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                   for t in big.values() if t.name not in declared)
    return light, big


class ExternalValues(LazyValues):
    """gs lazy values for a tensor in an external file with an absolute location.

    onnx itself refuses absolute locations; this reads just this tensor's
    bytes when a pass asks for ``.values``.
    """

    def load(self) -> np.ndarray:
        return np.array(onnx.numpy_helper.to_array(inline_copy(self.tensor)))
