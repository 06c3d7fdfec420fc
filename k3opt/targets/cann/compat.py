"""Pre-flight check: what ATC will refuse in a model, found in a second instead of minutes into ATC.

Reports every node ATC has no parser for (by op type, domain and model
opset, from :mod:`.atc_ops`; NPU ops in the ``npu`` domain with an
``npu:1`` import are torch_npu's form and parse), opset imports the parser trips on, graph
inputs with dynamic dims that no ``--input-shape`` fixes, and graph inputs
whose dtype ATC rejects.
"""
from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Iterator, Optional, Sequence, Union

import onnx

from .atc_ops import ACCEPTED_INPUT_DTYPES, ATC_PARSERS, MAX_OPSET, MIN_OPSET, NO_PARSER, NPU_DOMAIN_OPS

if TYPE_CHECKING:  # a type only: the bridge builds on the target, never the reverse
    from ...cann_bridge.atc_command import InputShape

_DEFAULT_DOMAINS = ("", "ai.onnx")
#: torch_npu's exporter domain: ATC's NPU plugins register ``npu::1::<Op>`` (see :mod:`.atc_ops`).
_NPU_IMPORT = ("npu", 1)


@dataclasses.dataclass(frozen=True)
class Finding:
    """One thing ATC will refuse: ``kind`` is op, opset, dynamic or dtype."""

    kind: str
    message: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


def default_opset(model: onnx.ModelProto) -> Optional[int]:
    """The model's default-domain opset import, or None."""
    return next((o.version for o in model.opset_import if o.domain in _DEFAULT_DOMAINS), None)


def all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node of ``graph`` and of its subgraphs (If/Loop/Scan bodies), depth first."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                yield from all_nodes(sub)


def _npu_imported(model: onnx.ModelProto) -> bool:
    return any((o.domain, o.version) == _NPU_IMPORT for o in model.opset_import)


def _opset_findings(model: onnx.ModelProto) -> list[Finding]:
    """One default-domain import (plus ``npu:1``, the NPU ops' own registration, which the plugins parse)."""
    imports = [f"{o.domain or 'ai.onnx'}:{o.version}" for o in model.opset_import
               if (o.domain, o.version) != _NPU_IMPORT]
    found = []
    if len(imports) != 1 or len(model.opset_import) > 2:
        found.append(Finding("opset", f"{len(imports)} opset imports ({', '.join(imports)}); ATC's parser "
                                      "wants exactly one default-domain import (E16005)"))
    version = default_opset(model)
    if version is not None and not MIN_OPSET <= version <= MAX_OPSET:
        found.append(Finding("opset", f"default-domain opset {version} is outside ATC's {MIN_OPSET}..{MAX_OPSET}: "
                                      "use `k3opt optimize --target cann` (converts to 17)"))
    return found


def _op_findings(model: onnx.ModelProto) -> list[Finding]:
    version = default_opset(model)
    by_key: dict[tuple[str, str], list[str]] = {}
    npu = _npu_imported(model)
    for node in all_nodes(model.graph):
        domain = node.domain or "ai.onnx"
        if domain == _NPU_IMPORT[0] and npu and node.op_type in NPU_DOMAIN_OPS:
            continue  # registered as npu::1::<Op>
        known = ATC_PARSERS.get(node.op_type) if node.domain in _DEFAULT_DOMAINS else None
        if known is None or version not in known:
            by_key.setdefault((domain, node.op_type), []).append(node.name or "<unnamed>")
    found = []
    for (domain, op), names in sorted(by_key.items()):
        known = ATC_PARSERS.get(op) if domain == "ai.onnx" else None
        if domain == _NPU_IMPORT[0]:
            why = (f"ATC registers npu::1 only for {', '.join(sorted(NPU_DOMAIN_OPS))}" if npu
                   else "the model has no npu:1 opset import")
        elif domain != "ai.onnx":
            why = f"domain {domain} has no ATC parsers"
        elif known is None:
            why = NO_PARSER.get(op, "not in k3opt's table of ATC parsers")
        else:
            why = f"ATC parses it only at opsets {_ranges(sorted(known))}"
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        key = f"npu::1::{op}" if domain == _NPU_IMPORT[0] else f"{domain}::{version}::{op}"
        found.append(Finding("op", f"{key} x{len(names)} ({shown}): {why}"))
    return found


def _ranges(versions: Sequence[int]) -> str:
    spans, start = [], versions[0]
    for a, b in zip(versions, versions[1:] + [None]):
        if b != a + 1:
            spans.append(f"{start}" if start == a else f"{start}..{a}")
            start = b
    return ", ".join(spans)


def _input_findings(model: onnx.ModelProto, shapes: Sequence[InputShape], dynamic_option: Optional[str]) -> list[Finding]:
    inits = {i.name for i in model.graph.initializer}
    given = {s.name: s for s in shapes}
    found = []
    inputs = [vi for vi in model.graph.input if vi.name not in inits]
    for name in sorted(set(given) - {vi.name for vi in inputs}):
        found.append(Finding("dynamic", f"--input-shape names {name!r}, which is not a graph input"))
    for vi in inputs:
        tt = vi.type.tensor_type
        dtype = onnx.TensorProto.DataType.Name(tt.elem_type)
        if dtype not in ACCEPTED_INPUT_DTYPES:
            found.append(Finding("dtype", f"input {vi.name!r} has dtype {dtype}, which ATC does not accept"))
        dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim]
        spec = given.get(vi.name)
        if spec is not None and tt.HasField("shape") and len(spec.dims) != len(dims):
            found.append(Finding("dynamic", f"--input-shape {spec} has rank {len(spec.dims)}, input {vi.name!r} "
                                            f"has rank {len(dims)}"))
        elif spec is not None and spec.unknown_dims and not dynamic_option:
            found.append(Finding("dynamic", f"--input-shape {spec} has -1 dims but no --dynamic-dims, "
                                            "--dynamic-batch-size or --dynamic-image-size"))
        elif spec is None and (not tt.HasField("shape") or any(not isinstance(d, int) or d <= 0 for d in dims)):
            shown = "unknown rank" if not tt.HasField("shape") else "[" + ", ".join(map(str, dims)) + "]"
            found.append(Finding("dynamic", f"input {vi.name!r} {shown} has dynamic dims and no --input-shape "
                                            f"(e.g. --input-shape {vi.name}:" + ",".join(
                                                str(d) if isinstance(d, int) and d > 0 else "1" for d in dims) + ")"))
    return found


def check_model(model: onnx.ModelProto, input_shapes: Sequence[InputShape] = (),
                dynamic_option: Optional[str] = None) -> list[Finding]:
    """Everything ATC will refuse in ``model`` given these ``--input-shape``s; empty when clean."""
    return _opset_findings(model) + _op_findings(model) + _input_findings(model, input_shapes, dynamic_option)


def check_record(model: Union[str, os.PathLike], findings: Optional[list[Finding]] = None) -> dict:
    """The report's ``check`` entry: ``k3opt check --target cann`` of the model file (its findings when known)."""
    if findings is None:
        findings = check_model(onnx.load(str(model), load_external_data=False), [], None)
    return {"model": str(model), "findings": [str(f) for f in findings]}
