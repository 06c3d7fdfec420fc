"""Opset conversion: raise old models to opset 17 (LayerNormalization) or to what the user asks.

The converter runs on a weight-less copy (big tensors' data stripped), and
the original weights are grafted back by name, so a multi-GB model
converts without its weights in memory.
"""
from __future__ import annotations

import re
from typing import Optional

import onnx
from onnx import version_converter
from onnx.external_data_helper import uses_external_data

from .errors import UsageError
from .io import inline_copy, weights_as_inputs

#: Models below this are raised to it by default; the CANN target needs exactly it.
DEFAULT_OPSET = 17
_DEFAULT_DOMAINS = ("", "ai.onnx")


def model_opset(model: onnx.ModelProto) -> int:
    """The model's default-domain opset version (1 when it imports none)."""
    versions = [o.version for o in model.opset_import if o.domain in _DEFAULT_DOMAINS]
    return max(versions, default=1)


def convert(
    model: onnx.ModelProto, opset: Optional[int] = None, *, target: str = "onnx"
) -> tuple[onnx.ModelProto, list[str]]:
    """Return (model at the wanted opset, report notes).

    No ``opset``: below 17 is raised to 17, otherwise kept; if raising fails
    the model keeps its opset and a note says so. An explicit ``opset`` or
    the cann target (exactly 17) must succeed, else UsageError naming the
    blocking op.
    """
    current = model_opset(model)
    strict = opset is not None or target == "cann"
    if target == "cann":
        if opset is not None and opset != DEFAULT_OPSET:
            raise UsageError(f"--target cann needs opset {DEFAULT_OPSET}, not {opset}")
        wanted = DEFAULT_OPSET
    elif opset is not None:
        wanted = opset
    else:
        wanted = max(current, DEFAULT_OPSET)
    if wanted == current:
        return _single_default_import(model, current), []
    try:
        converted = _convert_weightless(model, wanted)
    except Exception as exc:  # onnx's converter raises RuntimeError/ValueError/IndexError...
        reason = _blocking_reason(model, wanted, exc)
        if strict:
            raise UsageError(f"cannot convert opset {current} to {wanted}: {reason}") from None
        return model, [f"opset kept at {current}: conversion to {wanted} failed ({reason})"]
    return converted, [f"opset converted from {current} to {wanted}"]


def _single_default_import(model: onnx.ModelProto, version: int) -> onnx.ModelProto:
    others = [o for o in model.opset_import if o.domain not in _DEFAULT_DOMAINS]
    if len(model.opset_import) - len(others) != 1:
        del model.opset_import[:]
        model.opset_import.extend([onnx.helper.make_opsetid("", version)] + others)
    return model


def _convert_weightless(model: onnx.ModelProto, wanted: int) -> onnx.ModelProto:
    """Convert with big initializers turned into typed graph inputs, then put them back in order."""
    light, big = weights_as_inputs(model)
    declared = {vi.name for vi in model.graph.input}
    converted = version_converter.convert_version(_single_default_import(light, model_opset(light)), wanted)
    onnx.checker.check_model(converted)
    g = converted.graph
    inputs = [vi for vi in g.input if vi.name not in big or vi.name in declared]
    del g.input[:]
    g.input.extend(inputs)
    fresh = {t.name: t for t in g.initializer}  # small ones, converted, plus any the converter added
    ordered = [big[t.name] if t.name in big else _unchanged_original(t, fresh.pop(t.name))
               for t in model.graph.initializer if t.name in big or t.name in fresh]
    ordered += fresh.values()
    del g.initializer[:]
    g.initializer.extend(ordered)
    return _single_default_import(converted, wanted)


def _unchanged_original(original: onnx.TensorProto, converted: onnx.TensorProto) -> onnx.TensorProto:
    """The original (maybe external) tensor when the converter left its inlined copy as it was."""
    if uses_external_data(original) and inline_copy(original) == converted:
        return original
    return converted


def _blocking_reason(model: onnx.ModelProto, wanted: int, exc: Exception) -> str:
    for node in model.graph.node:
        if node.domain in _DEFAULT_DOMAINS:
            try:
                onnx.defs.get_schema(node.op_type, wanted, "")
            except onnx.defs.SchemaError:
                where = f" (node '{node.name}')" if node.name else ""
                return f"op {node.op_type}{where} does not exist at opset {wanted}"
    text = str(exc)
    m = re.search(r"No Adapter (From|To) Version \$?(\d+) for (\w+)", text)
    if m:
        return f"onnx's version converter cannot convert op {m.group(3)} ({m.group(1).lower()} version {m.group(2)})"
    return ((text.strip().splitlines() or [type(exc).__name__])[0])[:300]
