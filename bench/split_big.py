"""Issue #32's numbers on the 3.3 GB 16-layer Llama (``llama-3gb`` of bench/models.py, external data).

``python -m bench.split_big [--stages 4] [--cann] [--out F.json]`` runs, each in its own process
(bench/procs.py: wall time and peak RSS, VmHWM), for the onnx target and, with ``--cann``, for ``--target cann``
too:

- ``k3opt optimize --no-verify`` and ``k3opt optimize`` (verification on by default: block by block, the
  model being over ``--verify-memory``; for cann the lowering too, under the reference NPU ops): the ratio of
  their wall times and the verified run's peak RSS;
- ``k3opt split --stages N``: peak RSS against the model's size, the stages' bytes, where the cuts fall
  (kind, layer, sublayer), largest / smallest, and how the stages were verified.

The children are k3opt's CLI (no bench payload): ``exit`` is their exit code.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional

from .models import BIG, ensure_built, model_set
from .procs import run_measured


def _k3opt(*args: str) -> list[str]:
    return [sys.executable, "-m", "k3opt", *args]


def _target_runs(model: Path, work: Path, target: str, stages: int, size: int, timeout: float) -> dict:
    """``optimize --no-verify``, ``optimize`` (verified) and ``split --stages N`` of ``model`` for ``target``."""
    extra = [] if target == "onnx" else ["--target", target]
    plain = run_measured(_k3opt("optimize", str(model), "-o", str(work / "a.onnx"), "--no-verify", "-q", *extra),
                         timeout)
    verified = run_measured(_k3opt("optimize", str(model), "-o", str(work / "b.onnx"), "-q", *extra,
                                   "--report", str(work / "b.json")), timeout)
    report = json.loads((work / "b.json").read_text()) if (work / "b.json").exists() else {}
    for f in work.glob("[ab].onnx*"):  # 3.3 GB each: gone before the split writes its stages
        f.unlink()
    split = run_measured(_k3opt("split", str(model), "--stages", str(stages), "-o", str(work / "stages"), "-q",
                                *extra), timeout)
    manifest = json.loads((work / "stages" / "manifest.json").read_text()) \
        if (work / "stages" / "manifest.json").exists() else {}
    shutil.rmtree(work / "stages", ignore_errors=True)
    v = report.get("verification") or {}
    lv = report.get("lowering_verification") or {}
    sv = manifest.get("verification") or {}
    found = manifest.get("stages", [])
    return {
        "no_verify": {"exit": plain.returncode, "wall_s": plain.wall_s, "peak_rss_mb": plain.peak_rss_mb},
        "block_verify": {"exit": verified.returncode, "wall_s": verified.wall_s, "peak_rss_mb": verified.peak_rss_mb,
                         "verification": v.get("status"), "mode": v.get("mode"), "blocks": len(v.get("blocks", [])),
                         "lowering_verification": lv.get("status"), "lowering_mode": lv.get("mode"),
                         "time_ratio": verified.wall_s / max(plain.wall_s, 1e-9)},
        "split": {"exit": split.returncode, "wall_s": split.wall_s, "peak_rss_mb": split.peak_rss_mb,
                  "peak_over_model": split.peak_rss_mb * 2**20 / size, "stages": len(found),
                  "stage_bytes": [s["bytes"] for s in found], "layers": [s["layers"] for s in found],
                  "cuts": [f"{c['kind']} {c['layer']} {c['part']}".strip() for c in manifest.get("cuts", [])],
                  "balance": manifest.get("balance"), "verification": sv.get("status"), "mode": sv.get("mode"),
                  "stages_run_by": sv.get("stages_run_by"), "error": split.error[-300:] if split.returncode else ""},
    }


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--cann", action="store_true", help="also the three runs with --target cann")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args(argv)
    spec = next(s for s in model_set(big=True) if s.name == BIG)
    model, why = ensure_built(spec)
    if model is None:
        raise SystemExit(f"cannot build {BIG}: {why}")
    size = model.stat().st_size + (model.parent / (model.name + ".data")).stat().st_size
    work = Path(tempfile.mkdtemp(prefix="split-big-", dir=model.parent.parent))
    result: dict = {"model": BIG, "model_bytes": size}
    try:
        for target in ("onnx", "cann") if args.cann else ("onnx",):
            result[target] = _target_runs(model, work, target, args.stages, size, args.timeout)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
