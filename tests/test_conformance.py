"""The ONNX node conformance cases (``onnx.backend.test.case.node``) through k3opt.

(a) Every case whose original runs in onnxruntime gives the same outputs
    after ``k3opt.optimize`` (default pipeline, the case's own opset); where
    onnxruntime agrees with the reference outputs, that is the reference.
(b) With every test input turned into an initializer, fold-constants and the
    clean-ups fold the graph to the reference outputs, fully (no compute
    node left), in at least 1,460 cases (issue #17); no case crashes, and no folded
    value is wrong. Where onnxruntime itself departs from the reference
    (DFT, STFT, some Resize modes, out-of-range int4 casts...), folding
    follows the runtime: the folded value must then equal what onnxruntime
    computes from the original model.

Run ``python -m tests.test_conformance`` for the per-case list.
"""
from __future__ import annotations

import copy
import functools
import warnings
from typing import Optional

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import k3opt
from k3opt.errors import K3optError
from k3opt.passes.fold._eval import run_model

pytestmark = pytest.mark.slow

FOLD_PASSES = [
    "fold-constants", "remove-identity", "remove-dropout", "remove-noop-ops", "merge-cast-chains",
    "merge-transposes", "merge-reshapes", "sequence-to-split", "eliminate-common-subexpressions",
    "remove-dead-nodes",
]
MIN_FULLY_FOLDED = 1460  # issue #17's floor; onnx 1.23: 1,832 of 1,884


@functools.cache
def cases() -> list:
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [c for c in collect_testcases() if c.kind == "node"]


def _value(v: object) -> object:
    """A test-data value as numpy (TensorProto and numpy scalars converted; sequences kept)."""
    if isinstance(v, onnx.TensorProto):
        return numpy_helper.to_array(v)
    if isinstance(v, np.generic):
        return np.asarray(v)
    return v


def _opset(model: onnx.ModelProto) -> Optional[int]:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)


def _close(got: object, want: object, case) -> bool:
    """``got`` equals ``want`` within the case's tolerance (dtype and shape exact); sequences item by item."""
    got, want = _value(got), _value(want)
    if isinstance(want, list) or want is None:
        return isinstance(got, list) and _all_close(got, want, case) if want is not None else got is None
    if not isinstance(got, np.ndarray) or not isinstance(want, np.ndarray):
        return False
    if got.shape != want.shape or (got.dtype != want.dtype and want.dtype != object):
        return False
    if want.dtype == object or want.dtype.kind in "biuSU":
        return bool(np.array_equal(got, want))
    try:
        g, w = got.astype(np.float64), want.astype(np.float64)
    except (TypeError, ValueError):
        return bool(np.array_equal(got, want))
    return bool(np.allclose(g, w, rtol=case.rtol, atol=case.atol, equal_nan=True))


def _all_close(got: list, want: list, case) -> bool:
    return len(got) == len(want) and all(_close(g, w, case) for g, w in zip(got, want))


def _ort(model: onnx.ModelProto, feeds: dict) -> Optional[list]:
    """onnxruntime's outputs (exotic dtypes widened exactly), or None when it cannot run the model."""
    try:
        return run_model(model, feeds)
    except Exception:  # onnxruntime lacks the op/type, or rejects the model
        return None


def _feeds(case) -> dict:
    return {vi.name: _value(v) for vi, v in zip(case.model.graph.input, case.data_sets[0][0])}


def _optimize(model: onnx.ModelProto, passes: Optional[list[str]] = None) -> onnx.ModelProto:
    return k3opt.optimize(model, passes=passes, opset=_opset(model))


# -- (a) -------------------------------------------------------------------------

def check_optimize(case) -> str:
    """'skip' (onnxruntime cannot run the original), 'refused' (a K3optError), 'unsupported' (fails with no
    pass either), 'same', or a failure text."""
    feeds = _feeds(case)
    before = _ort(case.model, feeds)
    if before is None:
        return "skip"
    try:
        out = _optimize(case.model)
    except K3optError:
        return "refused"
    except Exception as exc:  # noqa: BLE001
        if _pipeline_fails(case.model):
            return f"unsupported by the pipeline without passes: {type(exc).__name__}"
        return f"FAIL: crash {type(exc).__name__}: {exc}"[:300]
    after = _ort(out, {k: v for k, v in feeds.items() if k in {i.name for i in out.graph.input}})
    if after is None:
        return "FAIL: onnxruntime cannot run the optimized model"
    return "same" if _all_close(after, before, case) else "FAIL: outputs differ"


