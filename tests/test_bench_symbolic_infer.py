"""bench/symbolic_infer.py's workers run on the example model (fresh processes, as the benchmark runs them) and
its table reads their payloads."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT


def _worker(variant: str, model: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "BENCH_RESULT"}  # printed, not handed to a parent
    out = subprocess.run([sys.executable, "-m", "bench.symbolic_infer", "--worker", variant, model], cwd=ROOT,
                         env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_workers_measure_and_the_table_compares(tiny_transformer):
    from bench.symbolic_infer import table

    ort, k3 = _worker("ort-symbolic", str(tiny_transformer)), _worker("k3opt", str(tiny_transformer))
    assert ort["cpu_s"] > 0 and k3["cpu_s"] > 0
    assert k3["inferences"] >= 1 and 0 < k3["dims_s"] < k3["cpu_s"]
    text = table({"tiny": {"ort-symbolic": [ort], "k3opt": [k3]}})
    assert text.splitlines()[2].startswith("| tiny | ") and f"{ort['cpu_s'] / k3['cpu_s']:.2f}" in text
