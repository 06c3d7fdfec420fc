"""The table of NPU reference ops, filled by :func:`reference_op` as each module of this package is imported.

A new NPU op's numpy reference is a new module here (``moe_ops.py``...) with an ``OpRun`` subclass decorated
``@reference_op("NPUOpType")``: :func:`evaluator` imports every module of the package (names not starting with
``_``), so no central list is edited.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Callable, Sequence, TypeVar

from onnx.reference.op_run import OpRun

from ..target_form import NPU_DOMAIN, STAGING_DOMAIN

_Op = TypeVar("_Op", bound=type)

#: (op type, domain) -> OpRun class. Process-wide on purpose: filled only by class definitions at import, the
#: same in every run; a second definition of one op is refused, so no run can change another's table.
_OPS: dict[tuple[str, str], type] = {}


class ReferenceError(ValueError):
    """The node asks for something the documented contract does not define (or k3opt does not model)."""


def reference_op(op_type: str, domains: Sequence[str] = ("", NPU_DOMAIN, STAGING_DOMAIN)) -> Callable[[_Op], _Op]:
    """Class decorator: ``cls`` (an ``OpRun``) is the reference of ``op_type`` in each of ``domains`` (the
    default domain, ``npu``: torch_npu's exporter form, and the staging domain of a run's NPU nodes: a cann
    output read back in is verified as it stands; ``("",)`` for a standard op's replacement)."""

    def register(cls: _Op) -> _Op:
        if not issubclass(cls, OpRun):
            raise TypeError(f"reference op {op_type}: {cls.__name__} is not an onnx OpRun")
        for domain in domains:
            if (op_type, domain) in _OPS:
                raise ValueError(f"reference op {domain or 'ai.onnx'}::{op_type} is defined twice")
            _OPS[op_type, domain] = type(op_type, (cls,), {"op_domain": domain})
        return cls

    return register


def _load() -> None:
    """Import every op module of this package (idempotent: Python imports a module once)."""
    package = __name__.rpartition(".")[0]
    for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
        if not info.name.startswith("_") and info.name != "registry":
            importlib.import_module(f"{package}.{info.name}")


def reference_ops() -> list[type]:
    """Every registered reference op class (one per op type and domain), for ``ReferenceEvaluator(new_ops=...)``."""
    _load()
    return [_OPS[key] for key in sorted(_OPS)]


def evaluator(model: Any) -> Any:
    """An ``onnx.reference.ReferenceEvaluator`` for ``model`` (proto or bytes) that runs the NPU ops."""
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(model, new_ops=reference_ops())
