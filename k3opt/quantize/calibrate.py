"""Calibration for GPTQ: each quantized MatMul's input statistics ``H = X^T X``, from the user's inputs.

The calibration file is a ``.npz`` of arrays named like the graph inputs (every input, as for
``--input-data``), the samples stacked along the first axis: ``input_ids`` ``(N, seq)`` is N sequences.
The model runs in onnxruntime on them a chunk of samples at a time, with the MatMuls' inputs exposed as
graph outputs, and each input's ``X^T X`` is accumulated in float64. The Hessians (``8 k^2`` bytes each)
are taken in passes of at most :data:`BUDGET` bytes, in graph order: a pass runs the model as quantized by
the passes before it, so a layer is calibrated on what the quantized layers before it really feed it,
as GPTQ's reference implementation does layer by layer.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Mapping, Union

import numpy as np
import onnx
from onnx import helper

from ..errors import InputError, UsageError
from ..graph import dtypes
from ..pipeline import verify
from ..pipeline.verify import first_line
from ..pipeline.verify_dims import declared_dims
from .select import Site

#: Most bytes of Hessians held at once (a pass); fewer when the free memory is short.
BUDGET = 2**30
#: Samples per run when the graph's first input dim is free.
CHUNK = 8

Calibration = Union[str, os.PathLike, Mapping[str, np.ndarray]]


def load(data: Calibration, model: onnx.ModelProto) -> list[dict[str, np.ndarray]]:
    """The feeds of each run: ``data`` (an .npz path or a dict) split along the first axis, checked against
    the graph inputs. InputError for an unreadable file, UsageError for arrays that do not fit the model."""
    label = f"--calibration-data {data if not isinstance(data, Mapping) else '(arrays)'}"
    if isinstance(data, Mapping):
        arrays = dict(data)
    else:
        try:
            with np.load(Path(data), allow_pickle=False) as npz:
                arrays = {k: npz[k] for k in npz.files}
        except Exception as exc:  # noqa: BLE001 - OSError, ValueError, BadZipFile...: any bad file
            raise InputError(f"{label}: cannot read a .npz of arrays ({first_line(exc)})") from None
    inits = {t.name for t in model.graph.initializer}
    inputs = [vi for vi in model.graph.input if vi.name not in inits]
    names = {vi.name for vi in inputs}
    if set(arrays) - names:
        raise UsageError(f"{label}: {', '.join(sorted(set(arrays) - names))} are not graph inputs")
    if names - set(arrays):
        raise UsageError(f"{label}: no array for the graph input(s) {', '.join(sorted(names - set(arrays)))}")
    shaped = {vi.name for vi in inputs if vi.type.tensor_type.HasField("shape")}
    dims = {k: v for k, v in declared_dims(model).items() if k in shaped}
    chunk, samples = CHUNK, set()
    for vi in inputs:
        array = arrays[vi.name]
        want = dims.get(vi.name)
        if array.ndim == 0 or (want is not None and len(want) != array.ndim):
            raise UsageError(f"{label}: '{vi.name}' has shape {list(array.shape)}, the graph input has rank "
                             f"{len(want) if want is not None else 'at least 1'} (samples go along the first axis)")
        try:
            arrays[vi.name] = array.astype(dtypes.numpy_dtype(vi.type.tensor_type.elem_type), copy=False)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"{label}: '{vi.name}' cannot be the input's type ({first_line(exc)})") from None
        samples.add(array.shape[0])
        if want and isinstance(want[0], int) and want[0] > 0:
            chunk = want[0]
    if len(samples) != 1:
        raise UsageError(f"{label}: the arrays' first axes (the samples) differ: {sorted(samples)}")
    total = samples.pop()
    if total == 0 or total % chunk and chunk != CHUNK:
        raise UsageError(f"{label}: {total} samples, not a whole number of the model's batch of {chunk}")
    return [{k: v[a:a + chunk] for k, v in arrays.items()} for a in range(0, total, chunk)]


def _inputs(site: Site) -> list[str]:
    """The activations ``x`` of ``x @ W`` at each MatMul/Gemm reading the site's weight."""
    return [node.input[0] for node in site.users]


def passes(model: onnx.ModelProto, sites: list[Site]) -> list[list[Site]]:
    """``sites`` in graph order, cut into runs whose Hessians fit in :data:`BUDGET` (and in free memory)."""
    order = {id(node): i for i, node in enumerate(model.graph.node)}
    sites = sorted(sites, key=lambda s: min(order.get(id(u), 0) for u in s.users))
    budget = min(BUDGET, verify.available_memory() // 4)
    out: list[list[Site]] = [[]]
    held, seen = 0, set()
    for site in sites:
        t = next(x for x in model.graph.initializer if x.name == site.name)
        k = t.dims[1] if site.transposed else t.dims[0]
        new = set(_inputs(site)) - seen
        if out[-1] and held + 8 * k * k * len(new) > budget:
            out.append([])
            held, seen, new = 0, set(), set(_inputs(site))
        out[-1].append(site)
        held += 8 * k * k * len(new)
        seen |= new
    return out


def hessians(model: onnx.ModelProto, sites: list[Site], feeds: list[dict[str, np.ndarray]],
             label: str) -> Iterator[tuple[Site, np.ndarray, int]]:
    """Each site with ``X^T X / rows`` of its inputs over all ``feeds`` and the rows (tokens) it was summed
    over: the model runs with those inputs exposed as outputs (its outputs restored afterwards).
    UsageError when it does not run on the feeds."""
    g = model.graph
    inits = {t.name for t in g.initializer}
    dtype = {s.name: next(t.data_type for t in g.initializer if t.name == s.name) for s in sites}
    wanted = {x: dtype[s.name] for s in sites for x in _inputs(s) if x not in inits}
    kept = list(g.output)
    try:
        del g.output[:]
        g.output.extend(helper.make_tensor_value_info(x, t, None) for x, t in wanted.items())
        try:
            sess = verify.session(model)
        except Exception as exc:  # noqa: BLE001 - Unrunnable, or ORT's own pybind exception types
            raise UsageError(f"{label}: calibration needs the model to run in onnxruntime: {first_line(exc)}") from None
    finally:
        del g.output[:]
        g.output.extend(kept)
    sums = {x: None for x in wanted}
    rows = dict.fromkeys(wanted, 0)
    for feed in feeds:
        try:
            got = verify.run(sess, feed)
        except Exception as exc:  # noqa: BLE001 - ORT raises its own pybind exception types
            raise UsageError(f"{label}: the model does not run on the calibration data ({first_line(exc)})") from None
        for x, value in zip(wanted, got):
            v = value.reshape(-1, value.shape[-1]).astype(np.float64)
            sums[x] = v.T @ v if sums[x] is None else sums[x] + v.T @ v
            rows[x] += v.shape[0]
    for site in sites:
        xs = [x for x in _inputs(site) if x in wanted]
        if xs:
            count = sum(rows[x] for x in xs)
            yield site, sum(sums[x] for x in xs) / max(count, 1), count
