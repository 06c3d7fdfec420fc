"""The decode-step zoo models (KV cache in and out): names, dynamic axes, and outputs equal to torch."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from tests.helpers import run_ort
from tests.zoo import (decode_input_names, decode_output_names, decode_torch_outputs, needs_torch,
                       zoo_decode_inputs, zoo_decode_model, zoo_decode_params)

pytestmark = needs_torch


def _dims(vi: onnx.ValueInfoProto) -> list:
    return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]


@pytest.mark.parametrize("name,exporter", zoo_decode_params())
def test_decode_export_matches_torch(name: str, exporter: str) -> None:
    """One token after a cache of 6, and a 3-token prefill after 4 (batch 3): ONNX equals torch."""
    model = onnx.load(zoo_decode_model(name, exporter))
    assert [i.name for i in model.graph.input] == decode_input_names(name)
    assert [o.name for o in model.graph.output] == decode_output_names(name)
    dims = {i.name: _dims(i) for i in model.graph.input}
    assert dims["input_ids"] == ["batch", "sequence"] and dims["attention_mask"] == ["batch", "total_sequence"]
    assert _dims(model.graph.input[2])[::2] == ["batch", "past_sequence"]
    for feeds in (zoo_decode_inputs(name), zoo_decode_inputs(name, past=4, new=3, batch=3, seed=1)):
        got, want = run_ort(model, feeds), decode_torch_outputs(name, feeds)
        assert len(got) == len(want) == len(model.graph.output)
        past = feeds["past_key_values.0.key"].shape[2]
        assert got[1].shape[2] == past + feeds["input_ids"].shape[1]
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_decode_inputs_are_consistent_and_left_padded() -> None:
    feeds = zoo_decode_inputs("llama", past=5, new=2)
    assert feeds["input_ids"].shape == (2, 2) and feeds["attention_mask"].shape == (2, 7)
    assert feeds["past_key_values.1.value"].shape == (2, 2, 5, 8)
    assert feeds["attention_mask"][1].tolist() == [0, 0, 0, 1, 1, 1, 1] and feeds["attention_mask"][0].all()
    assert np.array_equal(zoo_decode_inputs("llama")["past_key_values.0.key"],
                          zoo_decode_inputs("llama")["past_key_values.0.key"])
    with pytest.raises(KeyError, match="no decode zoo model 'bert'"):
        zoo_decode_inputs("bert")
