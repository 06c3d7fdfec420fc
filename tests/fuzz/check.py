"""The promises every fuzzed run is held to (docs/cli.md "Guarantees"), and the cases that run them."""
from __future__ import annotations

import hashlib
import os
import random
import stat
import time
from pathlib import Path
from typing import Iterator, Optional

import onnx

from tests.fuzz import mutate
from tests.fuzz.seeds import SEEDS
from tests.test_bad_input import invoke

#: Option sets a fuzzed model runs with: the default, unverified, external data, a few passes, opsets.
FLAGS = [[], [], ["--no-verify"], ["--external-data"], ["--passes", "fold-constants,fuse-matmul-add,remove-identity"],
         ["--opset", "13"], ["--opset", "18", "--no-verify"], ["--skip", "fold-constants"]]
KINDS = ("protobuf", "graph", "external")


def state(folder: Path) -> dict[str, str]:
    """Every entry under ``folder`` (links not followed): a regular file's hash, else its kind (d, p, l, c...)."""
    out = {}
    for top, dirs, files in os.walk(folder):
        for name in dirs + files:
            p = Path(top, name)
            mode = os.lstat(p).st_mode
            out[str(p.relative_to(folder))] = (hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(mode)
                                               else stat.filemode(mode)[0])
    return out


def assert_promises(folder: Path, before: dict[str, str], args: list[str], code: int, out: str, err: str,
                    where: str, codes: tuple[int, ...] = (0, 2)) -> None:
    """One run's promises: an expected exit code, no traceback or internal error, one line on failure with the
    folder as it was, nothing temporary left, special files still special, and on success written models
    onnx's checker accepts, holding no byte of the secret file outside the folder."""
    where = f"{where}\nk3opt {' '.join(args)}\nexit {code}\n{err}"
    assert code in codes, where
    assert "Traceback" not in out + err and "internal error" not in err, where
    after = state(folder)
    assert not [p for p in after if p.endswith((".tmp", ".new")) or ".tmp/" in p], where
    for name, kind in before.items():
        if len(kind) == 1:  # a folder, FIFO, device, link: still one, untouched
            assert after.get(name) == kind, where
    if code != 0:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("k3opt: error: "), where
        assert after == before, where
        return
    changed = [p for p in after if after[p] != before.get(p)]
    for p in changed:
        data = (folder / p).read_bytes()
        assert mutate.SECRET[:32] not in data, f"{where}\n{p} holds bytes of a file outside the model's folder"
        if p.endswith(".onnx") and "--report" not in args:
            why = _checker_fault(folder / p)
            # with --no-verify (or a skipped verification) onnxruntime loading it is the check: a flaw the input
            # has too (a node in a domain it imports nothing for) is passed on, not made
            if why is not None and _checker_fault(folder / "m.onnx") is None:
                raise AssertionError(f"{where}\nwritten {p} fails onnx's checker, the input does not: {why}")
    for name in before:
        if name == "m.onnx" or name.endswith(".bin"):
            assert after.get(name) == before[name], f"{where}\nthe input {name} changed"


def _checker_fault(path: Path) -> Optional[str]:
    try:
        onnx.checker.check_model(str(path))
    except Exception as exc:  # noqa: BLE001 - ValidationError, or onnx's C++ errors
        return str(exc).strip()[:300]
    return None


def model_case(root: Path, seed: int, kind: str) -> None:
    """Mutate a seed model (``kind``: protobuf, graph or external) and hold ``k3opt optimize`` to its promises."""
    rng = random.Random(f"{kind}-{seed}")
    folder = root / f"{kind}{seed}"
    folder.mkdir()
    name = rng.choice(sorted(SEEDS))
    model = SEEDS[name]()
    if kind == "protobuf":
        data, what = mutate.protobuf(model.SerializeToString(), rng)
        (folder / "m.onnx").write_bytes(data)
    elif kind == "graph":
        what = mutate.graph(model, rng)
        (folder / "m.onnx").write_bytes(model.SerializeToString())
    else:
        what = mutate.external(folder, model, rng)
    args = ["optimize", "m.onnx", "o.onnx", "-q", *rng.choice(FLAGS)]
    before = state(folder)
    code, out, err = invoke_in(folder, args)
    assert_promises(folder, before, args, code, out, err, f"{kind} seed {seed} ({name}: {what})")


def invoke_in(folder: Path, args: list[str]) -> tuple[int, str, str]:
    """``k3opt ARGS`` run in-process from ``folder``: (exit code, stdout, stderr)."""
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        return invoke(args)
    finally:
        os.chdir(cwd)


def for_seconds(seconds: float, first: int = 0, least: int = 3) -> Iterator[int]:
    """Seeds ``first``, ``first + 1``... for ``seconds`` of wall time (at least ``least`` of them): a fixed budget of
    time, each case reproducible from its seed."""
    end = time.monotonic() + seconds
    seed = first
    while seed < first + least or time.monotonic() < end:
        yield seed
        seed += 1


def budget(default: float, variable: str = "K3OPT_FUZZ_SECONDS") -> float:
    """Seconds a fuzz test runs: ``default``, or the environment's ``variable``."""
    return float(os.environ.get(variable, default))
