"""Issue #32's numbers on the 3.3 GB 16-layer Llama (``llama-3gb`` of bench/models.py, external data).

``python -m bench.split_big [--stages 4] [--out F.json]`` runs, each in its own process (bench/procs.py:
wall time and peak RSS, VmHWM):

- ``k3opt optimize --no-verify`` and ``k3opt optimize`` (verification on by default: block by block, the
  model being over ``--verify-memory``): the ratio of their wall times and the verified run's peak RSS;
- ``k3opt split --stages N``: peak RSS against the model's size, the stages' bytes, where the cuts fall
  (kind, layer, sublayer) and largest / smallest.

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


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args(argv)
    spec = next(s for s in model_set(big=True) if s.name == BIG)
    model, why = ensure_built(spec)
    if model is None:
        raise SystemExit(f"cannot build {BIG}: {why}")
    size = model.stat().st_size + (model.parent / (model.name + ".data")).stat().st_size
    work = Path(tempfile.mkdtemp(prefix="split-big-", dir=model.parent.parent))
    try:
        plain = run_measured(_k3opt("optimize", str(model), "-o", str(work / "a.onnx"), "--no-verify", "-q"),
                             args.timeout)
        verified = run_measured(_k3opt("optimize", str(model), "-o", str(work / "b.onnx"), "-q",
                                       "--report", str(work / "b.json")), args.timeout)
        report = json.loads((work / "b.json").read_text()) if (work / "b.json").exists() else {}
        shutil.rmtree(work / "a.onnx", ignore_errors=True)
        split = run_measured(_k3opt("split", str(model), "--stages", str(args.stages), "-o", str(work / "stages"),
                                    "-q"), args.timeout)
        manifest = json.loads((work / "stages" / "manifest.json").read_text()) \
            if (work / "stages" / "manifest.json").exists() else {}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    v = report.get("verification") or {}
    stages = manifest.get("stages", [])
    result = {
        "model": BIG, "model_bytes": size,
        "no_verify": {"exit": plain.returncode, "wall_s": plain.wall_s, "peak_rss_mb": plain.peak_rss_mb},
        "block_verify": {"exit": verified.returncode, "wall_s": verified.wall_s, "peak_rss_mb": verified.peak_rss_mb,
                         "verification": v.get("status"), "mode": v.get("mode"), "blocks": len(v.get("blocks", [])),
                         "time_ratio": verified.wall_s / max(plain.wall_s, 1e-9)},
        "split": {"exit": split.returncode, "wall_s": split.wall_s, "peak_rss_mb": split.peak_rss_mb,
                  "peak_over_model": split.peak_rss_mb * 2**20 / size, "stages": len(stages),
                  "stage_bytes": [s["bytes"] for s in stages], "layers": [s["layers"] for s in stages],
                  "cuts": [f"{c['kind']} {c['layer']} {c['part']}".strip() for c in manifest.get("cuts", [])],
                  "balance": manifest.get("balance"), "verification": (manifest.get("verification") or {}).get("status"),
                  "error": split.error[-300:] if split.returncode else ""},
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
