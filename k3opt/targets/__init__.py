"""Targets: what a run lowers to and checks its written file against, one package or module per target.

``targets/cann/`` is the Ascend NPU target (ATC's ONNX parser): its op contract (``npu_contract``), the form
its files take (``target_form``), ATC's parser table and pre-flight check (``atc_ops``, ``compat``), its
lowering passes (``passes/``) and the numpy reference ops that verify them (``reference/``).
"""
