"""Built-in rewrite passes, one folder per capability (``cleanup``, ``fold``, ``fusion``), one module per pass
named after it; a target's own passes live in its package (``k3opt/targets/cann/passes``). A pass module
defines its pass class and nothing registers it: :func:`builtin_passes` finds every pass class the modules of
this package hold (modules starting with ``_`` are helpers), so adding a pass is adding a module. Helpers
shared across capabilities live in ``_shared``; a pass never imports another pass's module.
"""
from __future__ import annotations

from ..pipeline.pass_base import Pass, PassContext, discover_passes, register_pass

__all__ = ["Pass", "PassContext", "builtin_passes", "register_pass", "reruns_after_lowering"]


def builtin_passes() -> list[type[Pass]]:
    """The pass classes of k3opt's capability folders (the targets add their own: ``k3opt.targets``)."""
    return discover_passes(__name__)


def reruns_after_lowering() -> list[type[Pass]]:
    """The built-in passes that run again after a target's lowering: the clean-ups and fold-constants (what the
    lowering of many layers repeats or leaves foldable is done there, so a second run finds nothing to do)."""
    from .fold.fold_constants import FoldConstants

    return discover_passes(f"{__name__}.cleanup") + [FoldConstants]
