"""Plugins: code outside k3opt that adds passes or fusion rules; and the registries they load into.

Three ways in (docs/writing-rules.md walks through each):

1. an installed package declaring the entry point group ``k3opt.plugins``
   (loaded once per process, into the process registry, when it is first used);
2. :func:`load_plugins` with a path to a ``.py`` file, a dotted module name,
   ``module:attribute``, or an object (``--plugin`` / ``optimize(plugins=...)``);
3. direct registration in code: ``k3opt.register_pass`` or
   ``k3opt.patterns.register_rules`` / ``@k3opt.patterns.rule``.

What a plugin provides, once imported or loaded: a module (that registers
at import, or has a ``register()`` function), a ``register`` callable, a
:class:`~k3opt.patterns.Rule`, a list of rules, or a Pass subclass. Every
pass it registers is marked with the plugin's name (``k3opt passes`` shows
it) and can be skipped by name. Anything that goes wrong while loading is a
:class:`~k3opt.errors.PluginError` naming the plugin, and leaves no pass of
it half-registered.

The process registry (:func:`process_registry`) holds the built-in passes (found in their modules:
:func:`k3opt.targets.builtin_passes`), the installed plugins and what code registers. Which other plugins are
active is a run's own business: ``optimize(plugins=...)`` and ``--plugin`` load them into that run's copy of the
process registry (:func:`run_plugins`), for that run only: a file or module is executed for each run that asks
for it, so its registrations land in that run's registry; the next run has them only if it asks again.
:func:`load_plugins` called outside a run loads into the process registry. A plugin loads once per registry.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import inspect
import os
import sys
import types
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

from .errors import K3optError, PluginError
from .pipeline import pass_base as base, registry

ENTRY_POINT_GROUP = "k3opt.plugins"
#: Set to 1 to skip entry-point discovery (a broken installed plugin must not lock users out).
DISABLE_ENV = "K3OPT_NO_ENTRY_POINTS"

# Installed entry points are loaded once per process, into the process registry; a failure is kept and raised
# again on every use (until K3OPT_NO_ENTRY_POINTS=1 in a new process).
_entry_point_error: Optional[PluginError] = None
_entry_points_done = False


def process_registry() -> registry.PassRegistry:
    """The process's registry, with the built-in passes and the installed plugins in (both added on first use)."""
    process = registry.PROCESS
    if not process.has_builtins:
        from .targets import builtin_passes

        process.add_builtins(builtin_passes())
    _load_entry_points()
    return process


@contextlib.contextmanager
def run_plugins(specs: Sequence[Union[str, object]] = ()) -> Iterator[registry.PassRegistry]:
    """One run's pass registry: a copy of the process's with ``specs``' plugins, current for the block."""
    with registry.using(process_registry().copy()) as run_registry:
        load_plugins(specs)
        yield run_registry


def load_plugins(specs: Sequence[Union[str, object]]) -> None:
    """Load each plugin (paths, module names, ``module:attr`` or objects) into the current registry (a run's,
    else the process's) unless it is in already; raise PluginError on failure."""
    process_registry()  # plugins anchor their passes before/after built-ins
    for spec in specs:
        if isinstance(spec, (str, os.PathLike)):
            name, key, loader = _resolve(os.fspath(spec))
        else:
            name = getattr(spec, "__name__", None) or _str_attr(spec, "name") or type(spec).__name__
            key, loader = f"obj:{id(spec)}", (lambda obj=spec: obj)
        _load(name, key, loader, keep=spec)


def registered_passes() -> dict[str, type[base.Pass]]:
    """Every pass of the current registry (a run's, else the process's) by name, in pipeline order."""
    process_registry()
    return registry.current().ordered()


def get_pass(name: str) -> type[base.Pass]:
    """The pass class named ``name`` in the current registry; UsageError when there is none."""
    process_registry()
    return registry.current().get(name)


def build_pipeline(passes: Optional[Sequence[str]] = None, skip: Sequence[str] = (),
                   target: Any = "onnx") -> list[base.Pass]:
    """Instances for ``passes`` (exactly those, in the order given) or the default pipeline less ``skip``, from
    the current registry."""
    process_registry()
    return registry.current().build_pipeline(passes, skip, target)


