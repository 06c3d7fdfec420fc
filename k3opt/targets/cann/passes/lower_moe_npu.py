"""lower-moe-npu: the routing of a recognised MoE block becomes Ascend's MoE ops for ``--target cann``.

The recogniser (:mod:`k3opt.passes._shared.moe_match`) has proved a ``batched_mm`` experts block exact for a row
permutation. The ops, as ATC's ONNX plugins register them (``ai.onnx::11..18`` and ``npu::1``; sources by short
name in :mod:`k3opt.targets.cann.npu_contract`, facts and formulas in docs/cann.md, "MoE"):

- a softmax gate ``TopK(Softmax(logits), k)`` -> ``NPUMoeGatingTopKSoftmax(logits, k=k)`` ([MGS-plugin]: the
  INT attribute ``k`` is required): its ``y`` replaces the TopK values (a renormalising Div stays the graph's),
  its int32 ``expert_idx`` (cast to int64) the indices, and its ``row_idx`` feeds the permutation;
- the token permutation -> ``NPUMoeInitRouting(x, row_idx, expert_idx, active_num)`` ([MIR-plugin]:
  ``active_num`` required): ``expanded_x`` (rows sorted by expert) replaces the graph's token rows in the
  experts, ``expanded_expert_idx`` (cast to int64) their expert indices; ``active_num`` is the static token
  count, or 2147483647 when it is dynamic (the documented row count is ``min(NUM_ROWS, active_num) * k``);
- the weighted sum over the k slots -> ``NPUMoeFinalizeRouting(expert_rows, x1, "", bias=0, scales=weights,
  expanded_row_idx, expert_idx)``, ``x1`` the (T, H) value the graph adds to the sum right after (Qwen2-MoE's
  gated shared expert) or zeros ([MFR-IR]: ``x1`` is required).

Not lowered (the report says so per block): a gate that is not a softmax -- DeepSeek-V3/Kimi's group-limited
sigmoid gate has no ONNX parser (MoeGatingTopK); its indices are cast to int32 and the row indices built
in the graph, and the permutation and combine are still lowered. The expert FFNs stay batched MatMuls
(GroupedMatmul has no ONNX parser). Ties in the router's top-k: the reference op, like ONNX TopK, takes the
lower expert index first, as the kernel's documented sort does (Ascend C Sort32: "score[j] ... 排在前面" for
i > j); MrgSort's and WholeReduceMax's tie order is not documented (docs/cann.md, "Ties in the router's scores").
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
from onnx import TensorProto

from ..npu_contract import MOE_ALL_ROWS, MOE_MAX_K
from ..target_form import STAGING_DOMAIN
from ....graph import dtypes
from ....graph.ir import (Graph, Node, Tensor, consumers, int_list, is_const, is_graph_output, producer, replace_uses,
                          set_input, toposort)
from ....patterns import RewriteBuilder
from ....patterns.rewriter import GraphEditor
from ....pipeline.pass_base import PassContext
from ....passes._shared.moe_match import MoeBlock, find_moe_blocks, find_unrolled_blocks
from ._npu_lowering import NPULowering

_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)


def _onnx_dtype(t: Tensor) -> Optional[int]:
    return dtypes.onnx_type(t.dtype)


def refusal(b: MoeBlock) -> Optional[str]:
    """Why the block's routing cannot become the MoE ops, or None."""
    if _onnx_dtype(b.x) not in _FLOATS or _onnx_dtype(b.expert_rows) != _onnx_dtype(b.x):
        return "the tokens and expert rows are not one of float32, float16, bfloat16 ([MIR-IR], [MFR-IR])"
    if b.k > MOE_MAX_K:
        return f"k = {b.k} is over the kernel's {MOE_MAX_K}"
    return None


