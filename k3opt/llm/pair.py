"""``build_pair``: write a serving pair (prefill + static decode graphs, one weights file, a manifest) and verify it.

The source is a decode-step ONNX export (Concat-grown KV cache) or a
transformers checkpoint folder / config JSON, exported first with
``k3opt.export.from_transformers(use_cache=True)``. Each graph is rewritten
(:mod:`k3opt.llm.rewrite`), then optimized by k3opt's pipeline for the
target (verified against the rewrite on real feeds), and the pair as a whole
must generate the same greedy tokens as the original step run in its own loop
(:func:`k3opt.llm.generate.original_greedy`): batch 1 and a left-padded batch
2, before anything is written. The output folder appears whole or not at all.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.external_data_helper import uses_external_data

from ..errors import InputError, OutputError, UsageError, VerificationError
from ..modelio.external import read_external_bytes
from ..targets import get_target
from .cache_form import CacheLayout, recognise
from .manifest import Manifest, Entry, batch_sizes
from .rewrite import POSITION, decode_graph, position_table, prefill_graph

WEIGHTS = "weights.bin"
#: Tensors at least this big go to the shared weights file (smaller ones stay in each graph).
_SHARED_MIN_BYTES = 1024
#: The generation check's size: prompt tokens and new tokens (kept small: it runs on every write).
CHECK_PROMPT, CHECK_STEPS = 5, 8


def load_source(source: Any, exporter: str = "torchscript", progress: Optional[Callable[[str], None]] = None
                ) -> tuple[onnx.ModelProto, Optional[int]]:
    """(decode-step model, positions its config allows or None) of ``source``: a ModelProto, an .onnx path, or a
    checkpoint folder / config JSON (exported first)."""
    if isinstance(source, onnx.ModelProto):
        return source, None
    path = Path(source)
    if not path.exists():
        raise InputError(f"{source}: no such file or folder")
    if path.is_dir() or path.suffix == ".json":
        from ..export import from_transformers
        from ..export.from_transformers import load_model

        if progress:
            progress("exporting the decode step")
        model = load_model(str(path), "text-generation", 0)
        limit = next((getattr(model.config, k) for k in ("max_position_embeddings", "n_positions")
                      if isinstance(getattr(model.config, k, None), int)), None)
        with tempfile.TemporaryDirectory(prefix=".k3opt-llm-") as tmp:
            out = Path(tmp) / "step.onnx"
            from_transformers(model, out, task="text-generation", use_cache=True, exporter=exporter,
                              optimize=False, seq_len=3)
            return onnx.load(str(out)), limit
    try:
        return onnx.load(str(path)), None
    except Exception as exc:  # onnx raises DecodeError, OSError...: one line either way
        raise InputError(f"{source}: not a readable ONNX model ({type(exc).__name__})") from None


def build_pair(source: Any, out_dir: Any, *, max_seq: int, max_batch: int = 1, target: str = "onnx",
               exporter: str = "torchscript", overwrite: bool = False, verify: bool = True,
               progress: Optional[Callable[[str], None]] = None) -> Manifest:
    """Write the pair of ``source`` into ``out_dir`` (see the module doc); returns its manifest."""
    if max_seq < 2:
        raise UsageError(f"--max-seq must be at least 2, not {max_seq}")
    if max_batch < 1:
        raise UsageError(f"--max-batch must be at least 1, not {max_batch}")
    found = get_target(target)
    out = Path(out_dir)
    _check_out_dir(out, overwrite)
    model, configured = load_source(source, exporter, progress)
    layout = recognise(model)
    limit = position_table(decode_graph(model, 2, 1))
    if limit is not None and max_seq > limit:
        raise UsageError(f"--max-seq {max_seq} is beyond the model's position table ({limit} positions)")
    if configured is not None and max_seq > configured:
        raise UsageError(f"--max-seq {max_seq} is beyond the model's max_position_embeddings ({configured})")
    say = progress or (lambda _: None)
    vocab = _vocab(model)
    say("writing the prefill graph")
    checks: dict[str, str] = {}
    prefill = _optimized(prefill_graph(model), target, verify, _prefill_feeds(layout, vocab), checks, "prefill.onnx")
    decodes = {}
    for b in batch_sizes(max_batch):
        say(f"writing the decode graph for batch {b}")
        decodes[b] = _optimized(decode_graph(model, max_seq, b), target, verify,
                                _decode_feeds(layout, model, max_seq, b, vocab), checks, f"decode_b{b}.onnx")
        found.bound_cache_reads(decodes[b], POSITION)  # checked with the tokens: under the reference ops
    logits = next(o.name for o in model.graph.output if o.name not in {e.present for e in layout.entries})
    manifest = Manifest(
        target=target, max_seq=max_seq, max_batch=max_batch,
        dtype=str(onnx.helper.tensor_dtype_to_np_dtype(layout.dtype)), vocab=vocab,
        names={"ids": layout.ids, "mask": layout.mask, "position": POSITION, "logits": logits},
        entries=[Entry(e.past, e.present, e.heads, e.dim) for e in layout.entries],
        prefill="prefill.onnx", decode={b: f"decode_b{b}.onnx" for b in decodes}, weights=WEIGHTS,
        verification={"status": "passed", "graphs": checks} if verify else {"status": "skipped",
                                                                            "reason": "--no-verify"})
    graphs = {manifest.prefill: prefill, **{manifest.decode[b]: g for b, g in decodes.items()}}

    def check(folder: Path) -> None:  # the token check's line joins the manifest, rewritten in the private folder
        from ..api import reference_evaluator
        from .generate import PairRunner, original_greedy

        say("checking generated tokens against the original decode step")
        evaluator = reference_evaluator(target)  # None: onnxruntime runs the files
        runner = PairRunner(folder, evaluator=evaluator)
        manifest.verification["tokens"] = check_tokens(
            lambda ids, mask, steps: original_greedy(model, ids, mask, steps), runner, "the original decode step's") \
            + (" under the reference NPU ops" if evaluator is not None else "")
        manifest.write(folder)

    _write_atomically(out, graphs, manifest, overwrite, check=check if verify else None)
    manifest.folder = out
    return manifest


def _optimized(model: onnx.ModelProto, target: str, verify: bool, feeds: dict, checks: dict[str, str],
               file: str) -> onnx.ModelProto:
    """``model`` through k3opt's pipeline for ``target``; its verification lines go to ``checks[file]``."""
    import k3opt
    from ..pipeline.verify import summary_line
    from ..report import Report

    report = Report()
    out = k3opt.optimize(model, target=target, verify=verify, input_data=feeds, report=report)
    lines = [summary_line(v) for v in (report.verification, report.lowering_verification) if v]
    checks[file] = "; lowered graph under the reference ops: ".join(lines)
    return out


