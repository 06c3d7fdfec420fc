"""Targets: what a run lowers to and checks its written file against, one module or package per target.

Each holds ``TARGET``, an instance of a :class:`~k3opt.targets.base.Target` subclass: its opset policy, the traits
the passes read, its lowering passes (``<target>/passes/``), reference ops and the checks its files pass.
``targets/onnx.py`` is standard ONNX; ``targets/cann/`` the Ascend NPU target (ATC's ONNX parser): its op
contract (``npu_contract``), the form of its files (``target_form``), ATC's parser table and pre-flight check
(``atc_ops``, ``compat``), lowering passes (``passes/``) and numpy reference ops (``reference/``).
A new target is a new module or folder here: :func:`names` finds it.
"""
from __future__ import annotations

from .base import Target, all_targets, get_target, names

__all__ = ["Target", "all_targets", "builtin_passes", "get_target", "names"]


def builtin_passes() -> list[type]:
    """Every built-in pass class: k3opt's capability folders (:func:`k3opt.passes.builtin_passes`), then each
    target's own (:meth:`Target.own_passes`)."""
    from ..passes import builtin_passes as capability_passes

    return capability_passes() + [cls for t in all_targets() for cls in t.own_passes()]
