"""lower-attention-npu: a recognised attention becomes ``NPUPromptFlashAttention`` (or, for a one-token decode
step with a one-head cache, ``NPUIncreFlashAttention``) for ``--target cann``, to the ATC plugin contract.

The recogniser (:mod:`.._shared.attention_match`) has proved the attention exact (softmax over the keys, constant
scale, no dropout, nothing escaping, GQA's repeat absorbed); this pass checks the plugin's and kernel's
contract (sources and facts in :mod:`k3opt.targets.cann.npu_contract` and docs/cann.md):

- inputs by position in the plugin's groups: ``query, key, value`` or ``query, key, value, "", atten_mask``
  (BNSD, ``input_layout="BNSD"``); every attribute set explicitly, as the plugin reads it (``num_heads``,
  ``scale_value`` as a FLOAT, ``num_key_value_heads``, ``pre_tokens``/``next_tokens``: absent they are 0/0
  through the plugin, which with a mask computes only the diagonal), ``sparse_mode``, ``inner_precise``;
- the mask: ``atten_mask = Not(keep)`` (bool, 1 = masked), expanded to (B|1, 1, Sq, Skv), with
  ``sparse_mode=0`` and ``pre_tokens = next_tokens = 2147483647`` (the whole band); a mask that is exactly
  the bottom-right causal triangle is ``sparse_mode=3`` with the documented 2048 x 2048 template;
- a query row with every key masked: what the device returns there is undocumented, so such rows are
  overridden in the graph (``Where(no key kept, graph's value, attention)``) with what the decomposed
  graph gives: 0 (a -inf fill under torch sdpa's IsNaN guard) or the mean of v (a finite fill such as
  the dtype's lowest, float32/bfloat16); -inf without the guard (NaN) and float16's lowest (the value
  depends on the scores) are kept decomposed. The kernel's
  invalid-row correction (``inner_precise`` bit 1, recommended with a mask) is asked for too;
- one head dim D <= 512, N <= 256, N / N_kv <= 64 ([PFA-doc]); a mask of unknown form, or one whose head
  axis is not provably 1, is kept decomposed;
- MLA (DeepSeek-V3/Kimi: q/k head dim nope + rope, e.g. 192, v head dim 128): the kernel's BNSD layout takes
  one D (the 192/128 pair is documented for TND in bf16 only), so v is zero-padded to the q/k dim and the
  output sliced back to v's: ``softmax(s) @ [v | 0] = [softmax(s) @ v | 0]``, exact in any dtype (the padded
  columns are sums of zeros). A v dim above the q/k dim pads q and k instead (``q . k`` is unchanged by zero
  columns). The padded D must be within the kernel's 512.

Decode: IncreFlashAttention's plugin never passes ``num_key_value_heads`` on, so the kernel keeps its
default 1: it is exact only for a one-head (MQA) cache, a static one-token query and no mask; every other
decode step (an MHA/GQA cache, the zoo's Llama and Qwen2) is PromptFlashAttention with its query rows.

Form (``--pass-option npu_attention_form=...``): ATC registers both ops only as ``npu::1`` and
``ai.onnx::11..16/19``, never at k3opt's opset 17. ``auto`` writes default-domain nodes and relabels the
model opset 16 when no op of the model differs between 16 and 17 (an LLM with RMSNorm), else uses the
``npu`` domain (torch_npu's exporter form; LayerNormalization needs 17); ``opset16`` and ``npu`` force one.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
from onnx import TensorProto

from ..npu_contract import ALL_TOKENS, MAX_GROUP, MAX_HEAD_DIM, MAX_HEADS, template_mask
from ..target_form import CANN_OPSET, FLASH_OPSET, NPU_DOMAIN, STAGING_DOMAIN, ops_changed_between
from ....errors import UsageError
from ....graph.ir import Graph, Node, Tensor, is_const, producer
from ....graph.symbolic.dims import Dims
from ....graph.symbolic.trace import UNARY_SAME_SHAPE
from ....graph.symbolic.input_dims import input_dims_written
from ....patterns import RewriteBuilder, apply_rules, checks
from ....passes._shared.shape_refs import shape_refs
from ....passes._shared.attention_match import AttentionMatch, attention_rules
from ....passes._shared.attention_sites import site_name
from ....pipeline.analyses import Shapes
from ....pipeline.option_values import choice
from ....pipeline.pass_base import Hints, Pass, PassContext

FORMS = ("auto", "opset16", "npu")
#: Float types in which a mask fill the recogniser accepts (<= half the lowest value) swamps any realistic score.
_SWAMPING_TYPES = (TensorProto.FLOAT, TensorProto.BFLOAT16)
#: inner_precise: bit 0 = 0 high precision; bit 1 = the invalid-row correction ([PFA-doc] "innerPrecise").
HIGH_PRECISION, ROW_CORRECTION = 0, 2


#: How many producers :func:`dim_refs` looks through.
_DEPTH = 12


def dim_refs(t: Tensor, depth: int = _DEPTH) -> Optional[list]:
    """Each dim of ``t``: a number, or ``("dim", x, axis)`` naming it as dim ``axis`` of the tensor ``x`` it is
    provably equal to (canonical: the furthest such tensor found), through head-split Reshapes (target
    elements read by the recogniser's :func:`shape_refs`), Transposes, Splits and same-shape ops."""
    shape = t.shape
    if shape is None:
        return None
    own: list = [int(d) if isinstance(d, (int, np.integer)) and d >= 0 else ("dim", t, i) for i, d in enumerate(shape)]
    n = producer(t)
    if n is None or depth <= 0 or (n.domain or "") not in ("", "ai.onnx") or not n.inputs:
        return own
    inner: Optional[list] = None
    if n.op == "Transpose" and len(n.attrs.get("perm", ())) == len(own):
        src = dim_refs(n.inputs[0], depth - 1)
        inner = None if src is None or len(src) != len(own) else [src[int(p)] for p in n.attrs["perm"]]
    elif n.op == "Split" and n.inputs[0].shape is not None and len(n.inputs[0].shape) == len(own):
        axis = int(n.attrs.get("axis", 0)) % len(own)
        src = dim_refs(n.inputs[0], depth - 1)
        inner = None if src is None else [r if i == axis else src[i] for i, r in enumerate(own)]
    elif n.op in UNARY_SAME_SHAPE and t is n.outputs[0]:  # a norm's mean/inv-std outputs differ
        inner = dim_refs(n.inputs[0], depth - 1)
    elif n.op == "Reshape" and len(n.inputs) == 2:
        target = [_canonical(r, depth - 1) for r in (shape_refs(n.inputs[1]) or [])]
        if len(target) == len(own):
            copy = not n.attrs.get("allowzero", 0)
            src = dim_refs(n.inputs[0], depth - 1) if copy and 0 in target else None
            inner = [own[i] if r == -1 or (isinstance(r, tuple) and r[0] != "dim") else
                     (src[i] if r == 0 and copy and src is not None and i < len(src) else r)
                     for i, r in enumerate(target)]
            inner = None if any(r == 0 and copy for r in inner) else inner
    if inner is None or len(inner) != len(own):
        return own
    return [o if isinstance(o, int) else r for o, r in zip(own, inner)]


def _canonical(ref: object, depth: int) -> object:
    """A :func:`shape_refs` element as :func:`dim_refs` names it."""
    if isinstance(ref, tuple) and ref[0] == "dim":
        refs = dim_refs(ref[1], depth)
        return refs[ref[2]] if refs is not None and ref[2] < len(refs) else ref
    return ref


def static_dim(t: Tensor, axis: int) -> Optional[int]:
    """Dim ``axis`` of ``t`` when provable: a number in :func:`dim_refs`, or the ``-1`` of a head-split
    Reshape whose other target dims are provably the input's (their sizes cancel, numbers remain)."""
    refs = dim_refs(t)
    if refs is None or axis >= len(refs):
        return None
    ref = refs[axis]
    if isinstance(ref, int):
        return ref if ref > 0 else None
    x, i = ref[1], ref[2]
    n = producer(x)
    if n is None or n.op != "Reshape" or len(n.inputs) != 2:
        return None
    target = [_canonical(r, _DEPTH) for r in (shape_refs(n.inputs[1]) or [])]
    src = dim_refs(n.inputs[0])
    if src is None or len(target) != len(x.shape or ()) or i >= len(target) or target[i] != -1 or \
            any(r == 0 for r in target):
        return None
    rest = [r for j, r in enumerate(target) if j != i]
    numerator = list(src)
    for r in [r for r in rest if isinstance(r, tuple)]:
        if r not in numerator:  # identity of canonical refs: the same dim of the same tensor
            return None
        numerator.remove(r)
    if not all(isinstance(r, int) for r in numerator):
        return None
    num = int(np.prod(numerator, dtype=np.int64))
    den = int(np.prod([r for r in rest if isinstance(r, int)], dtype=np.int64))
    return num // den if den > 0 and num % den == 0 and num // den > 0 else None


def _masked_rows_refusal(am: AttentionMatch, causal: bool) -> Optional[str]:
    """Why the graph's result for a query row with every key masked cannot be rebuilt, or None.

    The graph gives 0 there for a -inf fill with torch sdpa's IsNaN guard, the mean of v for a finite fill
    (guard or not) in float32 or bfloat16, where the recogniser's fills (<= half the dtype's lowest) make
    every score under 1e30 in magnitude round to the fill, so the softmax is uniform; NaN for -inf without
    the guard, and a score-dependent value in float16 (its lowest, -65504, is only 32 apart from its
    neighbour): those are kept decomposed. The device's own
    result for such a row is undocumented, so the lowering overrides those rows (:meth:`LowerAttentionNPU._dead_rows`).
    """
    if am.mask.keep is None or causal or am.mask.rows_open:
        return None
    if am.mask.fill == float("-inf"):
        return None if am.mask.zero_fully_masked else \
            "the mask fills -inf without the IsNaN guard: a query row with every key masked is NaN in the graph"
    if am.dtype not in _SWAMPING_TYPES:
        return (f"a query row with every key masked: in {TensorProto.DataType.Name(am.dtype)} the fill "
                f"{am.mask.fill:g} does not swamp the scores, so the graph's value there depends on them")
    return None


def _zero_padded(op: RewriteBuilder, x: Tensor, width: int) -> Tensor:
    """``x`` with ``width`` zero columns appended on its last (head-dim) axis (rank 4, BNSD)."""
    return op.Pad(x, op.const(np.array([0, 0, 0, 0, 0, 0, 0, width], np.int64)))


def _one_head_dim(op: RewriteBuilder, am: AttentionMatch) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v with one head dim: MLA's smaller side zero-padded to the larger (module doc)."""
    gap = am.head_dim_qk - am.head_dim_v
    if gap > 0:
        return am.q, am.k, _zero_padded(op, am.v, gap)
    if gap < 0:
        return _zero_padded(op, am.q, -gap), _zero_padded(op, am.k, -gap), am.v
    return am.q, am.k, am.v


def _v_dims(op: RewriteBuilder, am: AttentionMatch, out: Tensor) -> Tensor:
    """The flash attention's output cut back to v's head dim where v was zero-padded (MLA)."""
    if am.head_dim_qk <= am.head_dim_v:
        return out
    return op.Slice(out, op.const(np.array([0], np.int64)), op.const(np.array([am.head_dim_v], np.int64)),
                    op.const(np.array([3], np.int64)))


#: How many producers :func:`reads_cache` visits.
_CACHE_SEARCH = 64


def reads_cache(k: Tensor) -> bool:
    """Whether the keys are built from a graph input joined along a sequence by a Concat: a decode step whose cache
    is not the keys themselves (MLA caches its compressed latents, which ``kv_b_proj`` expands into the keys)."""
    seen: set[int] = set()
    todo = [k]
    while todo and len(seen) < _CACHE_SEARCH:
        n = producer(todo.pop())
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        if n.op == "Concat" and any(producer(t) is None and not is_const(t) for t in n.inputs):
            return True
        todo.extend(t for t in n.inputs if t is not None)
    return False


class LowerAttentionNPU(Pass):
    """Attention -> NPUPromptFlashAttention / NPUIncreFlashAttention (target cann) where the plugin makes it exact."""

    name = "lower-attention-npu"
    description = ("attention -> NPUPromptFlashAttention (prefill, MHA/GQA decode) or NPUIncreFlashAttention "
                   "(one-head-cache decode) where exact (target cann)")
    order = 2010
    _hints = Hints(adds_bodies=False)
    targets = ("cann",)
    lowering = True
    needs_shapes = True
    #: The replaced value keeps its dtype and shape; onnx's inference would lose them at the NPU nodes.
    preserves = frozenset({Shapes})
    options = {"npu_attention_form": "auto (opset 16 + default domain when no op differs from 17, else the "
                                     "npu domain), opset16 or npu"}
    option_values = {"npu_attention_form": choice(*FORMS)}

    def __init__(self) -> None:
        self.form: Optional[str] = None
        self.why_not_16: list[str] = []
        self.lowered: list[str] = []
        self.kept: dict[str, str] = {}
        self.template: Optional[Tensor] = None
        self.rules = attention_rules(self._rewrite, name="lower-attention-npu", on_decline=self._declined)

    def run(self, graph: Graph, ctx: PassContext) -> int:
        if self.form is None:
            self.form = self._choose_form(graph, ctx)
        with input_dims_written(graph):  # q/k/v's batch and sequence, however deep the layer
            return apply_rules(graph, ctx, self.rules, bodies=True)

    def _choose_form(self, graph: Graph, ctx: PassContext) -> str:
        wanted = str(ctx.options.get("npu_attention_form", "auto"))
        if wanted not in FORMS:
            raise UsageError(f"npu_attention_form={wanted!r}: choose one of {', '.join(FORMS)}")
        ops = {n.op for g in ctx.graphs(graph) for n in g.nodes if (n.domain or "") in ("", "ai.onnx")}
        self.why_not_16 = ops_changed_between(ops, CANN_OPSET, FLASH_OPSET)
        if wanted == "auto":
            return "npu" if self.why_not_16 else "opset16"
        return wanted

    def _declined(self, softmax: Node, why: str) -> None:
        where = site_name(softmax)
        self.kept.setdefault(where, f"attention at '{where}' kept decomposed: {why}")

    def _refusal(self, am: AttentionMatch, heads: Optional[int], kv_heads: Optional[int], causal: bool
                 ) -> Optional[str]:
        if self.form == "opset16" and self.why_not_16:
            return (f"the opset-16 form was asked for, but {', '.join(self.why_not_16)} differ(s) from opset 17 "
                    "(use npu_attention_form=npu)")
        d = max(am.head_dim_qk, am.head_dim_v)
        if d > MAX_HEAD_DIM:
            mla = f" (q/k {am.head_dim_qk}, v {am.head_dim_v}: MLA pads to the larger)" \
                if am.head_dim_qk != am.head_dim_v else ""
            return f"head dim {d}{mla} is over the kernel's {MAX_HEAD_DIM} ([PFA-doc] D <= 512)"
        if heads is None or kv_heads is None:
            return "the number of query or key/value heads is not static (num_heads is a required attribute)"
        if heads > MAX_HEADS or heads % kv_heads or heads // kv_heads > MAX_GROUP:
            return f"{heads} heads over {kv_heads} key/value heads is outside the kernel's limits"
        if am.mask.tensor is not None and am.mask.keep is None:
            return "the mask is of unknown form (not a boolean keep mask filled with -inf or the dtype's lowest)"
        return _masked_rows_refusal(am, causal)

    def _rewrite(self, op: RewriteBuilder, am: AttentionMatch) -> Optional[Tensor]:
        heads = am.q_num_heads or static_dim(am.q, 1)
        kv_heads = am.kv_num_heads or static_dim(am.v, 1)
        # its own Dims: input_dims_written changed shapes that the run's kept one may have read before
        dims = Dims(am.match.graph)
        sq, skv = dims.at(am.q, 2), dims.at(am.k, 2)
        # sparse_mode 3 (bottom-right causal) only where no row is fully masked (Sq <= Skv); else a full mask
        causal = am.mask.causal_only and isinstance(sq, int) and isinstance(skv, int) and sq <= skv
        why = self._refusal(am, heads, kv_heads, causal)
        mask: Optional[Tensor] = None
        keep = self._keep(dims, am) if why is None and am.mask.keep is not None and not causal else None
        if isinstance(keep, str):
            why = keep
        elif keep is not None:
            mask = self._atten_mask(op, am, keep)
        if why is not None:
            am.match.fail(why)
            return None
        assert heads is not None and kv_heads is not None
        domain = NPU_DOMAIN if self.form == "npu" else STAGING_DOMAIN
        where = site_name(am.softmax)
        q, k, v = _one_head_dim(op, am)
        mla = f", MLA: q/k dim {am.head_dim_qk}, v dim {am.head_dim_v} padded" if q is not am.q or v is not am.v else ""
        if am.cache is not None and kv_heads == 1 and sq == 1 and mask is None:
            self.lowered.append(f"attention at '{where}' -> NPUIncreFlashAttention (one-head cache, one query{mla})")
            return _v_dims(op, am, op.NPUIncreFlashAttention(
                q, k, v, None, None, None, _domain=domain, _name="NPUIncreFlashAttention", num_heads=heads,
                input_layout="BNSD", scale_value=float(am.scale)))
        attrs = dict(num_heads=heads, input_layout="BNSD", scale_value=float(am.scale), num_key_value_heads=kv_heads,
                     pre_tokens=ALL_TOKENS, next_tokens=ALL_TOKENS, sparse_mode=0, inner_precise=HIGH_PRECISION)
        inputs: list = [q, k, v]
        if causal:
            if self.template is None:
                self.template = op.const(template_mask(), np.bool_)
            inputs += [None, self.template]
            attrs.update(sparse_mode=3, next_tokens=0)
            kind = "causal, sparse_mode 3"
        elif mask is not None:
            inputs += [None, mask]
            attrs.update(inner_precise=HIGH_PRECISION | ROW_CORRECTION)
            kind = "mask, sparse_mode 0"
        else:
            kind = "no mask"
        step = "decode step" if am.cache is not None or reads_cache(am.k) else "prefill"
        self.lowered.append(f"attention at '{where}' -> NPUPromptFlashAttention ({step}, {heads}/{kv_heads} heads, "
                            f"{kind}{mla})")
        out = _v_dims(op, am, op.NPUPromptFlashAttention(*inputs, _domain=domain, _name="NPUPromptFlashAttention",
                                                         **attrs))
        if mask is not None and isinstance(keep, Tensor):
            out = self._dead_rows(op, am, keep, out, heads, kv_heads)
        return out

    @staticmethod
    def _keep(dims: Dims, am: AttentionMatch) -> Tensor | str:
        """The keep mask with one head axis (an Expand over heads peeled), or why that is not provable."""
        keep = am.mask.keep
        assert keep is not None
        rank = checks.rank(keep)
        head_axis = (rank or 0) - 3  # the head axis under ONNX's right-aligned broadcasting
        if rank is not None and rank <= 4 and (head_axis < 0 or dims.at(keep, head_axis) == 1):
            return keep
        n = producer(keep) if rank is not None and rank <= 4 else None
        inner = n.inputs[0] if n is not None and n.op == "Expand" else None  # broadcasts like the Expand's result
        if inner is not None and checks.rank(inner) == rank and dims.at(inner, head_axis) == 1:
            return inner
        return ("the mask's head axis is not provably 1: PromptFlashAttention takes (B|1, 1, Sq, Skv) masks, "
                "one for all heads")

    @staticmethod
    def _atten_mask(op: RewriteBuilder, am: AttentionMatch, keep: Tensor) -> Tensor:
        """``Not(keep)`` (bool, 1 = masked) expanded to (B|1, 1, Sq, Skv)."""
        shape = op.Concat(op.const(np.ones(2, np.int64)), op.Shape(am.q, start=2, end=3),
                          op.Shape(am.k, start=2, end=3), axis=0)
        return op.Expand(op.Not(keep), shape)

    @staticmethod
    def _dead_rows(op: RewriteBuilder, am: AttentionMatch, keep: Tensor, out: Tensor, heads: int,
                   kv_heads: int) -> Tensor:
        """``out`` with the graph's result in query rows whose keys are all masked: 0 (a -inf fill under sdpa's
        guard) or the mean of v over the keys (a finite fill), whatever the device computes there (undocumented)."""
        seen = op.ReduceMax(op.Cast(keep, to=TensorProto.FLOAT), axes=[-1], keepdims=1)  # opset 16/17 form
        dead = op.Equal(seen, op.const(np.zeros((), np.float32)))
        if am.mask.fill == float("-inf"):  # with the guard (else refused): 0
            fallback = op.Cast(op.const(np.zeros((), np.float32)), to=am.dtype)
        else:
            fallback = op.ReduceMean(am.v, axes=[2], keepdims=1)  # (B, Nkv, 1, Dv)
            if heads != kv_heads:  # query head h reads key/value head h // (heads / kv_heads)
                grouped = op.Expand(op.Unsqueeze(fallback, op.const(np.array([2], np.int64))),
                                    op.const(np.array([1, 1, heads // kv_heads, 1, 1], np.int64)))
                fallback = op.Reshape(grouped, op.const(np.array([0, heads, 1, am.head_dim_v], np.int64)))
        return op.Where(dead, fallback, out)

    def finish(self, graph: Graph, ctx: PassContext) -> None:
        """The lowering lines: the form, how many attentions were lowered, each one, and why the others were not."""
        total = len(self.lowered) + len(self.kept)
        if not total:
            ctx.note("NPU flash attention: no attention found")
            return
        form = ("npu domain (npu:1)" if self.form == "npu" else f"opset {FLASH_OPSET}, default domain") + \
            (f"; opset 16 not possible: {', '.join(self.why_not_16)} differ(s) from 17" if self.why_not_16 else "")
        ctx.note(f"NPU flash attention: {len(self.lowered)} of {total} attention(s) lowered ({form})")
        for line in [*self.lowered, *self.kept.values()]:
            ctx.note(line)

