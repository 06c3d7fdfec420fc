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
