"""The in-memory IR question: onnx-graphsurgeon import + export vs onnx-ir (memory-mapped) load + save.

``python -m bench.ir_compare [--models llama-depth64,llama-3gb]`` runs each variant in a fresh process
(time per phase, peak RSS) and prints a markdown table:

- ``gs-eager``: ``onnx.load`` with all weights, ``gs.import_onnx``, ``gs.export_onnx``, ``onnx.save``;
- ``gs-lazy``: k3opt's own route through the ``k3opt.graph`` boundary: ``k3opt.modelio.load`` (external
  data left on disk), ``modelio.import_graph`` (``k3opt.graph``'s import, weights as lazy values),
  ``k3opt.modelio.export_graph`` (``k3opt.graph``'s export), ``k3opt.modelio.save`` (copies the weights to the output);
- ``onnx-ir-proto``: onnx-ir at that same boundary: ``k3opt.modelio.load``, ``onnx_ir.from_proto``,
  ``onnx_ir.to_proto``, ``k3opt.modelio.save`` (what replacing gs under ``k3opt.graph`` would cost);
- ``onnx-ir``: ``onnx_ir.load`` (weights memory-mapped), ``onnx_ir.save``: onnx-ir's own file route.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from .models import BIG, DEPTH_PREFIX, ModelSpec, cached_path, ensure_built
from .optimizers import PROTOBUF_SAFE, model_bytes
from .procs import python_module, ram_gib, run_measured, write_result

VARIANTS = ("gs-eager", "gs-lazy", "onnx-ir-proto", "onnx-ir")


def _gs_eager(src: Path, dst: Path, big: bool, lap) -> None:
    import onnx
    import onnx_graphsurgeon as gs

    model = onnx.load(str(src))
    lap("load")
    graph = gs.import_onnx(model)
    del model
    lap("import")
    out = gs.export_onnx(graph)
    lap("export")
    onnx.save(out, str(dst), save_as_external_data=big, location=dst.name + ".data")


def _gs_lazy(src: Path, dst: Path, big: bool, lap) -> None:
    from k3opt import modelio
    from k3opt.modelio import export_graph as export

    model = modelio.load(src)
    lap("load")
    graph = modelio.import_graph(model)
    lap("import")
    out = export(graph, model)
    lap("export")
    modelio.save(out, dst, external_data=big)


def _onnx_ir_proto(src: Path, dst: Path, big: bool, lap) -> None:
    import onnx_ir as ir
    from k3opt import modelio

    model = modelio.load(src)
    lap("load")
    graph = ir.from_proto(model)
    lap("import")
    out = ir.to_proto(graph)
    lap("export")
    modelio.save(out, dst, external_data=big)


def _onnx_ir(src: Path, dst: Path, big: bool, lap) -> None:
    import onnx_ir as ir

    model = ir.load(str(src))
    lap("load")
    ir.save(model, str(dst), external_data=dst.name + ".data" if big else None)


def worker(variant: str, src: Path) -> dict:
    """Run one variant into a scratch folder; returns seconds per phase and in total."""
    big = model_bytes(src) > PROTOBUF_SAFE
    phases: dict[str, float] = {}
    t0 = last = time.perf_counter()

    def lap(phase: str) -> None:
        nonlocal last
        now = time.perf_counter()
        phases[phase] = now - last
        last = now

    with tempfile.TemporaryDirectory(prefix="k3bench-ir-", dir=src.parent.parent) as tmp:
        run = {"gs-eager": _gs_eager, "gs-lazy": _gs_lazy, "onnx-ir-proto": _onnx_ir_proto, "onnx-ir": _onnx_ir}[variant]
        run(src, Path(tmp) / "out.onnx", big, lap)
        lap("save")
    return {"time_s": time.perf_counter() - t0, "phases": phases}


def compare(names: list[str], limits: dict) -> list[dict]:
    """Every variant on every model, each in its own measured process."""
    rows = []
    for name in names:
        path, err = ensure_built(ModelSpec(name, "llama"))
        for variant in VARIANTS:
            if path is None:
                rows.append({"model": name, "variant": variant, "status": "not built", "error": err})
                continue
            res = run_measured(python_module("bench.ir_compare", "--worker", variant, str(path)), **limits)
            rows.append({"model": name, "mbytes": model_bytes(path) / 1e6, "variant": variant, **res.to_dict()})
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: model, variant, status, total and per-phase seconds, peak RSS."""
    lines = ["| model | variant | status | total s | phases s | peak RSS MB |", "|---|---|---|---|---|---|"]
    for r in rows:
        pay = r.get("payload") or {}
        phases = ", ".join(f"{k} {v:.2f}" for k, v in pay.get("phases", {}).items())
        total = f"{pay['time_s']:.2f}" if "time_s" in pay else "-"
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('error', '')[:80]}"
        lines.append(f"| {r['model']} | {r['variant']} | {status} | {total} | {phases} | {r.get('peak_rss_mb', 0):.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: "list[str] | None" = None) -> None:
    """Parent: compare and print the table (``--json FILE`` also saves the rows). Child: ``--worker``."""
    ap = argparse.ArgumentParser(prog="python -m bench.ir_compare")
    ap.add_argument("--models", default=None, help=f"comma-separated (default llama-depth64, plus {BIG} if built)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--max-rss-gb", type=float, default=round(ram_gib() / 2, 1))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--worker", nargs=2, metavar=("VARIANT", "MODEL"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        write_result(worker(args.worker[0], Path(args.worker[1])))
        return
    names = args.models.split(",") if args.models else [f"{DEPTH_PREFIX}64"] + (
        [BIG] if cached_path(ModelSpec(BIG, "llama")).exists() else [])
    rows = compare(names, {"timeout_s": args.timeout, "max_rss_mb": args.max_rss_gb * 1024})
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    sys.stdout.write(table(rows))


if __name__ == "__main__":
    main()
