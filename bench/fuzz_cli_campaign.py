"""A local fuzz campaign (issue #26): the properties of tests/test_fuzz_cli.py and tests/test_fuzz_inputs.py for a
time budget instead of a few seconds; prints each violation (with the seed that replays it) and the counts.

    python bench/fuzz_cli_campaign.py --minutes 30
    python bench/fuzz_cli_campaign.py --minutes 5 --kinds graph,external

Each case runs in a forked child, so a crash of native code (onnx's converter, onnxruntime) or a hang
(over ``--case-timeout`` seconds) is a violation counted here, not the end of the campaign. Replay one with
``python -c "from tests.fuzz.check import model_case; model_case(Path('/tmp/x'), SEED, KIND)"``.
"""
from __future__ import annotations

import argparse
import collections
import itertools
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fuzz.check import KINDS, model_case  # noqa: E402
from tests.test_fuzz_cli import check_case  # noqa: E402

ALL_KINDS = ("cli", *KINDS)


def run_case(root: Path, seed: int, kind: str) -> None:
    """One case of ``kind`` (``cli`` or a model mutation kind) in this process; raises on a violation."""
    if kind == "cli":
        check_case(root, seed)
    else:
        model_case(root, seed, kind)


def in_child(root: Path, seed: int, kind: str, timeout: float) -> str:
    """Run one case in a forked child; '' when it kept every promise, else what happened."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe, never return into the campaign
        os.close(read)
        status = 0
        try:
            run_case(root, seed, kind)
        except BaseException:  # noqa: BLE001 - an assertion, or anything a case raised: all reported
            os.write(write, traceback.format_exc(limit=2).encode()[-4000:])
            status = 1
        os._exit(status)
    os.close(write)
    end = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > end:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read)
            return f"hang: over {timeout:.0f} s"
        time.sleep(0.02)
    with os.fdopen(read, "rb") as f:
        report = f.read().decode(errors="replace")
    if os.WIFSIGNALED(status):
        return f"crash: {signal.Signals(os.WTERMSIG(status)).name}"
    return report if os.WEXITSTATUS(status) else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--first-seed", type=int, default=1_000_000)
    parser.add_argument("--kinds", default=",".join(ALL_KINDS), help=f"comma-separated, of {', '.join(ALL_KINDS)}")
    parser.add_argument("--case-timeout", type=float, default=300.0)
    args = parser.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(ALL_KINDS)
    if unknown:
        parser.error(f"unknown kinds {', '.join(sorted(unknown))}")
    end = time.monotonic() + 60 * args.minutes
    cases: collections.Counter = collections.Counter()
    violations: collections.Counter = collections.Counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for seed in itertools.count(args.first_seed):
            if time.monotonic() >= end:
                break
            kind = kinds[seed % len(kinds)]
            what = in_child(root, seed, kind, args.case_timeout)
            cases[kind] += 1
            if what:
                violations[kind] += 1
                print(f"VIOLATION {kind} seed {seed}:\n{what}", flush=True)
            for case in root.iterdir():
                if case.is_dir() and not case.is_symlink():
                    shutil.rmtree(case, ignore_errors=True)
    counts = ", ".join(f"{k} {cases[k]} ({violations[k]} violations)" for k in kinds)
    print(f"{sum(cases.values())} cases, {sum(violations.values())} violations: {counts}")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
