"""fuse-matmul-add: ``MatMul(x, W) + b`` with a constant 2-D W and a per-column bias becomes a Gemm.

2-D ``x`` gives ``Gemm(x, W, b)``. For rank > 2 activations the Gemm needs a
2-D operand, so the fusion is ``Reshape(x, [-1, K])``, ``Gemm``,
``Reshape`` back to ``x``'s leading dims with ``N`` last. That costs nodes
(3, plus ``Shape``/``Concat`` when two or more leading dims are dynamic,
against the original 2), which only pays on Ascend: ATC's
MatMulBiasAddFusionPass fuses only 2-D MatMul outputs with a bias over the
last dim. The choice is the pass option ``matmul_add_nd``:

* ``"auto"`` (default): the flatten form for ``--target cann``, 2-D only otherwise;
* ``"flatten"``: the flatten form for every rank;
* ``"keep"``: rank > 2 pairs stay as they are.

A rank-2 pair whose W or bias is computed (not a constant) becomes a Gemm too, except for ``--target
cann`` (ATC's fusion wants constants), when W is 2-D and the bias broadcasts one way to the ``(M, N)``
result (Gemm's ``C``: any such shape of rank <= 2, not only a bias over the last axis).

Refused (left as is): W not a constant 2-D tensor (at rank > 2 or for cann), a bias that is not
constant or broadcasts in any way other than over the last axis ((S,N),
(M,1), batch-broadcasting or rank-widening biases), dtypes that differ or are
not floating point, and an intermediate MatMul output used elsewhere or
being a graph output (the pattern API blocks those).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import onnx

from ...graph import ir
from ...errors import UsageError
from ...graph.dtypes import onnx_type
from ...patterns import Match, Rule, rules_pass
from ...pipeline.option_values import choice
from ...pipeline.pass_base import Hints

#: Gemm's floating types (integer Gemm is rare and not what ATC fuses).
GEMM_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE,
                        onnx.TensorProto.BFLOAT16})
ND_MODES = ("auto", "flatten", "keep")


def nd_mode(ctx) -> str:
    """How rank > 2 pairs are fused: ``flatten`` or ``keep`` (``auto`` resolved by target)."""
    mode = ctx.options.get("matmul_add_nd", "auto")
    if mode not in ND_MODES:
        raise UsageError(f"matmul_add_nd must be one of {', '.join(ND_MODES)}, got {mode!r}")
    if mode == "auto":
        return ctx.target.matmul_add_nd
    return mode


def pattern(op, x, w, b):
    return op.Add(op.MatMul(x, w, _name="mm"), b)


def _bias_shape_ok(shape: tuple, n: int, out_rank: int) -> bool:
    """Broadcasts over the last axis only: ``(1,..,1,N)`` or ``(1,..,1,1)``, no wider than the output."""
    return len(shape) <= out_rank and all(d == 1 for d in shape[:-1]) and (not shape or shape[-1] in (1, n))


def check(m: Match) -> bool:
    w_shape, b_shape, x_rank = m.shape("w"), m.shape("b"), m.rank("x")
    if not (m.is_const("w") and m.is_const("b")) and m.ctx.target.fuses_computed_matmul_add and x_rank == 2:
        return _check_computed(m)
    if not m.is_const("w") or w_shape is None or len(w_shape) != 2:
        return m.fail("weight is not a constant 2-D tensor")
    if not m.is_const("b") or b_shape is None:
        return m.fail("bias is not a constant of known shape")
    dtypes = [m[k].dtype for k in ("x", "w", "b")]
    types = {onnx_type(d) for d in dtypes}
    if len(types) != 1 or not types <= GEMM_TYPES:
        return m.fail("dtypes differ, are unknown or are not floating point")
    if x_rank is None or x_rank < 2:
        return m.fail("activation rank is unknown or below 2")
    if not _bias_shape_ok(b_shape, w_shape[1], x_rank):
        return m.fail(f"bias of shape {b_shape} does not broadcast over the last axis only")
    if x_rank > 2:
        if nd_mode(m.ctx) == "keep":
            return m.fail("rank > 2 activation and matmul_add_nd resolves to 'keep'")
        if 0 in m["x"].shape[:-1]:
            return m.fail("a static leading dim is 0 (a -1 in the restore shape would be ambiguous)")
        if _restore_dims(m["x"]) is None and m.ctx.opset < 14:
            return m.fail("two or more dynamic leading dims need Reshape allowzero (opset 14)")
    return True


def _check_computed(m: Match) -> bool:
    """A rank-2 pair with a computed weight or bias (not for cann: ATC fuses constant operands only): Gemm
    takes any ``C`` that broadcasts one way to the ``(M, N)`` result, which the Add's output must then be."""
    w_shape, b_shape, x_shape = m["w"].shape, m["b"].shape, m["x"].shape
    if w_shape is None or len(w_shape) != 2 or b_shape is None or len(b_shape) > 2:
        return m.fail("computed operands: weight not of rank 2, or bias of unknown shape or rank above 2")
    types = {onnx_type(m[k].dtype) for k in ("x", "w", "b")}
    if len(types) != 1 or not types <= GEMM_TYPES:
        return m.fail("dtypes differ, are unknown or are not floating point")
    out = (x_shape[0], w_shape[1])
    for d, o in zip(reversed(list(b_shape)), reversed(out)):
        if d != 1 and not (d == o and isinstance(d, (int, str)) and not (isinstance(d, int) and d < 0)):
            return m.fail(f"bias of shape {tuple(b_shape)} may not broadcast one way to the result {out}")
    return True


