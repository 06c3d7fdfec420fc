"""Pass registries: the process's and each run's, and how built-in passes are found.

The built-in passes are found, not registered: :func:`k3opt.pipeline.pass_base.discover_passes` walks a
package's modules for the pass classes they hold (the api layer walks ``k3opt.passes`` and each target's
``passes/``; ``pipeline`` never imports the passes). The process registry (:data:`PROCESS`) holds them, the installed plugins and the passes registered in
code; each run gets a copy of it with its own plugins added (``k3opt.plugins.run_plugins``), made current for
the run with :func:`using`: nothing of the process registry changes. :func:`k3opt.pipeline.pass_base.register_pass`
registers into the current registry.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence

from ..errors import UsageError


class PassRegistry:
    """Pass classes by name, and what the run needs of them: the ordered list, a pipeline, option checks."""

    def __init__(self, passes: Optional[Mapping[str, type]] = None, *,
                 plugins: Optional[Mapping[str, object]] = None, awaits_builtins: bool = False):
        self._passes: dict[str, type] = dict(passes or {})
        #: The plugins loaded into this registry, by key (``k3opt.plugins``: a plugin loads once per registry),
        #: each with what identifies it (an object plugin is kept: its key is its id).
        self.plugins: dict[str, object] = dict(plugins or {})
        # Registrations made before the built-ins are in (the process registry only, until its first use): they
        # are checked and placed, in order, when :meth:`add_builtins` brings the passes they may name.
        self._waiting: Optional[list[tuple[type, dict[str, Any]]]] = [] if awaits_builtins else None

    def copy(self) -> "PassRegistry":
        """A registry with the same entries and plugins (a class is complete when registered: entries are all
        its state)."""
        self._check_complete()
        return PassRegistry(self._passes, plugins=self.plugins)

    def entries(self) -> dict[str, type]:
        """The entries by name, as registered (a copy; with the registrations waiting for the built-ins)."""
        entries = dict(self._passes)
        entries.update((cls.name, cls) for cls, _ in self._waiting or ())
        return entries

    def replace_entries(self, other: "PassRegistry") -> None:
        """Take ``other``'s entries and plugins (a plugin loaded into a trial copy, accepted whole)."""
        self._passes, self.plugins = dict(other._passes), dict(other.plugins)

    @property
    def has_builtins(self) -> bool:
        """Whether the built-in passes are in (always, but for the process registry before its first use)."""
        return self._waiting is None

    def add_builtins(self, classes: Iterable[type]) -> None:
        """Add the built-in passes, then register, in order, what was registered before them."""
        waiting, self._waiting = self._waiting or [], None
        for cls in classes:
            if cls.name in self._passes:
                raise RuntimeError(f"two built-in passes are named '{cls.name}'")
            self._passes[cls.name] = cls
        for cls, how in waiting:
            self.register(cls, **how)

    def register(self, cls: type, *, before: Optional[str] = None, after: Optional[str] = None,
                 plugin: Optional[str] = None, replace: bool = False) -> type:
        """Add a pass class; ``before``/``after`` name a registered pass and set the new pass's ``order`` just
        before/after it; ``plugin`` marks who registered it. Re-registering a name is an error unless ``replace``."""
        if not cls.name:
            raise UsageError(f"pass class {cls.__name__} has no name")
        if self._waiting is not None:
            self._waiting.append((cls, dict(before=before, after=after, plugin=plugin, replace=replace)))
            return cls
        known = self._passes
        if cls.name in known and known[cls.name] is not cls and not replace:
            raise UsageError(f"a pass named '{cls.name}' is already registered")
        anchor = before or after
        if anchor is not None:
            if anchor not in known:
                raise UsageError(f"pass '{cls.name}' asks to run next to unknown pass '{anchor}'")
            base = known[anchor].order
            siblings = [p.order for p in known.values() if p is not cls]
            if before:
                lower = max([o for o in siblings if o < base], default=base - 1)
                cls.order = (lower + base) / 2
            else:
                upper = min([o for o in siblings if o > base], default=base + 1)
                cls.order = (base + upper) / 2
        if plugin is not None:
            cls.plugin = plugin
        known[cls.name] = cls
        return cls

    def unregister(self, name: str) -> None:
        self._passes.pop(name, None)
        if self._waiting:
            self._waiting = [(cls, how) for cls, how in self._waiting if cls.name != name]

    def ordered(self) -> dict[str, type]:
        """Every pass by name, in pipeline order."""
        self._check_complete()
        return dict(sorted(self._passes.items(), key=lambda kv: (kv[1].order, kv[0])))

    def get(self, name: str) -> type:
        passes = self.ordered()
        if name not in passes:
            raise UsageError(f"unknown pass '{name}'; known passes: {', '.join(passes)}")
        return passes[name]

    def check_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """``options`` parsed by their passes' ``option_values``; UsageError for a key no registered pass reads
        (a typo would otherwise be silently ignored) or a value its parser refuses."""
        passes = self.ordered().values()
        known = {key: cls.name for cls in passes for key in cls.options}
        unknown = sorted(set(options) - set(known))
        if unknown:
            listing = ", ".join(f"{key} ({owner})" for key, owner in sorted(known.items())) or "none"
            raise UsageError(f"unknown pass option(s) {', '.join(unknown)}; known: {listing}")
        parsers = {key: parse for cls in passes for key, parse in cls.option_values.items()}
        parsed = dict(options)
        for key, value in options.items():
            if key in parsers:
                try:
                    parsed[key] = parsers[key](value)
                except ValueError as exc:
                    raise UsageError(f"--pass-option {key}={value}: {exc}") from None
        return parsed

    def build_pipeline(self, passes: Optional[Sequence[str]] = None, skip: Sequence[str] = (),
                       target: Any = "onnx") -> list:
        """Instances for ``passes`` (exactly those, in the order given) or the default pipeline less ``skip``."""
        known = self.ordered()
        for name in list(passes or []) + list(skip):
            if name not in known:
                raise UsageError(f"unknown pass '{name}'; known passes: {', '.join(known)}")
        if passes is not None:
            chosen = [known[n] for n in passes if n not in skip]
        else:
            chosen = [cls for cls in known.values()
                      if cls.default and cls.name not in skip and (cls.targets is None or target in cls.targets)]
        return [cls() for cls in chosen]

    def _check_complete(self) -> None:
        if self._waiting is not None:
            raise RuntimeError("the built-in passes are not in this registry yet (k3opt.plugins.process_registry)")


#: The registry every run starts from (a copy of it): the built-ins (added by ``k3opt.plugins`` on first use,
#: see :meth:`PassRegistry.add_builtins`), installed plugins, passes registered in code.
PROCESS = PassRegistry(awaits_builtins=True)
# Which registry register_pass fills and the registry queries read: a run's while its plugins load and it runs.
_CURRENT: contextvars.ContextVar[Optional[PassRegistry]] = contextvars.ContextVar("k3opt_registry", default=None)


def current() -> PassRegistry:
    """The current run's registry, else the process's."""
    return _CURRENT.get() or PROCESS


@contextlib.contextmanager
def using(registry: PassRegistry) -> Iterator[PassRegistry]:
    """Make ``registry`` current for the block (registrations go into it, lookups read it)."""
    token = _CURRENT.set(registry)
    try:
        yield registry
    finally:
        _CURRENT.reset(token)
