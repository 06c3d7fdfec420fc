"""Weight-only quantization (W8A16 / W4A16): ``k3opt quantize`` and :func:`quantize_file`.

Every MatMul/Gemm whose weight is a constant 2-D float tensor gets int8 per-channel or int4 per-group
weights (round-to-nearest with a per-group clipping search, :mod:`.rtn`; with calibration inputs, GPTQ's
error feedback, :mod:`.gptq`, :mod:`.calibrate`), read back through ONNX's
``DequantizeLinear`` (:mod:`.rewrite`): a model every runtime runs, and that onnxruntime's graph
optimizations (ORT_ENABLE_EXTENDED and above, the default ORT_ENABLE_ALL included) turn into its n-bit
MatMul kernel. ``target="cann"`` then runs the cann pipeline on it, which lowers each DequantizeLinear +
MatMul to Ascend's ``NPUWeightQuantBatchMatmulV2``. The embedding tables and the lm_head stay float
unless asked. See docs/quantize.md.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from .. import modelio
from ..errors import InputError, UsageError
from ..modelio.opset import convert, model_opset
from ..targets import Target, get_target
import numpy as np

from . import calibrate, rtn
from .rewrite import quantize_site, stored_bytes
from .select import select


#: Bits per weight type.
WEIGHTS = {"int4": 4, "int8": 8}
#: GPTQ wants at least this many calibration rows (tokens) per input channel, else the report warns: with
#: fewer it fits the samples (the zoo Llama, width 32-64: 128 tokens made the logits worse than RTN, 512 better).
FEW_ROWS = 8
#: Opset DequantizeLinear needs: per-axis since 13, blocked (and int4) since 21.
PER_AXIS_OPSET, BLOCKED_OPSET = 13, 21


@dataclass
class QuantReport:
    """What one quantization did: per weight its relative error, the weights kept float and why, sizes,
    and the accuracy measured against the float model."""

    weights: str
    group_size: int
    symmetric: bool
    target: str
    layers: dict[str, float] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    size_before: int = 0
    size_after: int = 0
    accuracy: dict[str, Any] = field(default_factory=dict)
    #: calibrated runs: weight -> (GPTQ's, RTN's) relative layer-output error on the calibration inputs
    calibrated: dict[str, tuple[float, float]] = field(default_factory=dict)
    output: str = ""

    def lines(self) -> list[str]:
        from .accuracy import lines as accuracy_lines

        scheme = f"{self.weights} " + (f"per-group (g={self.group_size})" if self.group_size else "per-channel")
        out = [f"quantized {len(self.layers)} weight(s) to {scheme}, "
               f"{'symmetric' if self.symmetric else 'asymmetric'}, target {self.target}"]
        if self.layers:
            worst = max(self.layers, key=self.layers.get)
            out.append(f"worst relative weight error: {self.layers[worst]:.4f} ({worst})")
        if self.calibrated:
            mine, plain = (np.array(v) for v in zip(*self.calibrated.values()))
            rtn_kept = int(np.sum(mine >= plain))
            out.append(f"GPTQ: layer-output error on the calibration data, mean {np.mean(np.minimum(mine, plain)):.4f} "
                       f"(round-to-nearest: {np.mean(plain):.4f}), worst {np.max(np.minimum(mine, plain)):.4f} "
                       f"({np.max(plain):.4f})" + (f"; round-to-nearest kept for {rtn_kept} weight(s) where it was "
                                                   "better" if rtn_kept else ""))
        out += [f"kept float: {name}: {why}" for name, why in self.kept.items()]
        out += self.notes
        if self.size_before and self.size_after:
            out.append(f"size: {self.size_before / 2**20:.2f} MiB -> {self.size_after / 2**20:.2f} MiB "
                       f"({self.size_after / self.size_before:.3f}x)")
        if self.accuracy:
            out += accuracy_lines(self.accuracy)
        return out


def scheme_for(weights: str, group_size: Optional[int], symmetric: bool, clip: bool = True,
               target: str = "onnx") -> rtn.Scheme:
    """The :class:`rtn.Scheme` of the options, or UsageError: int4 defaults to groups of 128, int8 to
    per-channel (group 0); a group is a power of two from 16 (onnxruntime's n-bit kernel) that the target's
    kernel takes (cann: multiples of 32)."""
    if weights not in WEIGHTS:
        raise UsageError(f"--weights {weights!r}: choose int4 or int8")
    found = get_target(target)
    bits = WEIGHTS[weights]
    group = (128 if bits == 4 else 0) if group_size is None else group_size
    if bits == 4 and group == 0:
        raise UsageError("--weights int4 needs a group size (32, 64 or 128)")
    if group and (group < 16 or group & (group - 1)):
        raise UsageError(f"--group-size {group}: a power of two from 16 (32, 64, 128...), or 0 for per-channel")
    why = found.quant_group_refusal(group) if group else None
    if why:
        raise UsageError(f"--group-size {group}: {why}")
    return rtn.Scheme(bits, group, symmetric, clip)


def quantize_model(model, scheme: rtn.Scheme, *, opset: Optional[int] = None, lm_head: bool = False,
                   embedding: bool = False, report: Optional[QuantReport] = None, target: "str | Target" = "onnx",
                   calibration: Optional[calibrate.Calibration] = None):
    """Quantize ``model`` (a ModelProto read by :func:`k3opt.modelio.read_model`: external locations
    absolute) in place and return it; quantized weights live in the process's spill file until saved.
    ``calibration`` (an .npz path or a dict of arrays named like the graph inputs, samples along the first
    axis): GPTQ for the MatMul weights, from their inputs on those samples.
    Raises UsageError/InputError, before changing anything, for what cannot be done."""
    found = get_target(target)
    report = report or QuantReport(f"int{scheme.bits}", scheme.group, scheme.symmetric, found.name)
    needed = BLOCKED_OPSET if (scheme.group or scheme.bits == 4) else PER_AXIS_OPSET
    if opset is not None and opset < needed:
        raise UsageError(f"int{scheme.bits}{' per-group' if scheme.group else ''} needs DequantizeLinear of "
                         f"opset {needed}; --opset {opset} is below it")
    modelio.lift_constant_nodes(model)
    current = model_opset(model)
    wanted = max(current, needed, opset or 0)
    if wanted != current:  # a converted model is a new proto: select its nodes after this
        model, notes = convert(model, wanted)
        report.notes += notes
    chosen = select(model, lm_head=lm_head, embedding=embedding)
    report.kept.update(chosen.kept)
    if not chosen.sites:
        why = "; ".join(f"{k}: {v}" for k, v in list(chosen.kept.items())[:3])
        raise InputError("nothing to quantize: no MatMul/Gemm with a constant 2-D float weight"
                         + (f" ({why})" if why else ""))
    for site in chosen.sites:
        t = next(x for x in model.graph.initializer if x.name == site.name)
        k, n = (t.dims[1], t.dims[0]) if site.kind == "embedding" or site.transposed else (t.dims[0], t.dims[1])
        if scheme.group and k % scheme.group:
            raise UsageError(f"--group-size {scheme.group} does not divide the input dim {k} of weight "
                             f"'{site.name}'")
        why = found.quant_weight_refusal(k, n, scheme.bits) if site.kind != "embedding" else None
        if why:
            raise UsageError(f"--target {found.name}: weight '{site.name}' ({k} x {n}) {why}")
    feeds = None if calibration is None else calibrate.load(calibration, model)
    if feeds is not None:
        label = f"--calibration-data {calibration if isinstance(calibration, (str, os.PathLike)) else '(arrays)'}"
        for part in calibrate.passes(model, [s for s in chosen.sites if s.kind != "embedding"]):
            for site, hessian, rows in calibrate.hessians(model, part, feeds, label):
                q = quantize_site(model, site, scheme, hessian)
                report.layers[site.name], report.calibrated[site.name] = q.rel_error, q.output_errors
                few = f"few calibration tokens for GPTQ: {rows} rows of input to '{site.name}'"
                if rows < FEW_ROWS * len(hessian) and not any(n.startswith("few calibration") for n in report.notes):
                    report.notes.append(f"{few}, under {FEW_ROWS}x its width {len(hessian)}: it may fit the "
                                        "samples rather than the model's use; give more")
    for site in chosen.sites:
        if site.name not in report.layers:
            report.layers[site.name] = quantize_site(model, site, scheme).rel_error
    if model_opset(model) >= BLOCKED_OPSET or scheme.bits == 4:
        model.ir_version = max(model.ir_version, 10)  # INT4 and opset 21 need IR 10
    return model


def quantize_file(src: Union[str, os.PathLike], dst: Union[str, os.PathLike], *, weights: str = "int4",
                  group_size: Optional[int] = None, symmetric: bool = False, target: str = "onnx",
                  opset: Optional[int] = None, lm_head: bool = False, embedding: bool = False, clip: bool = True,
                  measure: bool = True, tokens: int = 16, overwrite: bool = False,
                  external_data: Optional[bool] = None,
                  calibration: Optional[calibrate.Calibration] = None) -> QuantReport:
    """Quantize the model file ``src`` into ``dst``; returns the :class:`QuantReport`.

    A target that lowers (``target="cann"``): the quantized model then goes through ``k3opt optimize --target``
    (cann: lowered to NPUWeightQuantBatchMatmulV2 and verified under the reference ops). ``measure``: run both models in
    onnxruntime for the logits error and the greedy-token agreement over ``tokens`` generated tokens.
    ``calibration``: see :func:`quantize_model` (GPTQ). Nothing is written on error.
    """
    scheme = scheme_for(weights, group_size, symmetric, clip, target)
    found = get_target(target)
    if embedding and found.quantized_gather_refusal:
        raise UsageError(f"--quantize-embedding with --target {found.name}: {found.quantized_gather_refusal}")
    if found.fixed_opset is not None and opset is not None:
        raise UsageError(f"--opset does not apply to --target {found.name} (its opset is fixed)")
    out = modelio.check_output_path(dst, src, overwrite)
    report = QuantReport(weights, scheme.group, symmetric, found.name)
    loaded = modelio.read_model(src)
    report.size_before = stored_bytes(Path(src))
    model = quantize_model(loaded.model, scheme, opset=opset, lm_head=lm_head, embedding=embedding, report=report,
                           target=found, calibration=calibration)

    def check(path: Path) -> None:
        if measure:
            from .accuracy import measure as measure_accuracy

            report.accuracy = measure_accuracy(Path(src), path, tokens=tokens)

    if external_data is None:  # the quantized weights sit in the spill file: inline them unless the input was not
        external_data = bool(loaded.external) or modelio.proto_size(model) > modelio.PROTO_LIMIT
    if not found.lowers:
        modelio.save(model, out, external_data=external_data, check=check)
    else:
        folder = Path(tempfile.mkdtemp(prefix=".k3opt-quant-", dir=out.parent))
        try:
            qdq, npu = folder / "quantized.onnx", folder / "npu.onnx"
            modelio.save(model, qdq, external_data=external_data, check=check)
            from ..api import optimize_file

            if model_opset(model) < BLOCKED_OPSET:  # per-channel int8: the target's run lowers and verifies it
                done = optimize_file(qdq, out, target=found.name, verify=True, overwrite=overwrite,
                                     external_data=external_data)
                report.notes += [line for line in done.lowering if "WeightQuant" in line]
                return _finish(report, out)
            lowered, lines = found.lower_quantized(modelio.read_model(qdq).model)
            report.notes += lines
            modelio.save(lowered, npu, external_data=external_data)
            optimize_file(npu, out, target=found.name, verify=False, overwrite=overwrite,
                          external_data=external_data)
            try:
                line = found.verify_quantized(qdq, out)
            except BaseException:
                for path in (out, modelio.data_path(out)):
                    path.unlink(missing_ok=True)
                raise
            if line:
                report.notes.append(line)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    return _finish(report, out)


def _finish(report: QuantReport, out: Path) -> QuantReport:
    report.size_after = stored_bytes(out)
    report.output = str(out)
    return report


__all__ = ["QuantReport", "quantize_file", "quantize_model", "scheme_for"]
