"""The package layout holds: only k3opt.graph reaches the graph library."""
import pathlib
import re

import k3opt

_ROOT = pathlib.Path(k3opt.__file__).parent
_GS_IMPORT = re.compile(r"^\s*(import|from)\s+onnx_graphsurgeon\b", re.M)


def test_only_the_graph_package_imports_onnx_graphsurgeon():
    outside = [str(p.relative_to(_ROOT)) for p in sorted(_ROOT.rglob("*.py"))
               if p.relative_to(_ROOT).parts[0] != "graph" and _GS_IMPORT.search(p.read_text())]
    assert outside == []


#: onnx-graphsurgeon's private fields k3opt would reach (a Constant's stored values, export dtype...), read or
#: written as ``x._field`` or through getattr/setattr with the name.
_GS_PRIVATE = re.compile(r"(?<!\bself)\.(_values|_export_dtype|_local_tensor_copies|_merge_subgraph_functions)\b"
                         r"|attr\([^)]*[\"'](_values|_export_dtype)[\"']")


def test_only_the_graph_package_touches_onnx_graphsurgeon_private_fields():
    """graph.ir gives the passes what they need (stored_values, store_values, set_input, ...) (issue #27)."""
    outside = [f"{p.relative_to(_ROOT)}:{i}: {line.strip()}" for p in sorted(_ROOT.rglob("*.py"))
               if p.relative_to(_ROOT).parts[0] != "graph"
               for i, line in enumerate(p.read_text().splitlines(), 1) if _GS_PRIVATE.search(line)]
    assert outside == []


_K3OPT_IMPORT = re.compile(r"^\s*(?:from\s+(\.+|k3opt\.?)([\w.]*)\s+import\s+([\w, ]+)|import\s+k3opt\.([\w.]+))", re.M)


def test_the_graph_package_imports_nothing_of_k3opt_above_it():
    """graph/ is the bottom layer: modelio, pipeline, passes and patterns build on it, never the reverse."""
    above = []
    for p in sorted((_ROOT / "graph").rglob("*.py")):
        package = p.relative_to(_ROOT).parts[:-1]
        for m in _K3OPT_IMPORT.finditer(p.read_text()):
            dots, module, names, absolute = m.groups()
            if absolute is not None:
                top = absolute.split(".")[0]
            elif dots in (None, "", "k3opt", "k3opt."):  # from k3opt[.x] import ...
                top = module.split(".")[0] if module else names.split(",")[0].strip()
            else:  # relative: resolved from this module's package (graph/ or a folder in it)
                base = package[:len(package) - (len(dots) - 1)] + tuple(x for x in module.split(".") if x)
                top = base[0] if base else names.split(",")[0].strip()
            if top not in ("graph", "errors"):
                above.append(f"{p.relative_to(_ROOT)}: {m.group(0).strip()}")
    assert above == []


_PASS_FOLDERS = ("cleanup", "fold", "fusion")
#: Every folder of pass modules, as parts below k3opt: the capabilities, and each target's passes.
_PASS_PACKAGES = [("passes", f) for f in _PASS_FOLDERS] + [
    p.relative_to(_ROOT).parts for p in sorted((_ROOT / "targets").glob("**/passes")) if p.is_dir()]
_RELATIVE_IMPORT = re.compile(r"^\s*from\s+(\.+)([\w.]*)\s+import\s+([\w, ()]+)", re.M)


def _imported_modules(path: pathlib.Path) -> list[tuple[str, ...]]:
    """The k3opt modules ``path`` imports relatively, as parts below k3opt (``("passes", "fold", "_eval")``); an
    ``from X import name`` whose name may be a module counts as ``X.name`` too."""
    package = path.relative_to(_ROOT).parts[:-1]
    found = []
    for dots, module, names in _RELATIVE_IMPORT.findall(path.read_text()):
        base = package[:len(package) - (len(dots) - 1)] + tuple(p for p in module.split(".") if p)
        found.append(base)
        found += [base + (n.strip(),) for n in names.strip("()").split(",") if n.strip()]
    return found


