"""Opset conversion: raise old models to opset 17 (LayerNormalization) or to what the user asks.

Only the nodes whose schema changes between the two opsets are converted
(:mod:`.opset_nodes`): the rest of the graph, weights included, is left as
it is and the opset import is bumped.
"""
from __future__ import annotations

import re
from typing import Callable, Iterable, Optional, Protocol

import onnx
from onnx import version_converter

from ..errors import UsageError
from .opset_down import NoOpset17Form, rewrite_for_17
from .opset_nodes import ModelScope, all_graphs, convert_changed_nodes
from .opset_softmax import upgrade_cost

#: Models below this are raised to it by default; the CANN target needs exactly it.
DEFAULT_OPSET = 17
#: The oldest opset onnxruntime runs (it refuses models below 7): the lowest output opset k3opt writes.
MIN_OPSET = 7
_DEFAULT_DOMAINS = ("", "ai.onnx")


def max_opset() -> int:
    """The newest opset onnx knows (what its converter and checker accept): the highest output opset."""
    return onnx.defs.onnx_opset_version()


def model_opset(model: onnx.ModelProto) -> int:
    """The model's default-domain opset version (1 when it imports none)."""
    versions = [o.version for o in model.opset_import if o.domain in _DEFAULT_DOMAINS]
    return max(versions, default=1)


class OpsetPolicy(Protocol):
    """What the conversion asks of a target (:class:`k3opt.targets.Target`): its name and the output opset it
    fixes, if any."""

    name: str
    fixed_opset: Optional[int]


def wanted_opset(model: onnx.ModelProto, opset: Optional[int] = None, *, target: Optional[OpsetPolicy] = None) -> int:
    """The opset the output gets: ``opset`` if given, the target's fixed opset (cann: exactly 17), else at
    least 17."""
    if opset is not None and (isinstance(opset, bool) or not isinstance(opset, int)
                              or not MIN_OPSET <= opset <= max_opset()):
        raise UsageError(f"opset {opset!r}: choose an opset from {MIN_OPSET} to {max_opset()}")
    fixed = None if target is None else target.fixed_opset
    if fixed is not None:
        if opset is not None and opset != fixed:
            raise UsageError(f"--target {target.name} needs opset {fixed}, not {opset}")
        return fixed
    return opset if opset is not None else max(model_opset(model), DEFAULT_OPSET)


def converts_down(model: onnx.ModelProto, opset: Optional[int] = None, *, target: Optional[OpsetPolicy] = None
                  ) -> bool:
    """Is the wanted opset below the model's? Then convert after the passes, not before.

    Going down often needs constants the passes make (opset 18's ReduceMean
    takes its axes as an input, often a Reshape of a constant, and opset 17
    needs them as an attribute), while going up must come first so the
    passes needing the newer opset (LayerNormalization: 17) can run.
    """
    return wanted_opset(model, opset, target=target) < model_opset(model)


def convert(
    model: onnx.ModelProto, opset: Optional[int] = None, *, target: Optional[OpsetPolicy] = None, bodies: bool = True,
    needs_newer: Optional[Callable[[set[str], int], bool]] = None,
) -> tuple[onnx.ModelProto, list[str]]:
    """Return (model at the wanted opset, report notes): ``model`` itself, converted in place.

    No ``opset``: below 17 is raised to 17, otherwise kept; if raising fails
    the model keeps its opset (and its nodes) and a note says so. An explicit ``opset`` or
    a target's fixed opset (cann: exactly 17) must succeed, else UsageError naming the
    blocking op. ``bodies=False``: no node of the model holds a body (its
    validation saw none), so none is looked for.

    ``needs_newer(ops, opset)``: whether a pass of the run needs an opset above ``opset`` for a model
    holding the op types ``ops``. Given, and answering no, a raise that would add nodes no pass removes
    (:func:`.opset_softmax.upgrade_cost`) is not made: the model keeps its opset, and a note says why.
    """
    current = model_opset(model)
    strict = opset is not None or (target is not None and target.fixed_opset is not None)
    wanted = wanted_opset(model, opset, target=target)
    if wanted == current:
        return _single_default_import(model, current), []
    if not strict and needs_newer is not None and wanted > current:
        cost = upgrade_cost(model, current, wanted)
        if cost and not needs_newer(model_ops(model), current):
            return _single_default_import(model, current), [
                f"opset kept at {current}: converting to {wanted} would add {cost} node(s) (Softmax-like ops over "
                f"several axes change meaning at opset 13) and no pass needs a newer opset"]
    reason = inexact_conversion(model, current, wanted)
    converted = None
    if reason is None:
        try:
            converted = _convert_changed_nodes(model, current, wanted, bodies)
        except (_InexactConversion, NoOpset17Form) as exc:
            reason = str(exc)
        except Exception as exc:  # onnx's converter raises RuntimeError/ValueError/IndexError...
            reason = _blocking_reason(model, wanted, exc)
    if reason is not None:
        if strict:
            raise UsageError(f"cannot convert opset {current} to {wanted}: {reason}") from None
        return model, [f"opset kept at {current}: conversion to {wanted} failed ({reason})"]
    return converted, [f"opset converted from {current} to {wanted}"]


