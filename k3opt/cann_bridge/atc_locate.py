"""Finding the ``atc`` executable the way an Ascend user's machine has it.

Order: ``--atc``, then ``PATH`` (what sourcing ``set_env.sh`` sets up), then
``ASCEND_TOOLKIT_HOME`` / ``ASCEND_HOME_PATH``, then the default install
prefixes. Under each toolkit root ATC lives in ``bin/`` (CANN 8+) or in its
package folder (``compiler/bin``, ``atc/bin`` in older layouts).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Mapping, Optional

from ..errors import CompileError, UsageError

ENV_ROOTS = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")
_SUBDIRS = ("bin", "compiler/bin", "atc/bin")


def default_roots(home: Path) -> list[Path]:
    """The install prefixes CANN documents (root install, user install, CANN 9)."""
    return [Path("/usr/local/Ascend/ascend-toolkit/latest"), home / "Ascend/ascend-toolkit/latest",
            Path("/usr/local/Ascend/cann")]


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _roots(environ: Mapping[str, str], home: Path) -> list[tuple[str, Path]]:
    roots = [(f"${v}", Path(environ[v])) for v in ENV_ROOTS if environ.get(v)]
    return roots + [(str(r), r) for r in default_roots(home)]


def find_atc(explicit: Optional[str] = None, environ: Optional[Mapping[str, str]] = None,
             home: Optional[Path] = None) -> Path:
    """The path of ``atc``; raises CompileError in one line saying where it looked and how to activate CANN."""
    environ = os.environ if environ is None else environ
    home = Path(environ.get("HOME", str(Path.home()))) if home is None else home
    if explicit:
        path = Path(explicit)
        if not _executable(path):
            raise UsageError(f"--atc {explicit}: not an executable file")
        return path
    on_path = shutil.which("atc", path=environ.get("PATH", ""))
    if on_path:
        return Path(on_path)
    looked = ["PATH"]
    for label, root in _roots(environ, home):
        for sub in _SUBDIRS:
            if _executable(root / sub / "atc"):
                return root / sub / "atc"
        looked.append(label)
    unset = [f"${v}" for v in ENV_ROOTS if not environ.get(v)]
    raise CompileError(
        "ATC not found: looked in " + ", ".join(looked) + (f" ({', '.join(unset)} unset)" if unset else "")
        + "; activate CANN with `source /usr/local/Ascend/ascend-toolkit/set_env.sh` (or "
        "$HOME/Ascend/ascend-toolkit/set_env.sh), or pass --atc PATH (--dry-run needs no ATC)"
    )
