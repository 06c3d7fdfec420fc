"""Hand-made models for the CANN bridge tests: RMSNorm variants, and a reference for NPURmsNorm.

onnxruntime cannot run ``NPURmsNorm``; :func:`decompose_npu_rmsnorm` turns
each one back into standard ops following the plugin's documented formula
(``rstd = 1/sqrt(mean(x^2) + 1e-6)`` over gamma's trailing dims, ``y = x *
rstd * gamma``, in float32, cast to x's dtype), so a lowered model can be
compared with the original numerically.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.helpers import make_model

_ONNX = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16}


def rmsnorm_nodes(x: str, w: Optional[str], out: str, eps: float, prefix: str, axes: Sequence[int] = (-1,),
                  compute: Optional[int] = None, out_type: Optional[int] = None) -> tuple[list, dict]:
    """Llama-style ``x * 1/sqrt(mean(x^2) + eps) * w`` (Cast to ``compute`` and back to ``out_type`` when given)."""
    p = prefix
    nodes, inits = [], {f"{p}_eps": np.array(eps, np.float32), f"{p}_two": np.array(2.0, np.float32)}
    src = x
    if compute is not None:
        nodes.append(helper.make_node("Cast", [x], [f"{p}_xf"], name=f"{p}_cast_in", to=compute))
        src = f"{p}_xf"
    nodes += [
        helper.make_node("Pow", [src, f"{p}_two"], [f"{p}_sq"], name=f"{p}_pow"),
        helper.make_node("ReduceMean", [f"{p}_sq"], [f"{p}_mean"], name=f"{p}_mean", axes=list(axes), keepdims=1),
        helper.make_node("Add", [f"{p}_mean", f"{p}_eps"], [f"{p}_add"], name=f"{p}_add"),
        helper.make_node("Sqrt", [f"{p}_add"], [f"{p}_sqrt"], name=f"{p}_sqrt"),
        helper.make_node("Reciprocal", [f"{p}_sqrt"], [f"{p}_rstd"], name=f"{p}_recip"),
        helper.make_node("Mul", [src, f"{p}_rstd"], [f"{p}_normed"], name=f"{p}_mul"),
    ]
    last = f"{p}_normed"
    if out_type is not None:
        nodes.append(helper.make_node("Cast", [last], [f"{p}_back"], name=f"{p}_cast_out", to=out_type))
        last = f"{p}_back"
    if w is None:
        nodes.append(helper.make_node("Identity", [last], [out], name=f"{p}_out"))
    else:
        nodes.append(helper.make_node("Mul", [last, w], [out], name=f"{p}_scale"))
    return nodes, inits


def rms_model(eps: float = 1e-6, dtype=np.float32, hidden: int = 16, weight_shape: Optional[tuple] = None,
              axes: Sequence[int] = (-1,), layers: Sequence[float] = (), shape=(2, 3, 16), seed: int = 0) -> onnx.ModelProto:
    """x -> RMSNorm(eps) -> MatMul, then one more RMSNorm per entry of ``layers`` (their eps)."""
    rng = np.random.default_rng(seed)
    t = _ONNX[dtype]
    fp16 = dtype == np.float16
    nodes, inits, cur = [], {}, "x"
    for i, e in enumerate([eps, *layers]):
        w = f"w{i}"
        inits[w] = (1 + 0.1 * rng.standard_normal(weight_shape or (hidden,))).astype(dtype)
        n, c = rmsnorm_nodes(cur, w, f"n{i}", e, f"rms{i}", axes, TensorProto.FLOAT if fp16 else None,
                             t if fp16 else None)
        nodes += n
        inits.update(c)
        inits[f"proj{i}"] = (rng.standard_normal((hidden, hidden)) / 4).astype(dtype)
        nodes.append(helper.make_node("MatMul", [f"n{i}", f"proj{i}"], [f"h{i}"], name=f"proj{i}"))
        cur = f"h{i}"
    nodes.append(helper.make_node("Identity", [cur], ["y"], name="out"))
    return make_model(nodes, [("x", t, list(shape))], [("y", t, list(shape))], inits)


def decompose_npu_rmsnorm(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy where each NPURmsNorm is the plugin's formula in standard ops (for onnxruntime)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    inits = {i.name: i for i in out.graph.initializer}
    types = {vi.name: vi.type.tensor_type.elem_type for vi in [*out.graph.input, *out.graph.value_info, *out.graph.output]}
    types.update({i.name: i.data_type for i in out.graph.initializer})
    nodes = []
    for n in out.graph.node:
        if n.op_type != "NPURmsNorm":
            nodes.append(n)
            continue
        x, gamma = n.input
        y, rstd = n.output
        k = len(numpy_helper.to_array(inits[gamma]).shape)
        p = n.name
        eps = f"{p}_ref_eps"
        out.graph.initializer.append(numpy_helper.from_array(np.array(1e-6, np.float32), eps))
        x_type = types.get(x, TensorProto.FLOAT)
        nodes += [
            helper.make_node("Cast", [x], [f"{p}_xf"], to=TensorProto.FLOAT),
            helper.make_node("Cast", [gamma], [f"{p}_gf"], to=TensorProto.FLOAT),
            helper.make_node("Mul", [f"{p}_xf", f"{p}_xf"], [f"{p}_sq"]),
            helper.make_node("ReduceMean", [f"{p}_sq"], [f"{p}_ms"], axes=list(range(-k, 0)), keepdims=1),
            helper.make_node("Add", [f"{p}_ms", eps], [f"{p}_v"]),
            helper.make_node("Sqrt", [f"{p}_v"], [f"{p}_s"]),
            helper.make_node("Reciprocal", [f"{p}_s"], [rstd]),
            helper.make_node("Mul", [f"{p}_xf", rstd], [f"{p}_n"]),
            helper.make_node("Mul", [f"{p}_n", f"{p}_gf"], [f"{p}_yf"]),
            helper.make_node("Cast", [f"{p}_yf"], [y], to=x_type),
        ]
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    del out.graph.value_info[:]
    return out
