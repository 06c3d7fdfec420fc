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


_K3OPT_IMPORT = re.compile(r"^\s*(?:from\s+(\.+|k3opt\.?)([\w.]*)\s+import\s+([\w, ]+)|import\s+k3opt\.([\w.]+))", re.M)


def test_the_graph_package_imports_nothing_of_k3opt_above_it():
    """graph/ is the bottom layer: modelio, pipeline, passes and patterns build on it, never the reverse."""
    above = []
    for p in sorted((_ROOT / "graph").rglob("*.py")):
        for m in _K3OPT_IMPORT.finditer(p.read_text()):
            dots, module, names, absolute = m.groups()
            if absolute is not None:
                top = absolute.split(".")[0]
            elif dots == ".":  # within graph/
                continue
            else:
                top = module.split(".")[0] if module else names.split(",")[0].strip()
            if top not in ("graph", "errors"):
                above.append(f"{p.relative_to(_ROOT)}: {m.group(0).strip()}")
    assert above == []
