"""The cann target's output form: where the NPU nodes live, at which opset, and the invariants ATC needs.

The lowering passes (``lower-rmsnorm-npu``, ``lower-attention-npu``,
``lower-rotary-npu``) build NPU nodes either in the ``npu`` domain (torch_npu's exporter form, opset import
``npu:1``) or in a private staging domain (:data:`STAGING_DOMAIN`: the
pattern rewriter checks default-domain nodes against ONNX's schemas, which do
not know NPU ops). :func:`finish_model` runs on the exported model: staged
nodes move to the default domain, where ATC's parser looks them up as
``ai.onnx::<model opset>::<Op>``. ATC registers the flash attentions only at
opsets 11..16 and 19 (see :mod:`.atc_ops`), so a model with a staged flash
attention is relabelled from opset 17 to 16, which the lowering chooses only
when no op of the model differs between the two (:func:`ops_changed_between`).
Then :func:`invariant_violations` must find nothing.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Iterable

import onnx

from ... import modelio
from ...errors import CompileError, InputError, InvalidOutputError
from .atc_ops import ATC_PARSERS, NPU_DOMAIN_OPS, NPU_OPS
from .compat import all_nodes

CANN_OPSET = 17
#: The default-domain opset of the flash-attention form (the newest below 17 that ATC registers them at).
FLASH_OPSET = 16
#: NPU nodes meant for the default domain are built here, then moved by :func:`finish_model`.
STAGING_DOMAIN = "k3opt.npu"
#: torch_npu's exporter domain; ATC's plugins register ``npu::1::<Op>``.
NPU_DOMAIN, NPU_DOMAIN_VERSION = "npu", 1
_DEFAULT = ("", "ai.onnx")


def ops_changed_between(ops: Iterable[str], old: int, new: int) -> list[str]:
    """The standard ops among ``ops`` whose definition at opset ``new`` is not the one at ``old`` (or absent)."""
    changed = []
    for op in sorted(set(ops)):
        if op in NPU_OPS or not onnx.defs.has(op, old, ""):
            continue
        if not onnx.defs.has(op, new, "") or \
                onnx.defs.get_schema(op, new, "").since_version != onnx.defs.get_schema(op, old, "").since_version:
            changed.append(op)
    return changed


def finish_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """Move staged NPU nodes to the default domain (and the model to opset 16 when the flash attentions need
    it), in place; raises CompileError when the result breaks the target's invariants."""
    staged = [n for n in all_nodes(model.graph) if n.domain == STAGING_DOMAIN]
    for node in staged:
        node.ClearField("domain")  # as gs writes a default-domain node: no field at all
    imports = [o for o in model.opset_import if o.domain != STAGING_DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(imports)
    default = next((o for o in model.opset_import if o.domain in _DEFAULT), None)
    if default is not None and any(default.version not in ATC_PARSERS.get(n.op_type, ()) for n in staged):
        changed = ops_changed_between({n.op_type for n in all_nodes(model.graph) if n.domain in _DEFAULT},
                                      default.version, FLASH_OPSET)
        if changed:
            raise CompileError(f"the flash-attention form needs opset {FLASH_OPSET}, but {', '.join(changed)} "
                               f"differ(s) from opset {default.version}: use the npu-domain form")
        default.version = FLASH_OPSET
    violations = invariant_violations(model)
    if violations:
        raise CompileError("the model breaks the cann target's invariants: " + "; ".join(violations[:5]))
    return model


def stage_npu_nodes(model: onnx.ModelProto) -> list[str]:
    """Move the default-domain NPU nodes of a cann-target output read back in to :data:`STAGING_DOMAIN`, in
    place, so opset conversion and schema checks pass them by and :func:`finish_model` puts them back;
    returns their op types (empty: none, nothing changed)."""
    staged = [n for n in all_nodes(model.graph) if n.domain in _DEFAULT and n.op_type in NPU_OPS]
    for node in staged:
        node.domain = STAGING_DOMAIN
    if staged and not any(o.domain == STAGING_DOMAIN for o in model.opset_import):
        model.opset_import.add(domain=STAGING_DOMAIN, version=1)
    return sorted({n.op_type for n in staged})


def invariant_violations(model: onnx.ModelProto) -> list[str]:
    """What breaks the cann target's contract: one default-domain import (17, or 16 for the flash-attention
    form) and at most ``npu:1``; standard ops of that opset, NPU ops ATC registers there, and NPU ops in
    the ``npu`` domain; no model-local functions."""
    found = []
    imports = [(o.domain or "ai.onnx", o.version) for o in model.opset_import]
    defaults = [v for d, v in imports if d == "ai.onnx"]
    others = [(d, v) for d, v in imports if d != "ai.onnx"]
    if len(defaults) != 1 or defaults[0] not in (CANN_OPSET, FLASH_OPSET) or \
            others not in ([], [(NPU_DOMAIN, NPU_DOMAIN_VERSION)]):
        found.append(f"opset imports {imports}, expected exactly one default-domain import ({CANN_OPSET}, or "
                     f"{FLASH_OPSET} in the flash-attention form) and at most ('{NPU_DOMAIN}', {NPU_DOMAIN_VERSION})")
    opset = defaults[0] if defaults else CANN_OPSET
    npu_imported = (NPU_DOMAIN, NPU_DOMAIN_VERSION) in imports
    if model.functions:
        found.append(f"{len(model.functions)} model-local function(s): ATC does not parse functions")
    for node in all_nodes(model.graph):
        if node.domain == NPU_DOMAIN:
            if node.op_type not in NPU_DOMAIN_OPS or not npu_imported:
                found.append(f"node '{node.name}' (npu::{node.op_type}) is not an op ATC registers as npu::1")
        elif node.domain not in _DEFAULT:
            found.append(f"node '{node.name}' ({node.domain}::{node.op_type}) is not in the default domain "
                         f"or '{NPU_DOMAIN}'")
        elif node.op_type in NPU_OPS:
            if opset not in ATC_PARSERS[node.op_type]:
                found.append(f"node '{node.name}' ({node.op_type}) is an NPU op ATC does not register at opset {opset}")
        elif not onnx.defs.has(node.op_type, opset, ""):
            found.append(f"node '{node.name}' ({node.op_type}) is neither a standard opset-{opset} op "
                         "nor an NPU op ATC registers")
    return found


def check_written(path: Path) -> None:
    """The written cann-target model file reads back (external data beside it, of the sizes it claims), passes
    onnx's checker with its NPU ops set aside, and keeps :func:`invariant_violations` empty; raises
    InvalidOutputError otherwise. onnxruntime cannot load NPU ops, so these checks stand in for it."""
    try:
        modelio.load(path)  # the structure k3opt reads, and every external-data range within its file
    except InputError as exc:
        raise InvalidOutputError(f"the optimized model does not read back ({exc}); nothing was written") from None
    model = onnx.load(str(path), load_external_data=False)  # locations as written: the checker wants them relative
    problems = invariant_violations(model)
    for node in all_nodes(model.graph):  # NPU ops are no schema's: the checker judges the rest
        if node.domain in _DEFAULT and node.op_type in NPU_OPS:
            node.domain = STAGING_DOMAIN
    model.opset_import.add(domain=STAGING_DOMAIN, version=1)
    # checked as a file beside ``path``: a proto's external data would be looked up from the current folder
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".k3opt-check-", suffix=".onnx") as f:
        f.write(model.SerializeToString())
        f.flush()
        try:
            onnx.checker.check_model(f.name)
        except onnx.checker.ValidationError as exc:
            problems.append(f"onnx's checker: {str(exc).strip().splitlines()[0][:300]}")
    if problems:
        raise InvalidOutputError("the optimized model fails the cann target's checks (" + "; ".join(problems[:5])
                                 + "); nothing was written")