#: onnx version-converter adapters that change what the op computes, by (op, one opset, the next): Scan 8
#: has a batch axis that Scan 9 lacks, and onnx's adapter (either way) only rewrites the declared shapes, so
#: the converted Scan reads the batch axis as its sequence axis (onnx's test_scan_sum then fails to run).
#: Dropout's mask: at opsets 7-9 a float tensor, bool from 10; in inference onnxruntime fills it with zeros
#: (False) below opset 12 and with True from 12. Inexact only where the mask is read (:func:`_reads_mask`).
INEXACT_ADAPTERS = {
    ("Scan", 8, 9): "onnx's converter changes its batch axis into the sequence axis",
    ("Dropout", 9, 10): "its mask output turns from float to bool",
    ("Dropout", 11, 12): "its inference mask turns from all False to all True in onnxruntime",
}


def model_ops(model: onnx.ModelProto) -> set[str]:
    """The op types of the model's nodes, bodies included."""
    return {n.op_type for g in all_graphs(model.graph) for n in g.node}


def inexact_conversion(model: onnx.ModelProto, current: int, wanted: int) -> Optional[str]:
    """Why converting ``model`` from opset ``current`` to ``wanted`` would change an op's meaning (an op,
    subgraphs included, crossing one of :data:`INEXACT_ADAPTERS`), or None."""
    low, high = sorted((current, wanted))
    if wanted < 21 <= current:
        why = _blocked_dequantize(model)
        if why:
            return why
    crossed: dict[str, str] = {}
    for (op, before, after), why in INEXACT_ADAPTERS.items():
        if low <= before and after <= high:
            crossed[op] = f"{crossed[op]}; {why}" if op in crossed else why
    if not crossed:
        return None
    for graph in all_graphs(model.graph):
        for node in graph.node:
            if node.op_type in crossed and node.domain in _DEFAULT_DOMAINS and (
                    node.op_type != "Dropout" or _reads_mask(model, node)):
                where = f" (node '{node.name}')" if node.name else ""
                return f"op {node.op_type}{where} has no exact conversion: {crossed[node.op_type]}"
    return None


def _reads_mask(model: onnx.ModelProto, node: onnx.NodeProto) -> bool:
    """Is this Dropout's mask output read (by a node, in any graph, or as a graph output)?"""
    mask = node.output[1] if len(node.output) > 1 else ""
    if not mask:
        return False
    return any(o.name == mask for o in model.graph.output) or any(
        mask in n.input for g in all_graphs(model.graph) for n in g.node)


def _blocked_dequantize(model: onnx.ModelProto) -> Optional[str]:
    """Why a DequantizeLinear of the model has no form below opset 21 (blocked, or 4-bit), or None."""
    inits = {t.name: t.data_type for t in model.graph.initializer}
    four_bit = {onnx.TensorProto.INT4, onnx.TensorProto.UINT4}
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" and node.domain in _DEFAULT_DOMAINS and (
                any(a.name == "block_size" and a.i for a in node.attribute) or inits.get(node.input[0]) in four_bit):
            return (f"DequantizeLinear '{node.name}' is blocked or 4-bit (a k3opt quantize int4 output), which has no "
                    f"form below opset 21; for Ascend, quantize the float model with `k3opt quantize --target cann`")
    return None


def _interface_change(before: onnx.ModelProto, after: onnx.ModelProto) -> Optional[str]:
    """What the converter changed in the graph's inputs or outputs (type, rank or a fixed dim), or None:
    a conversion that does so changed what the model computes or accepts."""
    old = {vi.name: vi for vi in list(before.graph.input) + list(before.graph.output)}
    for vi in list(after.graph.input) + list(after.graph.output):
        was = old.get(vi.name)
        if was is None or not was.type.HasField("tensor_type"):
            continue
        a, b = was.type.tensor_type, vi.type.tensor_type
        changed = a.elem_type != b.elem_type
        if a.HasField("shape") and b.HasField("shape"):
            dims = list(zip(a.shape.dim, b.shape.dim))
            changed |= len(a.shape.dim) != len(b.shape.dim) or any(
                x.HasField("dim_value") and x.dim_value != y.dim_value for x, y in dims)
        if changed:
            return (f"onnx's version converter changed '{vi.name}' from {_type_text(a)} to {_type_text(b)}"
                    f"{_ops_text(before)}")
    return None