def test_no_pass_imports_another_pass_module():
    """A pass module in passes/<capability>/ (or a target's passes/) imports only its own folder's ``_``
    helpers, passes/_shared/ (the recognisers the fusions and lowerings share) and passes/_rewire: never another pass's module, nor another folder's helpers (issue #18)."""
    assert ("targets", "cann", "passes") in _PASS_PACKAGES
    wrong = []
    for folder in _PASS_PACKAGES:
        for p in sorted(_ROOT.joinpath(*folder).glob("*.py")):
            for parts in _imported_modules(p):
                hit = next((f for f in _PASS_PACKAGES if parts[:len(f)] == f and len(parts) > len(f)), None)
                if hit is not None and (hit != folder or not parts[len(hit)].startswith("_")):
                    wrong.append(f"{p.relative_to(_ROOT)} imports {'.'.join(parts)}")
    assert wrong == []


def test_the_cann_bridge_does_not_import_the_api():
    """api runs the cann lowering passes and the bridge's checks; the bridge importing api back was the
    cycle issue #18 removed."""
    wrong = [f"{p.relative_to(_ROOT)}: {'.'.join(parts)}" for p in sorted((_ROOT / "cann_bridge").glob("*.py"))
             for parts in _imported_modules(p) if parts[:1] == ("api",)]
    assert wrong == []


def _is_module(parts: tuple[str, ...]) -> bool:
    return _ROOT.joinpath(*parts).with_suffix(".py").is_file() or (_ROOT.joinpath(*parts) / "__init__.py").is_file()


