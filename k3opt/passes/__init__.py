"""Built-in rewrite passes, one folder per capability (``analysis``, ``cleanup``, ``fold``, ``fusion``), one
module per pass named after it; a target's own passes live in its package (``k3opt/targets/cann/passes``). Each
module registers its passes with :func:`k3opt.pipeline.pass_base.register_pass`; every module in these packages
whose name does not start with ``_`` is imported by :func:`load_builtin_passes`, so adding a pass is adding a
module. Helpers shared across capabilities live in ``_shared`` (never imported as passes); a pass never imports
another pass's module.
"""
from __future__ import annotations

import importlib
import pkgutil

from ..pipeline import registry
from ..pipeline.pass_base import Pass, PassContext, build_pipeline, get_pass, register_pass, registered_passes

__all__ = ["Pass", "PassContext", "build_pipeline", "get_pass", "register_pass", "registered_passes"]

#: The packages whose modules are the built-in passes (walked in this order).
_PASS_PACKAGES = ("k3opt.passes", "k3opt.targets.cann.passes")
# Process-wide, not run state: the built-in modules are imported once, into the process registry every run
# starts from a copy of (k3opt.pipeline.registry).
_LOADED = False


def load_builtin_passes() -> None:
    """Import every pass module once (idempotent), into the process registry (installed plugins join it when a
    run builds its registry: :func:`k3opt.plugins.run_plugins`)."""
    global _LOADED
    if not _LOADED:
        _LOADED = True
        with registry.using(registry.PROCESS):
            _import_pass_modules()


def _import_pass_modules() -> None:
    for package in _PASS_PACKAGES:
        root = importlib.import_module(package)
        depth = package.count(".") + 1
        for info in sorted(pkgutil.walk_packages(root.__path__, f"{package}."), key=lambda i: i.name):
            if not info.ispkg and not any(part.startswith("_") for part in info.name.split(".")[depth:]):
                importlib.import_module(info.name)
