"""fold-constants and the clean-ups on real transformer exports (tests/zoo.py): exact, complete, idempotent.

With static input shapes (``--input-shape``) every shape subgraph folds away
(no ``Shape``/``Size`` left); no ``Identity`` or dead node is left; outputs
equal the original's; a second run rewrites nothing. bert/TorchScript runs
by default, the other models and exporters are slow-marked.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest

import k3opt
from k3opt.report import Report
from tests.helpers import op_counts, run_ort
from tests.test_conformance import FOLD_PASSES
from tests.zoo import EXPORTERS, NAMES, needs_torch, zoo_inputs, zoo_model

PARAMS = [
    pytest.param(name, exporter, marks=() if (name, exporter) == ("bert", "torchscript") else pytest.mark.slow)
    for name in NAMES for exporter in EXPORTERS
]


def _optimize(model: onnx.ModelProto, shapes: dict) -> tuple[onnx.ModelProto, dict[str, int]]:
    report = Report()
    out = k3opt.optimize(model, passes=FOLD_PASSES, input_shapes=shapes, report=report)
    return out, {p["name"]: p["rewrites"] for p in report.passes}


@needs_torch
@pytest.mark.parametrize("name,exporter", PARAMS)
def test_static_shapes_fold_every_shape_computation(name: str, exporter: str) -> None:
    model = onnx.load(zoo_model(name, exporter))
    feeds = zoo_inputs(name)
    shapes = {k: list(v.shape) for k, v in feeds.items()}
    out, rewrites = _optimize(model, shapes)
    counts = op_counts(out)
    assert not {"Shape", "Size", "Identity"} & set(counts), counts
    assert sum(counts.values()) < sum(op_counts(model).values()) / 2
    for want, got in zip(run_ort(model, feeds), run_ort(out, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    again, rewrites = _optimize(out, shapes)
    assert not any(rewrites.values()), rewrites
    assert op_counts(again) == counts


@needs_torch
@pytest.mark.slow
@pytest.mark.parametrize("exporter", EXPORTERS)
def test_dynamic_shapes_keep_the_model_exact(exporter: str) -> None:
    """Without --input-shape only the static dims fold; outputs stay equal for other batch/sequence sizes."""
    model = onnx.load(zoo_model("llama", exporter))
    out, _ = _optimize(model, {})
    assert "Identity" not in op_counts(out)
    assert sum(op_counts(out).values()) < sum(op_counts(model).values())
    feeds = zoo_inputs("llama", batch=3, seq=5)
    for want, got in zip(run_ort(model, feeds), run_ort(out, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
