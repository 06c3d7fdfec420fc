"""A local fuzz campaign over the command line (issue #26): the properties of tests/test_fuzz_cli.py, for a
time budget instead of a fixed number of cases; prints the number of cases and of violations.

    python bench/fuzz_cli_campaign.py --minutes 30
"""
from __future__ import annotations

import argparse
import itertools
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.test_fuzz_cli import check_case  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--first-seed", type=int, default=1_000_000)
    args = parser.parse_args()
    end = time.monotonic() + 60 * args.minutes
    cases = violations = 0
    with tempfile.TemporaryDirectory() as tmp:
        for seed in itertools.count(args.first_seed):
            if time.monotonic() >= end:
                break
            try:
                check_case(Path(tmp), seed)
            except Exception:  # noqa: BLE001 - an assertion, or a written model onnx's checker refuses
                violations += 1
                print(f"VIOLATION seed {seed}:\n{traceback.format_exc(limit=1)}", flush=True)
            cases += 1
            shutil.rmtree(Path(tmp) / f"case{seed}", ignore_errors=True)
    print(f"{cases} cases, {violations} violations")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
