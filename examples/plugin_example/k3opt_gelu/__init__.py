"""Example k3opt plugin: fuses decomposed GELU into ONNX ``Gelu`` (opset 20). See docs/writing-rules.md."""
