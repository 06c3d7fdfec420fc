"""Benchmark harness: k3opt against peer ONNX optimizers (run with ``python -m bench.run``)."""
