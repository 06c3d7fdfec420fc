"""fuse-rmsnorm: recognises RMSNorm ``x / sqrt(mean(x^2) + eps) * w`` and, for ``--target onnx`` at
opset >= 23, makes it one ``RMSNormalization`` (default domain; onnxruntime 1.32 runs it).

Forms (see docs/passes/fuse-rmsnorm.md): Llama/Qwen2/DeepSeek-V3's ``hidden.to(float32)``,
``pow(2).mean(-1, keepdim=True)``, ``hidden * rsqrt(var + eps)``, ``weight * hidden.to(input_dtype)``,
as TorchScript (Div(1, Sqrt)) and dynamo (Reciprocal(Sqrt)) export them; Pow(x, 2) or Mul(x, x);
Div by the Sqrt or Mul by its inverse; weight on either side or absent. The checks are LayerNorm's
(:func:`.._shared.norm_match.analyze`): trailing constant axes, static normalized dims, constant scalar eps,
no narrowing Cast, a weight that broadcasts over exactly the normalized dims.

Below opset 23, or for another target, RMSNorms stay decomposed: the pass rewrites nothing
and counts them once on the final graph (its ``finish``: ``ctx.counters["rmsnorm_found"]``,
a report note "N RMSNorm found, left decomposed: ...").

Entry point for lowerings (the CANN bridge lowers to ``NPURmsNorm``)::

    rules = rmsnorm_rules(rewrite)            # list[Rule], largest pattern first
    OrderedRulesPass(rules, name="...").run(graph, ctx)   # or apply_rules(graph, ctx, rules, bodies=True)

``rewrite(op, nm)`` gets the rewrite builder and a :class:`~.._shared.norm_match.NormMatch`:
``nm.x`` (input before the match's Casts), ``nm.weight`` (the constant weight as matched, or
None), ``nm.epsilon`` (float), ``nm.axis``/``nm.axes``/``nm.normalized_shape``,
``nm.input_dtype``/``nm.compute_dtype``/``nm.output_dtype`` (ONNX element types),
``nm.casts`` (the Cast nodes of the match), ``nm.reduce`` (the ReduceMean of the squares, which
names the norm). It returns the replacement tensor (of ``nm.output_dtype``, ``x``'s shape) or None
to leave the norm decomposed. ``norm_input(op, nm)`` is the input in the output type and
``affine_input(op, nm, nm.weight, 1.0)`` the weight in exactly ``normalized_shape`` (ones if none).
Apply the rules in their order, one sweep each, so the weighted rule sees a norm before the
weightless one can claim its statistics; a norm the callback declines is offered again by the
next smaller rule (so a callback may see one norm, named by ``nm.reduce``, more than once).
"""
from __future__ import annotations

import re

from ...graph.ir import Graph, Node, Tensor, producer
from ...patterns import RewriteBuilder, apply_rules
from ...pipeline.analyses import Shapes
from ...pipeline.pass_base import Hints, Pass, PassContext
from .._shared.norm_match import (LAYER_NORMALIZATION_OPSET, NormMatch, affine_input, norm_input, rms_norm_core,
                                  rmsnorm_rules, tail_rules)
from ._left_decomposed import note_left_decomposed

#: First opset with RMSNormalization in the default domain.
RMS_NORMALIZATION_OPSET = 23
_NOTE = re.compile(r"^\d+ RMSNorm found, left decomposed: ")
_LN_NOTE = re.compile(r"^\d+ LayerNorm found, left decomposed: ")


def to_rms_normalization(op: RewriteBuilder, nm: NormMatch) -> Tensor:
    """``RMSNormalization(x, weight or ones, axis, epsilon, stash_type=1)`` (opset 23)."""
    return op.RMSNormalization(norm_input(op, nm), affine_input(op, nm, nm.weight, 1.0), axis=nm.axis,
                               epsilon=nm.epsilon, stash_type=1)


RULES = rmsnorm_rules(to_rms_normalization)


def find_rmsnorms(graph: Graph, ctx: PassContext) -> tuple[list[Node], list[Node]]:
    """The ReduceMean (of the squares) of every RMSNorm recognised, and of every such core that normalizes a
    centered ``x - mean(x)``: a LayerNorm's, left to fuse-layernorm (counted apart); changes nothing.

    The weightless rules suffice: a norm the weighted rule takes, one of them takes too (same checks
    less the weight's; the one with the Cast back when the weighted match has it).
    """
    found: dict[int, Node] = {}
    centered: dict[int, Node] = {}

    def record(op: RewriteBuilder, nm: NormMatch) -> None:
        (centered if _centered(nm.x) else found).setdefault(id(nm.reduce), nm.reduce)

    apply_rules(graph, ctx, tail_rules("rmsnorm", rms_norm_core, (("cast",), ()), False, record, "RMSNorm"),
                bodies=True)
    return [n for k, n in found.items() if k not in centered], list(centered.values())


def _centered(x: Tensor) -> bool:
    """``x`` is ``Sub(v, ReduceMean(v))`` (through a Cast of either): the centering of a LayerNorm."""
    node = producer(x)
    if node is not None and node.op == "Cast":
        node = producer(node.inputs[0])
    if node is None or node.op != "Sub" or len(node.inputs) != 2:
        return False
    mean = producer(node.inputs[1])
    return mean is not None and mean.op == "ReduceMean" and mean.inputs[0] is node.inputs[0]


class FuseRMSNorm(Pass):
    """RMSNorm -> RMSNormalization for --target onnx at opset >= 23; otherwise counted and left decomposed."""

    name = "fuse-rmsnorm"
    description = "RMSNorm -> RMSNormalization (target onnx, opset >= 23); counted and kept decomposed otherwise"
    order = 510
    _hints = Hints(adds_bodies=False)
    preserves = frozenset({Shapes})
    needs_shapes = True

    def run(self, graph: Graph, ctx: PassContext) -> int:
        return apply_rules(graph, ctx, RULES, bodies=True) if _fusable(ctx) else 0

    def finish(self, graph: Graph, ctx: PassContext) -> None:
        """Where RMSNorms stay decomposed, count them once, on the final graph (``rmsnorm_found``, a note); the
        LayerNorms whose core it also matches are not RMSNorms: below opset 17 (no LayerNormalization, so
        fuse-layernorm did not run) they get their own note."""
        if _fusable(ctx):
            return
        rmsnorms, layernorms = find_rmsnorms(graph, ctx)
        note_left_decomposed(ctx, "rmsnorm_found", len(rmsnorms), _NOTE, "RMSNorm", RMS_NORMALIZATION_OPSET,
                             lowered_by_target=True)
        ctx.notes[:] = [n for n in ctx.notes if not _LN_NOTE.match(n)]
        if layernorms and ctx.emit_opset < LAYER_NORMALIZATION_OPSET:
            ctx.note(f"{len(layernorms)} LayerNorm found, left decomposed: opset < {LAYER_NORMALIZATION_OPSET} "
                     "(LayerNormalization)")


def _fusable(ctx: PassContext) -> bool:
    return ctx.target.fuses_to_standard_ops and ctx.emit_opset >= RMS_NORMALIZATION_OPSET
