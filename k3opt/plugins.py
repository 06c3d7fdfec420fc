"""Plugins: code outside k3opt that adds passes or fusion rules.

Three ways in (docs/writing-rules.md walks through each):

1. an installed package declaring the entry point group ``k3opt.plugins``
   (discovered when the pass registry is first used);
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
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import sys
import types
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

from .errors import K3optError, PluginError
from .pipeline import pass_base as base

ENTRY_POINT_GROUP = "k3opt.plugins"
#: Set to 1 to skip entry-point discovery (a broken installed plugin must not lock users out).
DISABLE_ENV = "K3OPT_NO_ENTRY_POINTS"

_loaded: dict[str, str] = {}  # spec key -> plugin name
_loaded_objects: list = []  # what each plugin provided: one object reached by two routes loads once
_entry_point_error: Optional[PluginError] = None
_entry_points_done = False


def load_plugins(specs: Sequence[Union[str, object]]) -> None:
    """Load each plugin once (paths, module names, ``module:attr`` or objects); raise PluginError on failure."""
    from .passes import load_builtin_passes

    load_builtin_passes()  # plugins anchor their passes before/after built-ins
    for spec in specs:
        if isinstance(spec, (str, os.PathLike)):
            name, key, loader = _resolve(os.fspath(spec))
        else:
            name = getattr(spec, "__name__", None) or _str_attr(spec, "name") or type(spec).__name__
            key, loader = f"obj:{id(spec)}", (lambda obj=spec: obj)
        _activate(name, key, loader)


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
            _activate(ep.name, f"ep:{ep.value}", ep.load)
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
    """Load one plugin, register what it provides, mark its passes; all or nothing."""
    if key in _loaded:
        return
    before, n_objects = dict(base._REGISTRY), len(_loaded_objects)
    try:
        _register(loader(), name)
    except Exception as exc:
        _rollback(before)
        del _loaded_objects[n_objects:]
        if isinstance(exc, PluginError) and f"plugin '{name}'" in str(exc):
            raise
        detail = str(exc) if isinstance(exc, K3optError) else f"{type(exc).__name__}: {exc}"
        raise PluginError(f"plugin '{name}' failed to load: {detail}") from exc
    for pass_name, cls in base._REGISTRY.items():
        if before.get(pass_name) is not cls and cls.plugin is None:
            cls.plugin = name
    _loaded[key] = name


def _rollback(before: dict) -> None:
    for pass_name in [n for n in base._REGISTRY if before.get(n) is not base._REGISTRY[n]]:
        del base._REGISTRY[pass_name]
    base._REGISTRY.update(before)


def _register(obj: Any, name: str) -> None:
    """Register whatever form of plugin ``obj`` is (see the module docstring)."""
    from .patterns import Rule, register_rules

    if any(obj is seen for seen in _loaded_objects):
        return  # the same module/hook reached by a second route (entry point and --plugin)
    _loaded_objects.append(obj)
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
