"""The non-transformer corpus (tests/cnn_zoo.py): exports match torch, and k3opt's output (default pipeline
and --target cann) computes the same in onnxruntime with at most as many nodes as the best of onnxsim
and onnxslim left (measured with ``python -m bench.run --models 'cnn-*'``, see docs/benchmarks.md)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

import k3opt
from k3opt.report import Report
from tests.cnn_zoo import BASE_NAMES, cnn_inputs, cnn_model, cnn_params, cnn_torch_model
from tests.helpers import run_ort
from tests.zoo import EXPORTERS, needs_torch

pytestmark = needs_torch

#: (name, exporter) -> the fewest nodes (bodies included) onnxsim or onnxslim leaves (onnxsim 0.4, onnxslim 0.1).
PEER_BEST = {
    ("mobilenet", "torchscript"): 19, ("crnn", "torchscript"): 19, ("yolo", "torchscript"): 24,
    ("gru", "torchscript"): 11, ("audio", "torchscript"): 8, ("gru-if", "torchscript"): 11,
    ("audio-if", "torchscript"): 22,
    ("mobilenet", "dynamo"): 28, ("crnn", "dynamo"): 29, ("yolo", "dynamo"): 33, ("gru", "dynamo"): 14,
    ("audio", "dynamo"): 19, ("gru-if", "dynamo"): 19, ("audio-if", "dynamo"): 44,
}


def node_count(graph: onnx.GraphProto) -> int:
    """Nodes of ``graph`` and of every body in it."""
    return sum(1 + sum(node_count(a.g) for a in n.attribute if a.type == onnx.AttributeProto.GRAPH)
               for n in graph.node)


def _close(got, want) -> None:
    for a, b in zip(got, want):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", BASE_NAMES)
@pytest.mark.parametrize("exporter", [pytest.param(e, marks=[pytest.mark.slow] if e == "dynamo" else [])
                                      for e in EXPORTERS])
def test_export_matches_torch(name: str, exporter: str) -> None:
    import torch

    feeds = cnn_inputs(name, batch=3, seed=1)  # another batch size: the batch axis is dynamic
    with torch.no_grad():
        want = cnn_torch_model(name)(*(torch.from_numpy(v) for v in feeds.values())).numpy()
    got = run_ort(onnx.load(str(cnn_model(name, exporter))), feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name,exporter", cnn_params())
def test_optimized_equal_and_no_bigger_than_peers(name: str, exporter: str) -> None:
    path = cnn_model(name, exporter)
    original = onnx.load(str(path))
    report = Report()
    out = k3opt.optimize(str(path), report=report, verify=True)
    assert report.verification and report.verification["status"] == "passed", report.table()
    for seed, batch in ((0, 2), (1, 3)):
        feeds = cnn_inputs(name, batch=batch, seed=seed)
        _close(run_ort(out, feeds), run_ort(original, feeds))
        negated = {k: -v for k, v in feeds.items()}  # audio-if takes its other branch
        _close(run_ort(out, negated), run_ort(original, negated))
    assert node_count(out.graph) <= PEER_BEST[(name, exporter)]


@pytest.mark.parametrize("name,exporter", cnn_params())
def test_cann_target_equal(name: str, exporter: str) -> None:
    """Opset 17 for every model, the dynamo exports' opset-18 Pad (axes input) included."""
    path = cnn_model(name, exporter)
    out = k3opt.optimize(str(path), target="cann")
    assert [(o.domain or "", o.version) for o in out.opset_import] == [("", 17)]
    feeds = cnn_inputs(name)
    _close(run_ort(out, feeds), run_ort(onnx.load(str(path)), feeds))