# -- (b) -------------------------------------------------------------------------

def inputs_to_initializers(case) -> onnx.ModelProto:
    """The case's model with every tensor input (first data set) as an initializer."""
    model = copy.deepcopy(case.model)
    keep = []
    for vi, v in zip(list(model.graph.input), case.data_sets[0][0]):
        if isinstance(v, onnx.TensorProto):
            t = copy.deepcopy(v)
            t.name = vi.name
        elif isinstance(_value(v), np.ndarray):
            t = numpy_helper.from_array(_value(v), vi.name)
        else:
            keep.append(vi)
            continue
        if t.data_type != vi.type.tensor_type.elem_type:
            keep.append(vi)
            continue
        model.graph.initializer.append(t)
    del model.graph.input[:]
    model.graph.input.extend(keep)
    return model


def _runtime_agrees(got: list, model: onnx.ModelProto, feeds: dict, case) -> bool:
    """``got`` is what onnxruntime computes from the unfolded ``model`` (where it departs from the reference)."""
    runtime = _ort(model, feeds)
    return runtime is not None and _all_close(got, runtime, case)


def _folded_values(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    values = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant" and n.attribute[0].name == "value":
            values[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    return values


def check_fold(case) -> str:
    """'full' / 'full-runtime' (fully folded, equal to the reference / to onnxruntime), 'partial',
    'refused' (a K3optError), or a failure text ('CRASH ...', 'WRONG ...')."""
    model = inputs_to_initializers(case)
    expected = list(case.data_sets[0][1])
    try:
        out = _optimize(model, FOLD_PASSES)
    except K3optError:
        return "refused"
    except Exception as exc:  # noqa: BLE001 - every other exception is a crash to report
        if _pipeline_fails(model):
            return f"unsupported by the pipeline without passes: {type(exc).__name__}"
        return f"CRASH {type(exc).__name__}: {exc}"[:300]
    left = sorted({n.op_type for n in out.graph.node if n.op_type != "Constant"})
    if left:
        feeds = {k: v for k, v in _feeds(case).items() if k in {i.name for i in out.graph.input}}
        got = _ort(out, feeds)
        if got is not None and not _all_close(got, expected, case) and not _runtime_agrees(got, model, feeds, case):
            return "WRONG (partially folded)"
        return "partial " + ",".join(left)
    values = _folded_values(out)
    got = [values.get(o.name) for o in out.graph.output]
    if _all_close(got, expected, case):
        return "full"
    if _runtime_agrees(got, model, {}, case):
        return "full-runtime"
    return "WRONG (fully folded)"


def _pipeline_fails(model: onnx.ModelProto) -> bool:
    """True when ``k3opt.optimize`` fails even with no pass (import/export, not folding, is the limit)."""
    try:
        _optimize(model, [])
    except Exception:  # noqa: BLE001
        return True
    return False


@functools.cache
def fold_results() -> dict[str, str]:
    return {c.name: check_fold(c) for c in cases()}


def test_optimize_keeps_onnxruntime_outputs():
    results = {c.name: check_optimize(c) for c in cases()}
    counts = _tally(results)
    print(f"\n(a) k3opt.optimize on {len(results)} conformance cases: {counts}")
    failures = {k: v for k, v in results.items() if v.startswith("FAIL")}
    assert not failures, failures
    assert counts.get("same", 0) > 1000


def test_constant_inputs_fold_fully_and_exactly():
    results = fold_results()
    counts = _tally(results)
    fully = counts.get("full", 0) + counts.get("full-runtime", 0)
    print(f"\n(b) {fully} of {len(results)} conformance cases fully folded: {counts}")
    bad = {k: v for k, v in results.items() if v.startswith(("CRASH", "WRONG"))}
    assert not bad, bad
    assert fully >= MIN_FULLY_FOLDED


def _tally(results: dict[str, str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for v in results.values():
        key = v.split(" ")[0].rstrip(":")
        counts[key] = counts.get(key, 0) + 1
    return counts


if __name__ == "__main__":
    for name, result in fold_results().items():
        if result != "full":
            print(name, result)
    print(_tally(fold_results()))
