"""The optimizers under test, each a function ``(src, dst, model_type) -> extra figures or None``.

``python -m bench.optimizers NAME SRC DST MODEL_TYPE`` is the worker: it times load + optimize + save
(each tool loads and saves its own way: that is part of what is measured) and reports the time to
:func:`bench.procs.run_measured`, which measures the process's wall time and peak RSS from outside.
Models with weights in external data are written with external data (``<dst>.data``).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable, Optional

import onnx

from .procs import write_result

PROTOBUF_SAFE = 1_800_000_000


def model_bytes(path: Path) -> int:
    """Size of a model file plus every external-data file it references."""
    model = onnx.load(str(path), load_external_data=False)
    files = {path}
    for init in model.graph.initializer:
        for entry in init.external_data:
            if entry.key == "location":
                files.add(path.parent / entry.value)
    return sum(f.stat().st_size for f in files if f.exists())


def _external(src: Path) -> bool:
    """Write the result with external data: the source is beyond what one protobuf can hold."""
    return model_bytes(src) > PROTOBUF_SAFE


def _save(model: onnx.ModelProto, dst: Path, external: bool) -> None:
    if external:
        onnx.save(model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=dst.name + ".data", size_threshold=1024)
    else:
        onnx.save(model, str(dst))


def run_k3opt(src: Path, dst: Path, model_type: str) -> Optional[dict]:
    """k3opt's streaming file API when present (its report's phase timings and pass stats are kept),
    else its CLI entry point in this process."""
    import k3opt

    if hasattr(k3opt, "optimize_file"):
        report = k3opt.optimize_file(str(src), str(dst))
        data = report.as_dict() if hasattr(report, "as_dict") else {}
        return {"k3opt": {key: data[key] for key in ("timings", "passes") if key in data}}
    from k3opt.cli import main

    try:
        main(["optimize", "--no-verify", "-q", str(src), "-o", str(dst)])
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise RuntimeError(f"k3opt optimize exited with {exc.code}") from None
    return None


def run_onnxsim(src: Path, dst: Path, model_type: str) -> None:
    """onnxsim from the path, saving through its own large-model route."""
    import onnxsim

    model, _ = onnxsim.simplify(str(src), output_path=str(dst))
    if not dst.exists():
        _save(model, dst, _external(src))


def run_onnxslim(src: Path, dst: Path, model_type: str) -> None:
    """onnxslim with its defaults."""
    import onnxslim

    onnxslim.slim(str(src), str(dst), save_as_external_data=_external(src))


def run_onnxoptimizer(src: Path, dst: Path, model_type: str) -> None:
    """onnxoptimizer's fuse-and-eliminate pass list (it may abort the process: that is a result)."""
    import onnxoptimizer

    model = onnxoptimizer.optimize(onnx.load(str(src)), onnxoptimizer.get_fuse_and_elimination_passes())
    _save(model, dst, _external(src))


def run_onnxscript(src: Path, dst: Path, model_type: str) -> None:
    """onnxscript's optimizer then its default rewrite rules, on the memory-mapped onnx-ir model."""
    import onnx_ir as ir
    import onnxscript.optimizer
    import onnxscript.rewriter

    model = ir.load(str(src))
    onnxscript.optimizer.optimize(model)
    model = onnxscript.rewriter.rewrite(model)
    ir.save(model, str(dst), external_data=dst.name + ".data" if _external(src) else None)


def run_ort_transformers(src: Path, dst: Path, model_type: str) -> None:
    """onnxruntime.transformers' optimizer with its default level for the model type (bert, vit, gpt2)."""
    from onnxruntime.transformers.optimizer import optimize_model

    opt = optimize_model(str(src), model_type=model_type, num_heads=0, hidden_size=0)
    opt.save_model_to_file(str(dst), use_external_data_format=_external(src))


def run_ort_basic(src: Path, dst: Path, model_type: str) -> None:
    """onnxruntime's offline basic-level optimization (``optimized_model_filepath``)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.optimized_model_filepath = str(dst)
    if _external(src):
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", dst.name + ".data")
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])


OPTIMIZERS: dict[str, Callable[[Path, Path, str], Optional[dict]]] = {
    "k3opt": run_k3opt,
    "onnxsim": run_onnxsim,
    "onnxslim": run_onnxslim,
    "onnxoptimizer": run_onnxoptimizer,
    "onnxscript": run_onnxscript,
    "ort-transformers": run_ort_transformers,
    "ort-basic": run_ort_basic,
}
SUBJECT = "k3opt"


def main(argv: list[str]) -> None:
    """Worker entry: optimize ``SRC`` into ``DST`` with optimizer ``NAME`` and report the time taken."""
    name, src, dst, model_type = argv
    t0 = time.perf_counter()
    extra = OPTIMIZERS[name](Path(src), Path(dst), model_type)
    elapsed = time.perf_counter() - t0
    if not Path(dst).exists():
        raise RuntimeError(f"{name} wrote no output file")
    write_result({"time_s": elapsed, **(extra or {})})


if __name__ == "__main__":
    main(sys.argv[1:])
