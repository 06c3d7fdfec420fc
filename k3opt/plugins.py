"""Plugins: code outside k3opt that adds passes or fusion rules.

Three ways in (docs/writing-rules.md walks through each):

1. an installed package declaring the entry point group ``k3opt.plugins``
   (discovered when a run first builds its pass registry);
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

Which plugins are active is a run's own business: ``optimize(plugins=...)`` and ``--plugin`` register them into
that run's copy of the pass registry only (:func:`run_plugins`; the next run has them only if it asks again).
Installed entry points and :func:`load_plugins` called directly are for the whole process, like direct
registration. A plugin is imported once per process; what it registered is recorded and registered again into
each later run that asks for it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
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


@dataclasses.dataclass(frozen=True)
class _Record:
    """What loading one plugin registered: registered again, not loaded again, when a later run asks for it."""

    passes: tuple[tuple[str, type], ...]  # (pass name, class), new or grown by the plugin
    includes: tuple[str, ...]  # keys of plugins that registered an object this one reached again


# Module-level, and written once per plugin: what loading a plugin registers is a fact about the plugin (a
# module that registers at import cannot be imported twice). Which plugins a run uses is kept by the run.
_records: dict[str, _Record] = {}  # spec key -> what it registered
_objects: list[tuple[object, str]] = []  # what each plugin provided (kept alive: obj: keys are ids), its key
# Installed entry points are loaded once per process into the registry every run starts from.
_entry_point_error: Optional[PluginError] = None
_entry_points_done = False


@contextlib.contextmanager
def run_plugins(specs: Sequence[Union[str, object]] = ()) -> Iterator[registry.PassRegistry]:
    """One run's pass registry: a copy of the process's with ``specs``' plugins, current for the block."""
    _load_process_passes()  # built-ins and installed plugins belong to every run: before the copy
    with registry.using(registry.PROCESS.copy()) as run_registry:
        load_plugins(specs)
        yield run_registry


def load_plugins(specs: Sequence[Union[str, object]]) -> None:
    """Register each plugin (paths, module names, ``module:attr`` or objects), loading it the first time;
    raise PluginError on failure."""
    _load_process_passes()  # plugins anchor their passes before/after built-ins
    for spec in specs:
        if isinstance(spec, (str, os.PathLike)):
            name, key, loader = _resolve(os.fspath(spec))
        else:
            name = getattr(spec, "__name__", None) or _str_attr(spec, "name") or type(spec).__name__
            key, loader = f"obj:{id(spec)}", (lambda obj=spec: obj)
        _use(name, key, loader)


def _load_process_passes() -> None:
    """The built-in passes, then the installed entry points, into the process registry (once each)."""
    from .passes import load_builtin_passes

    load_builtin_passes()
    load_entry_point_plugins()


def _use(name: str, key: str, loader: Callable[[], Any]) -> None:
    """Register the plugin ``key``: load it the first time, replay its record afterwards."""
    if key in _records:
        _replay(key, name)
    else:
        _activate(name, key, loader)


def _replay(key: str, name: str) -> None:
    """Register again what loading the plugin ``key`` registered (into a run's registry, or one that lost it)."""
    record = _records[key]
    for other in record.includes:
        _replay(other, name)
    for pass_name, cls in record.passes:
        current = registry.current().entries().get(pass_name)
        if current is cls:
            continue
        if current is not None and not issubclass(cls, current):  # it only ever replaces a set it grew
            raise PluginError(f"plugin '{name}': a pass named '{pass_name}' is already registered")
        base.register_pass(cls, replace=current is not None)


def _str_attr(obj: object, attr: str) -> Optional[str]:
    value = getattr(obj, attr, None)
    return value if isinstance(value, str) else None


def load_entry_point_plugins() -> None:
    """Load every installed ``k3opt.plugins`` entry point once; a failure is re-raised on each call."""
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
                _use(ep.name, f"ep:{ep.value}", ep.load)
        except PluginError as exc:
            _entry_point_error = PluginError(f"{exc} (installed entry point '{ep.value}'; set {DISABLE_ENV}=1 "
                                             "to run without installed plugins)")
            raise _entry_point_error from exc


def _resolve(spec: str) -> tuple[str, str, Callable[[], Any]]:
    """(plugin name, identity key, loader) for a string spec."""
    if spec.endswith(".py") or os.sep in spec or (os.altsep and os.altsep in spec):
        path = Path(spec).resolve()
        if not path.is_file():
            raise PluginError(f"plugin '{spec}': no such file")
        return path.stem, f"file:{path}", lambda: _import_file(path)
    module, _, attr = spec.partition(":")

    def load() -> Any:
        obj = importlib.import_module(module)
        for part in filter(None, attr.split(".")):
            obj = getattr(obj, part)
        return obj

    return spec, f"mod:{spec}", load


def _import_file(path: Path) -> types.ModuleType:
    name = f"k3opt_plugin_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _activate(name: str, key: str, loader: Callable[[], Any]) -> None:
    """Load one plugin into a trial copy of the current registry, mark its passes, record it; the copy replaces
    the registry's entries only when all of it loaded (all or nothing)."""
    target, n_objects = registry.current(), len(_objects)
    before = target.entries()
    includes: list[str] = []
    try:
        with registry.using(target.copy()) as trial:
            _register(loader(), name, key, includes)
    except (Exception, SystemExit) as exc:  # sys.exit() in a plugin is its failure, not the run's end
        del _objects[n_objects:]
        if isinstance(exc, PluginError) and f"plugin '{name}'" in str(exc):
            raise
        detail = str(exc) if isinstance(exc, K3optError) else f"{type(exc).__name__}: {exc}"
        raise PluginError(f"plugin '{name}' failed to load: {detail}") from exc
    target.replace_entries(trial)
    added = tuple((n, cls) for n, cls in target.entries().items() if before.get(n) is not cls)
    for _, cls in added:
        if cls.plugin is None:
            cls.plugin = name
    _records[key] = _Record(added, tuple(dict.fromkeys(includes)))


def _register(obj: Any, name: str, key: str, includes: list[str]) -> None:
    """Register whatever form of plugin ``obj`` is (see the module docstring)."""
    from .patterns import Rule, register_rules

    owner = next((k for seen, k in _objects if seen is obj), None)
    if owner is not None:  # the same module/hook reached by a second route (entry point and --plugin)
        if owner != key:
            includes.append(owner)
        return
    _objects.append((obj, key))
    if isinstance(obj, types.ModuleType):
        hook = getattr(obj, "register", None)
        if callable(hook):
            _register(hook(), name, key, includes)
    elif isinstance(obj, Rule):
        register_rules(obj, plugin=name)
    elif isinstance(obj, (list, tuple)) and obj and all(isinstance(r, Rule) for r in obj):
        register_rules(*obj, name=name, plugin=name)
    elif inspect.isclass(obj) and issubclass(obj, base.Pass):
        base.register_pass(obj, plugin=name)
    elif callable(obj):
        _register(obj(), name, key, includes)
    elif obj is not None:
        raise PluginError(f"plugin '{name}' provides {type(obj).__name__}, not a module, rule(s), pass or register()")