def check_tokens(want: Callable[[np.ndarray, np.ndarray, int], np.ndarray], runner: Any, whose: str) -> str:
    """``runner`` (a PairRunner) generates the greedy tokens ``want(ids, mask, steps)`` gives (``whose``, for the
    error: "the original decode step's"): a prompt at batch 1, and a left-padded batch 2. Returns what was
    checked (the report's line); VerificationError at the first token that differs."""
    from .generate import left_pad

    m = runner.manifest
    steps = max(1, min(CHECK_STEPS, m.max_seq - CHECK_PROMPT + 1))
    prompt = min(CHECK_PROMPT, m.max_seq - 1)
    rng = np.random.default_rng(0)
    vocab = m.vocab or 2
    cases = [[rng.integers(1, vocab, prompt).tolist()]]
    if m.max_batch >= 2:
        cases.append([rng.integers(1, vocab, prompt).tolist(), rng.integers(1, vocab, max(1, prompt - 2)).tolist()])
    for prompts in cases:
        ids, mask = left_pad(prompts)
        wanted = want(ids, mask, steps)
        got = runner.generate(ids, mask, steps)
        if not np.array_equal(wanted, got):
            row, step = map(int, np.argwhere(wanted != got)[0])
            raise VerificationError(f"the pair's tokens differ from {whose} (batch {len(prompts)}, row {row}, step "
                                    f"{step}: {int(got[row, step])} instead of {int(wanted[row, step])})")
    batches = " and batch 2 left-padded" if len(cases) > 1 else ""
    return f"identical to {whose}: a {prompt}-token prompt at batch 1{batches}, {steps} greedy steps"


def _vocab(model: onnx.ModelProto) -> Optional[int]:
    """The vocabulary size: the logits' last dim, else the rows of the embedding table ``input_ids`` indexes."""
    for o in model.graph.output:
        dims = o.type.tensor_type.shape.dim
        if len(dims) == 3 and dims[2].dim_value:
            return int(dims[2].dim_value)
    inits = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Gather" and node.input[1] == "input_ids" and node.input[0] in inits:
            return int(inits[node.input[0]].dims[0])
    return None