def _type_text(t: onnx.TypeProto.Tensor) -> str:
    dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in t.shape.dim]
    return f"{onnx.helper.tensor_dtype_to_string(t.elem_type).replace('TensorProto.', '')}{dims}"


def _ops_text(model: onnx.ModelProto) -> str:
    ops = sorted({n.op_type for n in model.graph.node if n.domain in _DEFAULT_DOMAINS})
    return f" (ops: {', '.join(ops[:8])}{', ...' if len(ops) > 8 else ''})" if ops else ""


def _single_default_import(model: onnx.ModelProto, version: int) -> onnx.ModelProto:
    others = [o for o in model.opset_import if o.domain not in _DEFAULT_DOMAINS]
    if len(model.opset_import) - len(others) != 1:
        del model.opset_import[:]
        model.opset_import.extend([onnx.helper.make_opsetid("", version)] + others)
    return model


def _convert_changed_nodes(model: onnx.ModelProto, current: int, wanted: int, bodies: bool = True) -> onnx.ModelProto:
    """``model`` at opset ``wanted``, converted in place: only the nodes whose schema changes in between
    go through onnx's converter (on a sub-model of them, see :mod:`.opset_nodes`), each sub-model checked
    and its interface compared; the model is left as it was when any of that fails, but for the
    rewrites of :func:`.opset_down.rewrite_for_17` going below 18 (same values, valid at either opset)."""
    def convert_sub(sub: onnx.ModelProto, version: int) -> onnx.ModelProto:
        # onnx's converter (C++) assumes valid nodes: one with an attribute twice, of two types, crashed it
        _check_nodes(sub.graph.node, _checker(sub.ir_version, sub.opset_import))
        converted = _convert_hiding_unadapted(sub, version)
        _check_nodes(converted.graph.node, _checker(converted.ir_version, converted.opset_import))
        reason = _interface_change(sub, converted)
        if reason is not None:
            raise _InexactConversion(reason)
        return converted

    def check_kept(nodes: list[onnx.NodeProto]) -> None:  # as convert_sub checks them, had they been converted
        if nodes:
            others = [o for o in model.opset_import if o.domain not in _DEFAULT_DOMAINS]
            _check_nodes(nodes, _checker(model.ir_version, [onnx.helper.make_opsetid("", wanted)] + others))

    scope = None
    if current >= 18 > wanted:
        scope = ModelScope(model)
        rewrite_for_17(model, scope)
    convert_changed_nodes(model, current, wanted, convert_sub, scope, check_kept, bodies)
    imports = [o for o in model.opset_import if o.domain not in _DEFAULT_DOMAINS]
    del model.opset_import[:]
    model.opset_import.extend([onnx.helper.make_opsetid("", wanted)] + imports)
    return model


def _checker(ir_version: int, imports: Iterable[onnx.OperatorSetIdProto]) -> onnx.checker.C.CheckerContext:
    ctx = onnx.checker.C.CheckerContext()
    ctx.ir_version = ir_version
    ctx.opset_imports = {o.domain: o.version for o in imports}
    return ctx


def _check_nodes(nodes: Iterable[onnx.NodeProto], ctx: onnx.checker.C.CheckerContext) -> None:
    """onnx's checker on each of ``nodes`` and the nodes of their bodies, each against its schema (a
    sub-model's inputs may be untyped, which the whole-model check refuses)."""
    for node in nodes:
        bodies = [a for a in node.attribute if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)]
        if bodies:  # the bodies read outer names the checker would not find: check their nodes one by one
            bare = onnx.NodeProto()
            bare.CopyFrom(node)
            for attr in bare.attribute:
                for g in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    g.Clear()
                    g.name = "body"
            node = bare
            for attr in bodies:
                for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    _check_nodes(sub.node, ctx)
        onnx.checker.check_node(node, ctx)


class _InexactConversion(Exception):
    """The converter changed a converted sub-model's inputs or outputs (the message says how)."""


#: Domain that hides nodes from the converter (see _convert_hiding_unadapted).
_HIDDEN = "k3opt.modelio.opset.unchanged"


