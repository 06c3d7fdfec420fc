"""Issue #34's question: onnxruntime's symbolic shape inference or k3opt's own (``k3opt.graph.symbolic``)?

``python -m bench.symbolic_infer [--models llama-depth64-op14] [--rounds 5]`` runs, in fresh processes and
interleaved, per model:

- ``ort-symbolic``: ``onnxruntime.tools.symbolic_shape_infer.SymbolicShapeInference.infer_shapes(model,
  auto_merge=True)`` once, CPU seconds of that call alone (the model already loaded);
- ``k3opt``: ``k3opt.optimize_file`` (no verification), CPU seconds of the whole run, how many times it
  inferred shapes (each a point where onnxruntime's inference would have to run again to stay current), and
  the CPU seconds spent answering the passes' questions to its symbolic reasoning (``Dims.at``,
  ``Dims.elements``, ``Dims.fold`` asked from outside a trace, the bookkeeping of the timing included).

and prints the medians as a markdown table with the ratio of one onnxruntime inference to k3opt's whole run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from .models import ModelSpec, ensure_built
from .procs import python_module, run_measured, write_result

VARIANTS = ("ort-symbolic", "k3opt")


def _ort_symbolic(src: Path) -> dict:
    import onnx
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    model = onnx.load(str(src))
    start = time.process_time()
    SymbolicShapeInference.infer_shapes(model, auto_merge=True)
    return {"cpu_s": time.process_time() - start}


def _k3opt(src: Path) -> dict:
    import k3opt
    from k3opt.graph.symbolic.dims import Dims
    from k3opt.pipeline.shapes import ShapeRefresher

    counts = {"inferences": 0, "dims_s": 0.0}
    refresh = ShapeRefresher._refresh

    def counted(self, *args, **kwargs):
        counts["inferences"] += 1
        return refresh(self, *args, **kwargs)

    def timed(method):
        def asked(self, *args, **kwargs):
            if self.memo._computing:  # within a trace: counted by the question that started it
                return method(self, *args, **kwargs)
            start = time.process_time()
            try:
                return method(self, *args, **kwargs)
            finally:
                counts["dims_s"] += time.process_time() - start
        return asked

    ShapeRefresher._refresh = counted
    for name in ("at", "elements", "fold"):
        setattr(Dims, name, timed(getattr(Dims, name)))
    with tempfile.TemporaryDirectory() as tmp:
        start = time.process_time()
        k3opt.optimize_file(str(src), str(Path(tmp) / "out.onnx"))
        return {"cpu_s": time.process_time() - start, **counts}


def compare(names: list[str], rounds: int, timeout_s: float) -> dict[str, dict[str, list[dict]]]:
    """Each model's payloads per variant, the variants interleaved round by round."""
    found: dict[str, dict[str, list[dict]]] = {}
    for name in names:
        path, err = ensure_built(ModelSpec(name, "llama"))
        if path is None:
            raise SystemExit(f"{name}: not built ({err})")
        found[name] = {v: [] for v in VARIANTS}
        for _ in range(rounds):
            for variant in VARIANTS:
                res = run_measured(python_module("bench.symbolic_infer", "--worker", variant, str(path)), timeout_s)
                if res.status != "ok":
                    raise SystemExit(f"{name} {variant}: {res.status} {res.error}")
                found[name][variant].append(res.payload)
    return found


def table(found: dict[str, dict[str, list[dict]]]) -> str:
    """Markdown: medians per model."""
    lines = ["| model | onnxruntime symbolic inference, CPU s | k3opt optimize, CPU s | ratio | k3opt shape "
             "inferences | k3opt symbolic questions, CPU s |", "|---|---|---|---|---|---|"]
    for name, runs in found.items():
        ort = statistics.median(p["cpu_s"] for p in runs["ort-symbolic"])
        k3 = statistics.median(p["cpu_s"] for p in runs["k3opt"])
        inferences = statistics.median(p["inferences"] for p in runs["k3opt"])
        dims = statistics.median(p["dims_s"] for p in runs["k3opt"])
        lines.append(f"| {name} | {ort:.2f} | {k3:.2f} | {ort / k3:.2f} | {inferences:.0f} | {dims:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: "list[str] | None" = None) -> None:
    """Parent: compare and print the table (``--json FILE`` also saves the payloads). Child: ``--worker``."""
    ap = argparse.ArgumentParser(prog="python -m bench.symbolic_infer")
    ap.add_argument("--models", default="llama-depth64-op14", help="comma-separated bench model names")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--worker", nargs=2, metavar=("VARIANT", "MODEL"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        write_result((_ort_symbolic if args.worker[0] == "ort-symbolic" else _k3opt)(Path(args.worker[1])))
        return
    found = compare(args.models.split(","), args.rounds, args.timeout)
    if args.json:
        args.json.write_text(json.dumps(found, indent=1))
    sys.stdout.write(table(found))


if __name__ == "__main__":
    main()
