"""Rewrite a model proto so each selected weight is stored quantized and read through DequantizeLinear.

``MatMul(x, W)`` becomes ``MatMul(x, DequantizeLinear(Wq, scale[, zero_point]))``; a plain Gemm becomes
that MatMul plus an Add of its C; an embedding ``Gather(E, ids)`` becomes ``Gather(DequantizeLinear(Eq,
...), ids)``. int8 per-channel is DequantizeLinear over axis 1 (opset 13+), int4 per-group is blocked
over axis 0 with ``block_size = g`` (opset 21+): both the layout onnxruntime fuses into its n-bit MatMul
and the ``(ceil(k/g), n)`` scales the NPU kernel takes.

Weights are read a block of rows at a time (memory-mapped when external) and the quantized values go
to this process's spill file, so the proto never holds a weight and the peak memory is a block's.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import uses_external_data

from ..graph import dtypes
from ..modelio.external import external_span, external_tensor, inline_copy
from ..modelio.spill import SpillFile
from . import gptq, rtn
from .select import Site


class _SpillWriter:
    """Appends one tensor's bytes, block by block, to the process's spill file."""

    def __init__(self, nbytes: int) -> None:
        self.spill = SpillFile.get()
        self.offset = self.spill.allocate(nbytes)
        self.nbytes = nbytes
        self.pos = 0

    def write(self, data: bytes) -> None:
        with open(self.spill.path, "r+b") as f:
            f.seek(self.offset + self.pos)
            f.write(data)
        self.pos += len(data)

    def tensor(self, name: str, data_type: int, dims: list[int]) -> TensorProto:
        return external_tensor(name, data_type, dims, self.spill.path, self.offset, self.nbytes)


def weight_reader(t: TensorProto, transposed: bool) -> tuple[Callable[[int, int], np.ndarray], int, int]:
    """``(read(a, b), k, n)``: rows ``[a, b)`` of the ``(k, n)`` weight as float32, without loading it whole
    when it is external (a memory map); ``transposed``: ``t`` holds ``(n, k)``."""
    dtype = dtypes.numpy_dtype(t.data_type)
    if uses_external_data(t):
        location, offset, _ = external_span(t)
        arr = np.memmap(location, dtype=dtype, mode="r", offset=offset, shape=tuple(t.dims))
    else:
        arr = numpy_helper.to_array(t)
    view = arr.T if transposed else arr
    k, n = view.shape
    return (lambda a, b: np.asarray(view[a:b], dtype=np.float32)), k, n


def quantize_site(model: onnx.ModelProto, site: Site, scheme: rtn.Scheme,
                  hessian: Optional[np.ndarray] = None) -> rtn.Quantized:
    """Replace ``site``'s weight in ``model`` by its quantized form and DequantizeLinear; returns what
    :func:`rtn.quantize` (or with a ``hessian`` of the weight's inputs, :func:`gptq.quantize`) gave."""
    g = model.graph
    t = next(x for x in g.initializer if x.name == site.name)
    float_type = t.data_type
    if site.kind == "embedding":  # Gather(E, ids) with E (vocab, hidden): groups run along hidden
        read, k, n = weight_reader(t, transposed=True)
        axis = 1
    else:
        read, k, n = weight_reader(t, site.transposed)
        axis = 0
    int4 = scheme.bits == 4
    elem = TensorProto.INT4 if int4 else TensorProto.INT8
    nbytes = (k * n + 1) // 2 if int4 else k * n
    writer = _SpillWriter(nbytes)
    if axis == 1:  # the stored layout is the transpose of the quantized one: gather it whole (one table)
        blocks: list[np.ndarray] = []
        q = rtn.quantize(read, k, n, scheme, lambda a, b, v: blocks.append(v))
        values = np.concatenate(blocks).T
        writer.write(rtn.pack_int4(values) if int4 else values.tobytes())
        scale, zp = q.scale.T if scheme.group else q.scale, None if q.zero_point is None else (
            q.zero_point.T if scheme.group else q.zero_point)
        dims = [n, k]
        dq_axis = 1 if scheme.group else 0
    else:
        def write(a: int, b: int, v: np.ndarray) -> None:
            writer.write(rtn.pack_int4(v) if int4 else v.tobytes())

        q = rtn.quantize(read, k, n, scheme, write) if hessian is None else \
            gptq.quantize(read, k, n, scheme, write, hessian)
        scale, zp, dims, dq_axis = q.scale, q.zero_point, [k, n], (0 if scheme.group else 1)
    names = _fresh_names(g, site.name)
    g.initializer.remove(t)
    g.initializer.append(writer.tensor(names["q"], elem, dims))
    np_float = dtypes.numpy_dtype(float_type)
    g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(scale).astype(np_float), names["scale"]))
    dq_inputs = [names["q"], names["scale"]]
    if zp is not None:
        zt = TensorProto(name=names["zp"], data_type=elem, dims=list(zp.shape))
        zt.raw_data = rtn.pack_int4(np.ascontiguousarray(zp)) if int4 else np.ascontiguousarray(zp).tobytes()
        g.initializer.append(zt)
        dq_inputs.append(names["zp"])
    attrs = {"axis": dq_axis}
    if scheme.group:
        attrs["block_size"] = scheme.group
    dq = helper.make_node("DequantizeLinear", dq_inputs, [names["dq"]], name=names["node"], **attrs)
    g.node.insert(0, dq)
    for node in site.users:
        _rewire(g, node, site.reads, names["dq"])
    for flip in site.transposes:
        g.node.remove(flip)
    return q


def _rewire(g: onnx.GraphProto, node: onnx.NodeProto, reads: set[str], dq: str) -> None:
    """Point ``node`` at the dequantized weight; a Gemm becomes MatMul (+ Add of C)."""
    for i, name in enumerate(node.input):
        if name in reads:
            node.input[i] = dq
    if node.op_type != "Gemm":
        return
    bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
    out = node.output[0]
    node.op_type = "MatMul"
    del node.attribute[:]
    del node.input[2:]
    if bias is not None:
        mid = out + "_k3opt_mm"
        node.output[0] = mid
        at = list(g.node).index(node)
        g.node.insert(at + 1, helper.make_node("Add", [mid, bias], [out], name=(node.name or out) + "_bias"))


def _fresh_names(g: onnx.GraphProto, base: str) -> dict[str, str]:
    used = {t.name for t in g.initializer} | {o for n in g.node for o in n.output} | {n.name for n in g.node}
    used |= {i.name for i in g.input}
    names = {}
    for key, suffix in (("q", "_quantized"), ("scale", "_scale"), ("zp", "_zero_point"), ("dq", "_dequantized"),
                        ("node", "_DequantizeLinear")):
        name, i = base + suffix, 1
        while name in used:
            name, i = f"{base}{suffix}_{i}", i + 1
        used.add(name)
        names[key] = name
    return names


def weight_of(model: onnx.ModelProto, name: str) -> Optional[np.ndarray]:
    """An initializer's values (external data read), or None."""
    for t in model.graph.initializer:
        if t.name == name:
            return numpy_helper.to_array(inline_copy(t))
    return None


def stored_bytes(path: Path) -> int:
    """A model file's bytes plus its data file's, if any."""
    data = Path(str(path) + ".data")
    return path.stat().st_size + (data.stat().st_size if data.exists() else 0)