def _convert_hiding_unadapted(model: onnx.ModelProto, wanted: int) -> onnx.ModelProto:
    """onnx's converter, going down, with nodes it has no adapter for passed through unchanged
    when they are already valid at the older version (e.g. opset 18's Split with a ``split`` input
    is an opset-13 Split: onnx has no Split 18 -> 17 adapter).

    Such nodes are moved to a private domain while converting, then back. ``model`` is modified.
    """
    _drop_new_default_attributes(model.graph, model_opset(model), wanted)
    hidden: set[str] = set()
    while True:
        try:
            converted = version_converter.convert_version(model, wanted)
            break
        except Exception as exc:  # the converter raises RuntimeError/ValueError/IndexError...
            m = re.search(r"No Adapter (?:From|To) Version \$?\d+ for (\w+)", str(exc))
            op = m.group(1) if m else None
            if op is None or op in hidden or not _valid_at(model.graph, op, wanted):
                raise
            hidden.add(op)
            for node in model.graph.node:
                if node.op_type == op and node.domain in _DEFAULT_DOMAINS:
                    node.domain = _HIDDEN
            if _HIDDEN not in {o.domain for o in model.opset_import}:
                model.opset_import.append(onnx.helper.make_opsetid(_HIDDEN, 1))
    for node in converted.graph.node:
        if node.domain == _HIDDEN:
            node.domain = ""
    imports = [o for o in converted.opset_import if o.domain != _HIDDEN]
    del converted.opset_import[:]
    converted.opset_import.extend(imports)
    return converted


def _drop_new_default_attributes(graph: onnx.GraphProto, current: int, wanted: int) -> None:
    """Remove attributes the op at opset ``wanted`` lacks when they hold their default at ``current``
    (same meaning either way): onnx's ReduceMean 18 -> 17 adapter keeps ``noop_with_empty_axes=0``
    and then fails on it."""
    for node in graph.node:
        if node.domain not in _DEFAULT_DOMAINS:
            continue
        try:
            old = onnx.defs.get_schema(node.op_type, wanted, "")
            new = onnx.defs.get_schema(node.op_type, current, "")
        except onnx.defs.SchemaError:
            continue
        keep = [a for a in node.attribute if a.name in old.attributes or not _is_default(a, new)]
        if len(keep) < len(node.attribute):
            del node.attribute[:]
            node.attribute.extend(keep)


def _is_default(attr: onnx.AttributeProto, schema: onnx.defs.OpSchema) -> bool:
    spec = schema.attributes.get(attr.name)
    if spec is None or spec.default_value.type == onnx.AttributeProto.UNDEFINED:
        return False
    return onnx.helper.get_attribute_value(attr) == onnx.helper.get_attribute_value(spec.default_value)


def _valid_at(graph: onnx.GraphProto, op: str, version: int) -> bool:
    """Do all ``op`` nodes fit the op's schema at ``version`` (input count and attribute names)?"""
    try:
        schema = onnx.defs.get_schema(op, version, "")
    except onnx.defs.SchemaError:
        return False
    return all(len(n.input) <= schema.max_input and {a.name for a in n.attribute} <= set(schema.attributes)
               for n in graph.node if n.op_type == op and n.domain in _DEFAULT_DOMAINS)


def _blocking_reason(model: onnx.ModelProto, wanted: int, exc: Exception) -> str:
    current = model_opset(model)
    constants = {t.name for t in model.graph.initializer}
    constants.update(o for n in model.graph.node if n.op_type == "Constant" and n.domain in _DEFAULT_DOMAINS
                     for o in n.output)
    for node in model.graph.node:
        if node.domain not in _DEFAULT_DOMAINS:
            continue
        where = f" (node '{node.name}')" if node.name else ""
        try:
            old = onnx.defs.get_schema(node.op_type, wanted, "")
        except onnx.defs.SchemaError:
            return f"op {node.op_type}{where} does not exist at opset {wanted}"
        computed = _computed_input_turned_attribute(node, old, current, constants)
        if computed is not None:
            return (f"op {node.op_type}{where}: its '{computed}' input is computed, not a constant, "
                    f"and opset {wanted} needs it as an attribute")
    text = str(exc)
    m = re.search(r"No Adapter (From|To) Version \$?(\d+) for (\w+)", text)
    if m:
        return f"onnx's version converter cannot convert op {m.group(3)} ({m.group(1).lower()} version {m.group(2)})"
    return ((text.strip().splitlines() or [type(exc).__name__])[0])[:300]


def _computed_input_turned_attribute(node: onnx.NodeProto, old: onnx.defs.OpSchema, current: int,
                                     constants: set[str]) -> Optional[str]:
    """Name of an input of ``node`` (at opset ``current``) that the ``old`` schema only has as an
    attribute and that is not a constant (the converter cannot move it), else None."""
    if len(node.input) <= old.max_input:
        return None
    new = onnx.defs.get_schema(node.op_type, current, "")
    for i in range(old.max_input, len(node.input)):
        if node.input[i] and node.input[i] not in constants:
            return new.inputs[min(i, len(new.inputs) - 1)].name
    return None