def _restore_dims(x: ir.Tensor) -> Optional[list[int]]:
    """``x``'s leading dims as a Reshape target (one dynamic dim becomes -1), or None if 2+ are dynamic."""
    lead = list(x.shape[:-1])
    dynamic = [i for i, d in enumerate(lead) if not isinstance(d, (int, np.integer)) or d < 0]
    if len(dynamic) > 1:
        return None
    return [-1 if i in dynamic else int(d) for i, d in enumerate(lead)]


def _leading_shape(op, m: Match) -> ir.Tensor:
    """``shape(x)[:-1]`` computed at run time (identical ones are merged by CSE in the next round)."""
    x = m["x"]
    if m.ctx.opset >= 15:
        return op.Shape(x, start=0, end=-1)
    return op.Slice(op.Shape(x), op.const([0], np.int64), op.const([-1], np.int64), op.const([0], np.int64))


def rewrite(op, m: Match):
    x, w = m["x"], m["w"]
    k, n = m.shape("w")
    b = m["b"]
    if m.is_const("b") and len(m.shape("b")) > 2:  # (1,..,1,N) -> (N,): Gemm's C broadcasts to (M, N) from rank <= 2
        value = np.asarray(m.const("b"))
        b = op.const(value.reshape(-1), value.dtype, name=f"{b.name}_flat")  # own dtype (op.const makes float64 float32)
    if m.rank("x") == 2:
        return op.Gemm(x, w, b)
    y = op.Gemm(op.Reshape(x, op.const([-1, k], np.int64)), w, b)
    dims = _restore_dims(x)
    if dims is not None:
        return op.Reshape(y, op.const(dims + [n], np.int64))
    shape = op.Concat(_leading_shape(op, m), op.const([n], np.int64), axis=0)
    return op.Reshape(y, shape, allowzero=1)  # a dynamic dim of 0 means 0, not "copy"


RULE = Rule("matmul-add", pattern, rewrite, check=check,
            description="MatMul(x, W) + b (constant 2-D W, bias over the last axis) -> Gemm")

FuseMatMulAdd = rules_pass(
    "fuse-matmul-add", [RULE], order=700, needs_shapes=True, _hints=Hints(adds_bodies=False), min_opset=11,
    anchor_ops=frozenset({"MatMul"}),
    options={"matmul_add_nd": "rank > 2 pairs: auto (flatten for --target cann, keep for onnx), flatten, keep"},
    option_values={"matmul_add_nd": choice(*ND_MODES)},
    description="MatMul + per-column bias -> Gemm (rank > 2: flatten-Gemm-restore, option matmul_add_nd)",
    register=False,
)
