"""The Ascend NPU target (``--target cann``): contract, form, checks, lowering passes and reference ops.

- :mod:`.npu_contract`: the documented limits of the NPU ops the lowerings emit (sources cited there).
- :mod:`.target_form`: the opset and domains of a cann file, its invariants, and the checks a written file passes.
- :mod:`.atc_ops`, :mod:`.compat`: what ATC's ONNX parser accepts, and the pre-flight check against it.
- :mod:`.passes`: the lowering passes (``lower-*-npu``, ``conv1d-to-conv2d``).
- :mod:`.reference`: numpy implementations of every NPU op k3opt emits, for onnx's reference evaluator.
"""
