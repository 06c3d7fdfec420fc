"""Targets: what a run lowers to and checks its written file against, one module or package per target.

Each holds ``TARGET``, an instance of a :class:`~k3opt.targets.base.Target` subclass: its opset policy, the traits
the passes read, its lowering passes (``<target>/passes/``), reference ops and the checks its files pass.
``targets/onnx.py`` is standard ONNX; ``targets/cann/`` the Ascend NPU target (ATC's ONNX parser): its op
contract (``npu_contract``), the form of its files (``target_form``), ATC's parser table and pre-flight check
(``atc_ops``, ``compat``), lowering passes (``passes/``) and numpy reference ops (``reference/``).
A new target is a new module or folder here: :func:`names` finds it.
"""
from __future__ import annotations

import functools
import importlib
import pkgutil

from ..errors import UsageError
from .base import Target

__all__ = ["Target", "all_targets", "builtin_passes", "get_target", "names"]


@functools.lru_cache(maxsize=None)  # the modules of this package: fixed for the process
def all_targets() -> tuple[Target, ...]:
    """Every target, the default first, then by name."""
    found = [importlib.import_module(f"{__name__}.{info.name}").TARGET for info in pkgutil.iter_modules(__path__)
             if not info.name.startswith("_") and info.name != "base"]
    return tuple(sorted(found, key=lambda t: (not t.default, t.name)))


def names() -> tuple[str, ...]:
    """The targets' names, the default first (``--target``'s choices)."""
    return tuple(t.name for t in all_targets())


def get_target(target: "str | Target") -> Target:
    """The target named ``target`` (a Target is returned as it is); UsageError for an unknown name."""
    if isinstance(target, Target):
        return target
    for t in all_targets():
        if t.name == target:
            return t
    raise UsageError(f"unknown target '{target}'; choose one of {', '.join(names())}")


def builtin_passes() -> list[type]:
    """Every built-in pass class: k3opt's capability folders (:func:`k3opt.passes.builtin_passes`), then each
    target's own (:meth:`Target.own_passes`)."""
    from ..passes import builtin_passes as capability_passes

    return capability_passes() + [cls for t in all_targets() for cls in t.own_passes()]