class LowerMoeNPU(NPULowering):
    """MoE routing -> NPUMoeGatingTopKSoftmax / NPUMoeInitRouting / NPUMoeFinalizeRouting (target cann)."""

    name = "lower-moe-npu"
    description = ("MoE blocks (batched experts): softmax top-k gate -> NPUMoeGatingTopKSoftmax, token permutation "
                   "-> NPUMoeInitRouting, weighted combine -> NPUMoeFinalizeRouting where exact (target cann)")
    order = 2030
    npu_op, what, remark = "NPU MoE routing", "MoE block", "(gate, token permutation, weighted combine)"
    #: Models without MoE keep the lowering lines they had.
    note_none = False
    #: Not a pattern rule: :func:`find_moe_blocks` walks the graph once (``run``).
    recogniser = staticmethod(lambda rewrite: [])

    def __init__(self) -> None:
        super().__init__()
        self.scanned = False

    def run(self, graph: Graph, ctx: PassContext) -> int:
        # one scan: a lowered block is not found again
        if self.scanned or not {"ReduceSum", "ScatterElements"} & ctx.ops_in(graph):
            return 0
        self.scanned = True
        scan = find_moe_blocks(graph)
        for where, why in {**scan.declined, **find_unrolled_blocks(graph)}.items():
            self.kept[where] = f"MoE block at '{where}' kept decomposed: {why}"
        for b in scan.blocks:
            why = refusal(b)
            if why is not None:
                self.kept[b.where] = f"MoE block at '{b.where}' kept decomposed: {why}"
            else:
                self.lowered.append(self._lower(graph, ctx, b))
        if self.lowered:
            toposort(graph)
        return len(self.lowered)

    def _lower(self, graph: Graph, ctx: PassContext, b: MoeBlock) -> str:
        op = RewriteBuilder(ctx, b.where)
        i32 = TensorProto.INT32
        if b.gate == "softmax":
            logits = b.softmax.inputs[0]
            y, expert_idx, row_idx = op.NPUMoeGatingTopKSoftmax(logits, None, k=b.k, _outputs=3,
                                                               _domain=STAGING_DOMAIN, _name="NPUMoeGatingTopKSoftmax")
            self._typed(y, b.topk.outputs[0].dtype, b.topk.outputs[0].shape)
            self._typed(expert_idx, np.int32, b.topk.outputs[1].shape)
            self._typed(row_idx, np.int32, b.topk.outputs[1].shape)
            idx64 = self._typed(op.Cast(expert_idx, to=TensorProto.INT64), np.int64, b.topk.outputs[1].shape)
            gate = f"softmax top-{b.k}{' renormalised' if b.renormalised else ''} -> NPUMoeGatingTopKSoftmax"
        else:
            expert_idx = self._typed(op.Cast(b.topk.outputs[1], to=i32), np.int32, b.topk.outputs[1].shape)
            row_idx = self._row_idx(op, b)
            why = ("MoeGatingTopK (group-limited sigmoid gate) has no ONNX parser" if b.gate == "sigmoid-group"
                   else f"not a softmax gate ({b.gate_note})")
            gate = f"gate kept decomposed: {why}"
            y = idx64 = None
        tokens = b.x.shape[0] if b.x.shape is not None else None
        active = int(tokens) if isinstance(tokens, (int, np.integer)) and tokens > 0 else MOE_ALL_ROWS
        ex, erow, eexp = op.NPUMoeInitRouting(b.x, row_idx, expert_idx, active_num=active, _outputs=3,
                                             _domain=STAGING_DOMAIN, _name="NPUMoeInitRouting")
        self._typed(ex, b.rows.dtype, b.rows.shape)
        flat = b.flat_idx.shape
        self._typed(erow, np.int32, flat)
        self._typed(eexp, np.int32, flat)
        eexp64 = self._typed(op.Cast(eexp, to=TensorProto.INT64), np.int64, flat)
        last, skips, unflatten = self._chain(graph, b)
        flats = [s if s.shape is not None and len(s.shape) == 2 else
                 self._typed(op.Reshape(s, op.const(np.array([-1, b.hidden], np.int64))), s.dtype, b.x.shape)
                 for s in skips]
        if not flats:  # Finalize's x1 is required: zeros
            flats = [self._typed(op.Expand(op.const(np.zeros((), np.dtype(b.x.dtype))), op.Shape(b.x)), b.x.dtype,
                                 b.x.shape)]
        scales = b.weights
        if b.weights.dtype != b.expert_rows.dtype:
            scales = self._typed(op.Cast(b.weights, to=_onnx_dtype(b.expert_rows)), b.expert_rows.dtype,
                                 b.weights.shape)
        bias = op.const(np.zeros((b.experts, b.hidden), dtype=np.dtype(b.expert_rows.dtype)))
        out = op.NPUMoeFinalizeRouting(b.expert_rows, flats[0], flats[1] if len(flats) > 1 else None, bias, scales,
                                       erow, expert_idx, _domain=STAGING_DOMAIN, _name="NPUMoeFinalizeRouting")
        self._typed(out, b.x.dtype, b.x.shape)
        if unflatten is not None:  # back to the (B, S, H) the graph had after its Reshape
            out = op.Reshape(out, unflatten.inputs[1], allowzero=int(unflatten.attrs.get("allowzero", 0)))
        anchor = producer(last)
        replaced = last
        self._typed(out, replaced.dtype, replaced.shape)
        name = None if is_graph_output(graph, replaced) else replaced.name  # (the editor names a graph output)
        editor = GraphEditor(graph, ctx)
        editor.commit(anchor, op.staged, [replaced], [out], [])
        editor.flush()
        if name is not None:  # out computes it (its Add is gone): out keeps its name, the residual
            out.name = name  # stream's between two layers (a layer boundary for k3opt.blocks)
        if y is not None:  # the gate's outputs replace the TopK's
            replace_uses(graph, b.topk.outputs[0], y)
            replace_uses(graph, b.topk.outputs[1], idx64)
        inside = {id(n) for n in b.region}
        for old, new in ((b.rows, ex), (b.flat_idx, eexp64)):
            for reader in [c for c in consumers(old) if id(c) in inside]:
                for i, t in enumerate(reader.inputs):
                    if t is old:
                        set_input(reader, i, new)
        skip = f" + the following {len(skips)} Add(s)" if skips else ""
        return (f"MoE block at '{b.where}' ({b.experts} experts, top-{b.k}): {gate}; token permutation -> "
                f"NPUMoeInitRouting; weighted combine{skip} -> NPUMoeFinalizeRouting")

    @staticmethod
    def _chain(graph: Graph, b: MoeBlock) -> tuple[Tensor, list[Tensor], Optional[Node]]:
        """What Finalize can take over after the combine: up to two Adds of a same-shape operand (its ``x1``,
        ``x2``: a shared expert, the residual), across one Reshape back to (B, S, H). Returns the last tensor
        taken, the Adds' other operands, and that Reshape (None if not taken). A value read elsewhere (a graph
        output, a second reader) ends the chain: it must be replaced itself."""
        cur, skips, unflatten = b.combine.outputs[0], [], None
        while len(skips) < 2:
            readers = consumers(cur)
            if len(readers) != 1 or is_graph_output(graph, cur):
                break
            r = readers[0]
            if r.op == "Reshape" and unflatten is None and r.outputs[0].shape is not None and \
                    len(r.outputs[0].shape) == 3 and r.outputs[0].shape[-1] == b.hidden and cur.shape is not None \
                    and len(cur.shape) == 2:
                unflatten, cur = r, r.outputs[0]
                continue
            other = (r.inputs[1] if r.inputs[0] is cur else r.inputs[0]) if r.op == "Add" else None
            if other is None or other is cur or other.dtype != cur.dtype or not (
                    _same_shape(other, cur) or (unflatten is None and _token_rows_of(other, b.x, b.hidden))):
                break
            skips.append(other)
            cur = r.outputs[0]
        if unflatten is not None and cur is unflatten.outputs[0]:  # a Reshape with no Add after it: not taken
            cur, unflatten = unflatten.inputs[0], None
        return cur, skips, unflatten

    def _row_idx(self, op: RewriteBuilder, b: MoeBlock) -> Tensor:
        """``row_idx[t, j] = j * T + t`` (int32, the gating op's third output, [MGS-doc]) for a kept gate."""
        idx = b.topk.outputs[1]
        t = op.Shape(idx, start=0, end=1)
        k = op.const(np.array([b.k], np.int64))
        total = op.Mul(t, k)
        flat = op.Range(op.const(np.array(0, np.int64)), op.Squeeze(total, op.const(np.array([0], np.int64))),
                        op.const(np.array(1, np.int64)))
        kt = op.Reshape(flat, op.Concat(k, t, axis=0))  # (k, T): row j holds j*T + t
        return self._typed(op.Cast(op.Transpose(kt, perm=[1, 0]), to=TensorProto.INT32), np.int32, idx.shape)

    @staticmethod
    def _typed(t: Tensor, dtype: Any, shape: Any) -> Tensor:
        t.dtype = dtype
        t.shape = list(shape) if shape is not None else None
        return t