def _runtime_imports(path: pathlib.Path) -> list[tuple[str, ...]]:
    """The k3opt modules ``path`` imports at run time, inside functions too (``if TYPE_CHECKING:`` blocks left
    out), as parts below k3opt: relative imports, absolute ``k3opt.x`` ones, and a name taken from the package
    root (``from k3opt import optimize``, ``k3opt.optimize`` after ``import k3opt``) as the module defining it."""
    import ast

    package = path.relative_to(_ROOT).parts[:-1]
    found: list[tuple[str, ...]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            return
        if isinstance(node, ast.ImportFrom):
            module = tuple(p for p in (node.module or "").split(".") if p)
            if node.level:
                base: "tuple[str, ...] | None" = package[:len(package) - (node.level - 1)] + module
            else:
                base = module[1:] if module[:1] == ("k3opt",) else None
            for a in node.names if base is not None else ():
                if not base:  # from the package root: the module each name comes from
                    found.append((_ROOT_NAMES.get(a.name, a.name),))
                else:
                    found.append(base + (a.name,) if _is_module(base + (a.name,)) else base)
        elif isinstance(node, ast.Import):
            found.extend(tuple(a.name.split(".")[1:]) for a in node.names if a.name.startswith("k3opt."))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "k3opt":
            found.append((_ROOT_NAMES.get(node.attr, node.attr),))  # ``import k3opt`` then ``k3opt.optimize``
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return [parts for parts in found if parts]


def test_the_targets_import_nothing_above_them():
    """targets/ builds on passes, patterns, pipeline, modelio and graph; the api, the CLI and the ATC driver build
    on the targets, never the reverse (the api <-> cann_bridge cycle of issue #27 in another form)."""
    above = ("api", "cli", "cli_options", "cann_bridge", "export", "llm", "quantize", "blocks", "plugins")
    wrong = [f"{p.relative_to(_ROOT)}: {'.'.join(parts)}" for p in sorted((_ROOT / "targets").rglob("*.py"))
             for parts in _runtime_imports(p) if parts[:1] and parts[0] in above]
    assert wrong == []


#: The layers, bottom up: a module imports only from its own layer or below (names imported from the package
#: root count as the module defining them). docs/design.md draws them.
_LAYERS = [
    ("errors", "interrupts"),
    ("graph",),
    ("modelio",),
    ("pipeline", "report"),
    ("patterns",),
    ("passes",),
    ("targets",),
    ("api", "plugins", "report_html", "blocks"),  # the run's facade and the services it hands the run
    ("cann_bridge", "export", "llm", "quantize", "cli_options", "blocks.cli", "blocks.compile_stages"),
    ("cli",),
    ("entry", "__main__"),
]
#: The names the package root offers -> the layer defining them: its lazy names (PEP 562) and what it imports itself.
_ROOT_NAMES = {**{name: module.lstrip(".").split(".")[0] for name, module in k3opt._LAZY.items()},
               **{name: "errors" for name in k3opt.__all__ if name not in k3opt._LAZY}, "__version__": "errors"}


def _layer(parts: tuple[str, ...]) -> int:
    names = [".".join(parts[:n]).removesuffix(".py") for n in range(len(parts), 0, -1)]
    return next(i for name in names for i, layer in enumerate(_LAYERS) if name in layer)


def test_every_root_name_has_a_layer():
    """A name added to the package root must say where it comes from (or the layer test would not see it)."""
    assert set(k3opt.__all__) <= set(_ROOT_NAMES) and all(_layer((m,)) >= 0 for m in _ROOT_NAMES.values())


def _module(parts: tuple[str, ...]) -> tuple[str, ...]:
    """The k3opt module ``parts`` names, or the nearest one above it (``x.y`` of a name ``y`` in module ``x``)."""
    while parts and not _is_module(parts):
        parts = parts[:-1]
    return parts


def test_there_is_no_import_circle():
    """No module reaches itself through what it imports at run time, inside functions included (issue #27: the
    registry loop through passes, report <-> report_html, api <-> cann_bridge)."""
    import networkx as nx

    graph = nx.DiGraph()
    for p in sorted(_ROOT.rglob("*.py")):
        me = p.relative_to(_ROOT).with_suffix("").parts
        me = me[:-1] if me[-1] == "__init__" else me
        for parts in _runtime_imports(p):
            other = _module(parts)
            if other != me:
                graph.add_edge(".".join(me) or "k3opt", ".".join(other) or "k3opt")
    assert [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1] == []


def test_the_layers_hold_by_import():
    """graph <- modelio <- pipeline <- patterns <- passes <- targets <- api <- cann_bridge/export <- cli (#27)."""
    wrong = []
    for p in sorted(_ROOT.rglob("*.py")):
        me = p.relative_to(_ROOT).parts
        if me == ("__init__.py",):
            continue
        for parts in _runtime_imports(p):
            if _layer(parts) > _layer(me):
                wrong.append(f"{'/'.join(me)} imports {'.'.join(parts)}")
    assert wrong == []


def test_the_pipeline_never_imports_the_passes():
    """pipeline/ builds the registry's tools, never its contents: it imports neither the passes nor the targets,
    not even by name at run time, nor tells passes apart by their modules (the registry loop of issue #27:
    pass_base imported ``k3opt.passes`` to load the built-ins, PassContext ``k3opt.targets`` to look a target's
    name up, and the run picked the passes to repeat after a lowering by their module's name)."""
    import ast

    wrong = [f"{p.relative_to(_ROOT)}:{node.lineno}: {node.value!r}"
             for p in sorted((_ROOT / "pipeline").rglob("*.py")) for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and re.match(r"(k3opt)?\.+(passes|targets)\b", node.value)]  # a module name in code, not in prose
    assert wrong == []


def test_importing_every_built_in_pass_registers_nothing():
    """Built-in passes are found in their modules (discover_passes), not registered as an import side effect."""
    import subprocess
    import sys

    code = ("from k3opt.targets import builtin_passes; from k3opt.pipeline import registry; "
            "found = builtin_passes(); assert len(found) > 40, len(found); "
            "assert registry.PROCESS.entries() == {}, sorted(registry.PROCESS.entries())")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
