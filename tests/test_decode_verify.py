"""Decode steps with the KV cache verify by default: the sizes found keep total = past + new."""
from __future__ import annotations

import pytest

from k3opt.api import optimize_file
from tests.zoo import needs_torch, zoo_decode_model, zoo_decode_params

pytestmark = needs_torch


def _sizes_consistent(sizes: dict) -> bool:
    return sizes["total_sequence"] == sizes["past_sequence"] + sizes["sequence"]


@pytest.mark.parametrize("name,exporter", zoo_decode_params())
def test_decode_step_verifies_by_default(tmp_path, name: str, exporter: str) -> None:
    report = optimize_file(zoo_decode_model(name, exporter), tmp_path / "out.onnx", verify=True)
    assert report.verification["status"] == "passed" and report.verification["outputs"]
    assert _sizes_consistent(report.verification["sizes"])
    assert not report.warnings
    assert any(n.startswith("verification inputs sized batch=") for n in report.notes)


@pytest.mark.parametrize("shape,pinned", [
    ({"input_ids": [1, 1]}, {"batch": 1, "sequence": 1}),
    ({"past_key_values.0.key": [3, 2, 5, 8]}, {"batch": 3, "past_sequence": 5}),
])
def test_one_input_shape_pins_the_decode_sizes(tmp_path, shape: dict, pinned: dict) -> None:
    report = optimize_file(zoo_decode_model("llama"), tmp_path / "out.onnx", verify=True, input_shapes=shape)
    sizes = report.verification["sizes"]
    assert report.verification["status"] == "passed" and _sizes_consistent(sizes)
    assert {k: sizes[k] for k in pinned} == pinned