def _same_shape(a: Tensor, b: Tensor) -> bool:
    """Provably one shape (no broadcast in an Add of the two): every dim an equal number or an equal name."""
    if a.shape is None or b.shape is None or len(a.shape) != len(b.shape):
        return False
    return all(x == y and (isinstance(x, (int, np.integer)) or (isinstance(x, str) and x))
               for x, y in zip(a.shape, b.shape))


def _token_rows_of(t: Tensor, x: Tensor, hidden: int, depth: int = 12) -> bool:
    """``t`` is (T, hidden) with x's T rows: computed from x by products with constant matrices and element-wise
    ops whose other operands are such tensors or constants without rows (a shared expert and its gate)."""
    if t.shape is None or len(t.shape) != 2 or (t is not x and depth == 0):
        return False
    if t is x:
        return True
    n = producer(t)
    if n is None:
        return False
    if n.op == "MatMul":
        w = n.inputs[1]
        return is_const(w) and w.shape is not None and len(w.shape) == 2 and \
            _token_rows_of(n.inputs[0], x, int(w.shape[0]), depth - 1) and t.shape[-1] == hidden
    if n.op == "Gemm":  # dynamo's Linear: rows of A times a constant B, plus a bias without rows
        a, w, c = n.inputs[0], n.inputs[1], (n.inputs[2] if len(n.inputs) > 2 else None)
        bias_ok = c is None or c.name == "" or (is_const(c) and c.shape is not None and
                                                (len(c.shape) < 2 or c.shape[0] == 1))
        return not n.attrs.get("transA", 0) and is_const(w) and bias_ok and a.shape is not None and \
            len(a.shape) == 2 and _token_rows_of(a, x, int(a.shape[1]), depth - 1) and t.shape[-1] == hidden
    if n.op in ("Split", "Slice"):  # columns of a merged projection (merge-sibling-matmuls)
        axes = [int(n.attrs.get("axis", 0))] if n.op == "Split" else \
            (int_list(n.inputs[3]) if len(n.inputs) > 3 else None)
        src = n.inputs[0]
        return axes is not None and all(a % 2 == 1 for a in axes) and src.shape is not None and \
            len(src.shape) == 2 and _token_rows_of(src, x, int(src.shape[1]), depth - 1) and t.shape[-1] == hidden
    if n.op in ("Add", "Mul", "Sub", "Div", "Sigmoid", "Relu", "Tanh", "Gelu", "Erf", "Cast", "Silu", "Neg"):
        rows = [i for i in n.inputs if not is_const(i)]
        consts_ok = all(i.shape is not None and (len(i.shape) < 2 or i.shape[0] == 1) for i in n.inputs if is_const(i))
        return bool(rows) and consts_ok and all(
            i.shape is not None and len(i.shape) == 2 and _token_rows_of(i, x, int(i.shape[1]), depth - 1)
            for i in rows) and t.shape[-1] == hidden
    return False