def _str_attr(obj: object, attr: str) -> Optional[str]:
    value = getattr(obj, attr, None)
    return value if isinstance(value, str) else None


def _load_entry_points() -> None:
    """Load every installed ``k3opt.plugins`` entry point into the process registry, once; a failure is raised
    again on each call."""
    global _entry_points_done, _entry_point_error
    if _entry_points_done:
        if _entry_point_error is not None:
            raise _entry_point_error
        return
    _entry_points_done = True
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return
    for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            with registry.using(registry.PROCESS):  # installed plugins belong to every run
                _load(ep.name, f"mod:{ep.value}", ep.load, keep=ep.value)
        except PluginError as exc:
            _entry_point_error = PluginError(f"{exc} (installed entry point '{ep.value}'; set {DISABLE_ENV}=1 "
                                             "to run without installed plugins)")
            raise _entry_point_error from exc


def _resolve(spec: str) -> tuple[str, str, Callable[[], Any]]:
    """(plugin name, identity key, loader) for a string spec; the loader executes the file or module afresh."""
    if spec.endswith(".py") or os.sep in spec or (os.altsep and os.altsep in spec):
        path = Path(spec).resolve()
        if not path.is_file():
            raise PluginError(f"plugin '{spec}': no such file")
        return path.stem, f"file:{path}", \
            lambda: _execute(importlib.util.spec_from_file_location(f"k3opt_plugin_{path.stem}", path))
    module, _, attr = spec.partition(":")

    def load() -> Any:
        found = importlib.util.find_spec(module)
        if found is None:
            raise ModuleNotFoundError(f"No module named '{module}'", name=module)
        obj: Any = _execute(found)
        for part in filter(None, attr.split(".")):
            obj = getattr(obj, part)
        return obj

    return spec, f"mod:{spec}", load


def _execute(spec: Optional[importlib.machinery.ModuleSpec]) -> types.ModuleType:
    """A new module executed from ``spec``: what it registers at import goes into the current registry. It is
    ``sys.modules[spec.name]`` while it runs (its own classes and dataclasses look themselves up there), and the
    module it replaced, if any, is put back after."""
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    replaced = sys.modules.get(spec.name)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        if replaced is not None:
            sys.modules[spec.name] = replaced
        else:
            sys.modules.pop(spec.name, None)
    return module


def _load(name: str, key: str, loader: Callable[[], Any], keep: object) -> None:
    """Load one plugin into a trial copy of the current registry and mark its passes; the copy replaces the
    registry's entries only when all of it loaded (all or nothing). A plugin in the registry already (``key``)
    is not loaded again; ``keep`` is what the registry keeps for the key (an object plugin's key is its id)."""
    target = registry.current()
    if key in target.plugins:
        return
    before = target.entries()
    try:
        with registry.using(target.copy()) as trial:
            _register(loader(), name)
    except (Exception, SystemExit) as exc:  # sys.exit() in a plugin is its failure, not the run's end
        if isinstance(exc, PluginError) and f"plugin '{name}'" in str(exc):
            raise
        detail = str(exc) if isinstance(exc, K3optError) else f"{type(exc).__name__}: {exc}"
        raise PluginError(f"plugin '{name}' failed to load: {detail}") from exc
    trial.plugins[key] = keep
    target.replace_entries(trial)
    for cls in target.entries().values():
        if before.get(cls.name) is not cls and cls.plugin is None:
            cls.plugin = name


def _register(obj: Any, name: str) -> None:
    """Register whatever form of plugin ``obj`` is (see the module docstring)."""
    from .patterns import Rule, register_rules

    if isinstance(obj, types.ModuleType):
        hook = getattr(obj, "register", None)
        if callable(hook):
            _register(hook(), name)
    elif isinstance(obj, Rule):
        register_rules(obj, plugin=name)
    elif isinstance(obj, (list, tuple)) and obj and all(isinstance(r, Rule) for r in obj):
        register_rules(*obj, name=name, plugin=name)
    elif inspect.isclass(obj) and issubclass(obj, base.Pass):
        base.register_pass(obj, plugin=name)
    elif callable(obj):
        _register(obj(), name)
    elif obj is not None:
        raise PluginError(f"plugin '{name}' provides {type(obj).__name__}, not a module, rule(s), pass or register()")
