"""Fuzzing the command line (issue #26, "make it stay fixed"): seeded random option values and output
paths, hostile and ordinary mixed, each run checked against every promise of docs/cli.md "Guarantees":

- exit 0 or 2 (this model verifies: 1 would be a wrong rewrite), never an internal error;
- a failure is exactly one line on stderr, ``k3opt: error: ...``, no traceback;
- the input is unchanged, a FIFO or folder given as an output is still one, no temporary file is left;
- a failure writes nothing; a success writes a model onnx's checker accepts.

A fixed budget of seconds runs in the default test run (``K3OPT_FUZZ_SECONDS``), minutes in the slow test.
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import onnx
import pytest

from tests.fuzz.check import budget, for_seconds, invoke_in, state
from tests.test_bad_input import good_model

OUTPUTS = ["o.onnx", "o.onnx", "m.onnx", "fifo", "dir", "dir/", "missing/o.onnx", "o.onnx.data", ".", "sub/o.onnx"]
REPORTS = [None, None, "r.json", "r.html", "m.onnx", "o.onnx", "fifo", "dir", "missing/r.json", "o.onnx.data"]
OPTIONS = {
    "--opset": ["-1", "0", "1", "6", "7", "13", "17", "18", "28", "29", "99", "2147483648", "x", "17.5"],
    "--rtol": ["nan", "inf", "-1", "0", "1e-3", "abc", "1e400"],
    "--atol": ["-inf", "0", "1e-5", ""],
    "--target": ["onnx", "cann", "tpu", ""],
    "--input-shape": ["x:2,8", "x:4,8", "x:2", "x:0,8", "x:-1,8", "ghost:1", "x", "x:2,99999999999999999999", ":2,8"],
    "--pass-option": ["fold_max_bytes=1MiB", "fold_max_bytes=-5", "fold_max_bytes=abc", "fold_max_elements=1Mi",
                      "matmul_add_nd=flatten", "matmul_add_nd=yes", "cse_max_const_bytes=1e400", "nope=1", "=1",
                      "fold_max_bytes=", "npu_attention_form=npu"],
    "--passes": ["fold-constants", "nope", "", ",", "fuse-matmul-add,fold-constants"],
    "--skip": ["fold-constants", "nope"],
    "--input-data": ["good.npz", "wrong.npz", "junk.npz", "one.npy", "missing.npz", "dir"],
    "--plugin": ["exits.py", "raises.py", "missing.py"],
}
FLAGS = ["--no-verify", "--external-data", "--overwrite", "--fsync", "-q"]


def make_folder(folder: Path) -> None:
    folder.mkdir()
    onnx.save(good_model(), folder / "m.onnx")
    os.mkfifo(folder / "fifo")
    (folder / "dir").mkdir()
    (folder / "sub").mkdir()
    np.savez(folder / "good.npz", x=np.ones((2, 8), np.float32))
    np.savez(folder / "wrong.npz", x=np.ones((3, 8), np.float32))
    (folder / "junk.npz").write_bytes(b"PK\x03\x04junk")
    np.save(folder / "one.npy", np.ones((2, 8), np.float32))
    (folder / "exits.py").write_text("import sys\nsys.exit(0)\n")
    (folder / "raises.py").write_text("raise RuntimeError('boom')\n")


def random_args(rng: random.Random) -> list[str]:
    args = ["optimize", "m.onnx"]
    out = rng.choice(OUTPUTS)
    args += [out] if rng.random() < 0.5 else ["-o", out]
    report = rng.choice(REPORTS)
    if report is not None:
        args += ["--report", report]
    for key in rng.sample(sorted(OPTIONS), rng.randint(0, 3)):
        args += [key, rng.choice(OPTIONS[key])]
    args += rng.sample(FLAGS, rng.randint(0, 2))
    return args


def check_case(root: Path, seed: int) -> None:
    rng = random.Random(seed)
    folder = root / f"case{seed}"
    make_folder(folder)
    before = state(folder)
    args = random_args(rng)
    code, out, err = invoke_in(folder, args)
    where = f"seed {seed}: k3opt {' '.join(args)}\n{err}"
    assert code in (0, 2), where
    assert "Traceback" not in out + err and "internal error" not in err, where
    after = state(folder)
    assert not [p for p in after if p.endswith((".tmp", ".new"))], where
    assert after["fifo"] == "p" and after["dir"] == "d", where
    if "--overwrite" not in args or code != 0:
        assert after["m.onnx"] == before["m.onnx"], where
    if code != 0:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("k3opt: error: "), where
        assert after == before, where
    else:
        written = [p for p in after if p not in before or (p == "m.onnx" and after[p] != before[p])]
        report = args[args.index("--report") + 1] if "--report" in args else None
        models = [p for p in written if p.endswith(".onnx") and p != report]
        for model in models:
            onnx.checker.check_model(str(folder / model))


def test_fuzz_cli_fixed_budget(tmp_path):
    for seed in for_seconds(budget(12.0)):
        check_case(tmp_path, seed)


@pytest.mark.slow
def test_fuzz_cli_bigger_budget(tmp_path):
    for seed in for_seconds(budget(240.0, "K3OPT_FUZZ_SLOW_SECONDS"), first=100_000):
        check_case(tmp_path, seed)