def _prefill_feeds(layout: CacheLayout, vocab: Optional[int], batch: int = 2, length: int = 5) -> dict:
    rng = np.random.default_rng(1)
    mask = np.ones((batch, length), dtype=np.int64)
    mask[1:, :2] = 0
    return {layout.ids: rng.integers(0, vocab or 2, (batch, length)).astype(np.int64), layout.mask: mask}


def _decode_feeds(layout: CacheLayout, model: onnx.ModelProto, max_seq: int, batch: int,
                  vocab: Optional[int]) -> dict:
    rng = np.random.default_rng(2)
    dtype = onnx.helper.tensor_dtype_to_np_dtype(layout.dtype)
    mask = np.ones((batch, max_seq), dtype=np.int64)
    mask[1:, :1] = 0
    feeds = {layout.ids: rng.integers(0, vocab or 2, (batch, 1)).astype(np.int64), layout.mask: mask,
             POSITION: np.array([max_seq // 2], dtype=np.int64)}
    feeds.update({e.past: rng.standard_normal((batch, e.heads, max_seq, e.dim)).astype(dtype)
                  for e in layout.entries})
    return feeds


def _check_out_dir(out: Path, overwrite: bool) -> None:
    """Refuse a file, a non-empty folder (unless ``overwrite``), or a missing or unwritable parent folder."""
    from ..modelio.output_paths import check_output_path

    if out.exists() and not out.is_dir():
        raise OutputError(f"{out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputError(f"{out}: folder is not empty; pass --overwrite to replace it")
    check_output_path(out.with_name(out.name + ".new"))  # its parent: there and writable


def share_weights(graphs: dict[str, onnx.ModelProto], folder: Path) -> None:
    """Move every big initializer of ``graphs`` into ``folder/weights.bin``, each distinct tensor once."""
    offsets: dict[bytes, tuple[int, int]] = {}
    with open(folder / WEIGHTS, "wb") as f:
        for model in graphs.values():
            for t in model.graph.initializer:
                raw = read_external_bytes(t) if uses_external_data(t) else \
                    t.raw_data or numpy_helper.to_array(t).tobytes()
                if len(raw) < _SHARED_MIN_BYTES:
                    continue
                key = hashlib.sha256(raw).digest() + bytes([t.data_type])
                if key not in offsets:
                    pad = -f.tell() % 64
                    f.write(b"\0" * pad)
                    offsets[key] = (f.tell(), len(raw))
                    f.write(raw)
                offset, length = offsets[key]
                dims, dtype, name = list(t.dims), t.data_type, t.name
                t.Clear()
                t.name, t.data_type = name, dtype
                t.dims.extend(dims)
                t.data_location = onnx.TensorProto.EXTERNAL
                for k, v in (("location", WEIGHTS), ("offset", str(offset)), ("length", str(length))):
                    entry = t.external_data.add()
                    entry.key, entry.value = k, v


def _write_atomically(out: Path, graphs: dict[str, onnx.ModelProto], manifest: Manifest, overwrite: bool,
                      check: Optional[Callable[[Path], None]]) -> None:
    """Write into a private, locked folder next to ``out`` (modelio's TempFolder: one a SIGKILL leaves behind is
    removed by the next write of ``out``), check it there, then rename it into place."""
    from ..interrupts import deferred_signals
    from ..modelio.temp_folders import TempFolder

    temp = TempFolder.next_to(out)
    old: Optional[TempFolder] = None
    try:
        folder = temp.path / out.name
        folder.mkdir()
        share_weights(graphs, folder)
        for name, model in graphs.items():
            onnx.save(model, str(folder / name))
        manifest.write(folder)
        if check is not None:
            check(folder)
        if out.exists() and not overwrite:
            raise OutputError(f"{out}: appeared while the pair was written")
        with deferred_signals():  # the old folder out of the way and the new one in: never neither
            if out.exists():
                old = TempFolder.next_to(out)
                os.replace(out, old.path / out.name)
            os.replace(folder, out)
    except OSError as exc:
        raise OutputError(f"{out}: cannot write ({exc.strerror or exc})") from None
    finally:
        temp.remove()
        if old is not None:
            old.remove()
