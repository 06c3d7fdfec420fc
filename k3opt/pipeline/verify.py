"""Verification: run the original and the optimized model in onnxruntime on the same inputs.

Inputs are seeded and dtype/range aware (token ids below the vocabulary size
when an input indexes an embedding Gather, ones for masks) or come from the
user's .npz. A model onnxruntime cannot run is skipped with a reason; a
divergence is reported per output and bisected to the first pass that
caused it (see :func:`first_diverging_step`).
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np
import onnx
from onnx.external_data_helper import uses_external_data

from ..errors import InputError, InvalidOutputError, UnverifiableError, UsageError
from ..graph import dtypes
from ..graph.gs_roundtrip import unique_names
from ..graph.wire import copy_fields
from ..modelio import PROTO_LIMIT, all_tensors, inline_copy, proto_size, tensor_nbytes
from . import verify_dims

#: Default (rtol, atol) by output element type; other floats use fp32's.
TOLERANCES = {
    np.dtype(np.float32): (1e-4, 1e-5),
    np.dtype(np.float64): (1e-4, 1e-5),
    np.dtype(np.float16): (1e-2, 1e-3),
}
_PASSTHROUGH = {"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Expand"}
_UNSUPPORTED = ("not a registered function/op", "Could not find an implementation", "NOT_IMPLEMENTED")


class Unrunnable(Exception):
    """onnxruntime cannot run this model (unknown op, too big); verification is skipped."""


def available_memory() -> int:
    """Bytes of memory available now (psutil when installed, else sysconf)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover - psutil is a test dependency only
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def runnable_bytes(model: onnx.ModelProto) -> bytes:
    """The model serialized with its external data inlined, ready for onnxruntime.

    Raises Unrunnable when that would pass the protobuf limit or the free memory.
    """
    size = proto_size(model)
    if size > PROTO_LIMIT:
        raise Unrunnable(f"model is {size / 2**30:.1f} GB, over what onnxruntime can load from memory")
    if 3 * size > available_memory():
        raise Unrunnable(f"model ({size / 2**20:.0f} MB) would not fit in free memory twice")
    if not any(uses_external_data(t) for t in all_tensors(model)):
        return model.SerializeToString()
    inlined = onnx.ModelProto()
    inlined.CopyFrom(model)
    for t in all_tensors(inlined):
        if uses_external_data(t):
            t.CopyFrom(inline_copy(t))
    return inlined.SerializeToString()


#: Initializers of at least this many bytes are fed to a session built from a proto at each run, not serialized
#: into the model it loads (:func:`session`).
FED_BYTES = 1 << 16
#: Element types numpy holds, which onnxruntime takes as inputs (not bfloat16, float8, int4 or strings).
_T = onnx.TensorProto
_FEEDABLE = frozenset((_T.FLOAT, _T.DOUBLE, _T.FLOAT16, _T.INT8, _T.INT16, _T.INT32, _T.INT64, _T.UINT8, _T.UINT16,
                       _T.UINT32, _T.UINT64, _T.BOOL))


class FedSession:
    """An onnxruntime session of a model whose big weights are graph inputs, fed with every run.

    onnxruntime copies the weights of a model it loads from bytes (the bytes, their parse, its tensors:
    about three times the weights while it loads, on top of k3opt's proto), but runs on the arrays it is
    fed: the weights then cost one copy (issue #26 item 9: a 245 MB Llama verified at 2 GB peak).
    """

    def __init__(self, session: Any, weights: dict[str, np.ndarray]):
        self.session = session
        self.weights = weights

    def run(self, names: Optional[Sequence[str]], feeds: Mapping[str, Any], options: Any = None) -> list:
        return self.session.run(names, {**feeds, **self.weights}, options)

    def get_inputs(self) -> list:
        return [i for i in self.session.get_inputs() if i.name not in self.weights]

    def get_outputs(self) -> list:
        return self.session.get_outputs()


def session(model: Union[bytes, onnx.ModelProto, Path], load_only: bool = False):
    """An onnxruntime CPU session with graph optimizations off (we compare our rewrites, not ORT's).

    A Path is loaded by onnxruntime from the file (external data from its folder, so over 2 GB too). A proto's
    big initializers are fed at each run (:class:`FedSession`). Weights are never prepacked (a copy of each
    MatMul's weight that speeds up repeated runs: verification runs a model a few times on small inputs).
    ``load_only``: the session will not run, so skip what only speeds runs up (thread pool, spinning,
    memory arena and patterns): a fraction of a full session's cost on a deep model.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 4  # errors come back as exceptions (one line each): ORT need not log them too
    so.add_session_config_entry("session.disable_prepacking", "1")
    if load_only:
        so.intra_op_num_threads = so.inter_op_num_threads = 1
        so.enable_cpu_mem_arena = so.enable_mem_pattern = False
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    weights: dict[str, np.ndarray] = {}
    if isinstance(model, onnx.ModelProto):
        data, weights = _weights_apart(model)
    else:
        data = model if isinstance(model, bytes) else str(model)
    try:
        # no fallback: a failed CPU session is not retried on the CPU (ORT prints that retry on stdout)
        made = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"], enable_fallback=0)
    except Exception as exc:  # ORT raises its own pybind exception types
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if any(s in str(exc) for s in _UNSUPPORTED):
            raise Unrunnable(f"onnxruntime cannot run it: {msg[:300]}") from None
        raise
    return FedSession(made, weights) if weights else made


def _weights_apart(model: onnx.ModelProto) -> tuple[bytes, dict[str, np.ndarray]]:
    """``model`` serialized with its big initializers turned into graph inputs, and their values (read from
    external data as needed). Raises Unrunnable when the weights would not fit in free memory twice."""
    declared = {i.name for i in model.graph.input}
    fed = [t for t in model.graph.initializer
           if t.name not in declared and t.data_type in _FEEDABLE and tensor_nbytes(t) >= FED_BYTES]
    if not fed:
        return runnable_bytes(model), {}
    size = proto_size(model)
    if 2 * size > available_memory():
        raise Unrunnable(f"model ({size / 2**20:.0f} MB) would not fit in free memory twice")
    light = onnx.ModelProto()
    copy_fields(model, light, skip=("graph",))
    copy_fields(model.graph, light.graph, skip=("initializer",))
    names = {t.name for t in fed}
    light.graph.initializer.extend(inline_copy(t) if uses_external_data(t) else t
                                   for t in model.graph.initializer if t.name not in names)
    light.graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in fed)
    for t in all_tensors(light):  # a body's or a Constant's external weights, inlined as runnable_bytes does
        if uses_external_data(t):
            t.CopyFrom(inline_copy(t))
    weights = {t.name: _array(t) for t in fed}
    return light.SerializeToString(), weights


def _array(t: onnx.TensorProto) -> np.ndarray:
    """The value of a model's initializer; one whose bytes do not fit its type and shape is the input's fault."""
    try:
        return onnx.numpy_helper.to_array(inline_copy(t) if uses_external_data(t) else t)
    except ValueError as exc:
        raise InputError(f"tensor '{t.name}': its data does not fit its type and shape ({exc})") from None


def check_loads(path: Path, ran: bool = False) -> Optional[str]:
    """Load the model file ``path`` in onnxruntime and hold it to onnx's checker: the check of an output before
    it is renamed into place (onnxruntime runs graphs the checker rejects, e.g. an unknown attribute or an
    untyped graph output: k3opt's output must pass both).

    Optimizations off, so it costs a fraction of the run. Where onnxruntime
    lacks an op or kernel of the model (a custom domain, say), onnx's checker
    alone judges the file and the returned warning says so; else None.
    ``ran``: onnxruntime already ran this graph (the verification passed), so
    onnx's checker alone reads the file back: a second session would hold
    about 2.7x the weights in memory (112 MiB more on the 64-layer Llama).
    Raises InvalidOutputError when the file does not load.
    """
    fallback = None
    if not ran:
        try:
            session(path, load_only=True)
        except Unrunnable as exc:
            fallback = str(exc)
        except Exception as exc:  # noqa: BLE001 - ORT raises its own pybind exception types
            why = first_line(exc).replace(str(path), path.name)  # the temporary folder means nothing to the user
            if out_of_memory(exc) or isinstance(exc, ImportError):  # the machine's fault: neither model's
                raise UnverifiableError(f"cannot check the written model: onnxruntime ran out of memory ({why}); "
                                        "nothing was written") from None
            raise InvalidOutputError(f"the optimized model does not load in onnxruntime ({why}); "
                                     "nothing was written") from None
    try:
        onnx.checker.check_model(str(path))
    except Exception as exc:  # noqa: BLE001 - onnx raises ValidationError, or a C++ error for a bad file
        raise InvalidOutputError(f"the optimized model fails onnx's checker ({first_line(exc)}); "
                                 "nothing was written") from None
    return None if fallback is None else f"the written model was checked with onnx's checker only: {fallback}"


def reference_session(model: onnx.ModelProto):
    """A session of the original ``model``; one whose only fault is node names used twice (onnxruntime refuses
    them; names compute nothing, and k3opt's output has unique ones) runs with the names made unique, in
    ``model`` itself (k3opt's working copy)."""
    try:
        return session(model)
    except Unrunnable:
        raise
    except Exception as exc:  # noqa: BLE001 - ORT's own error types
        if "same node name" not in str(exc) or not _unique_node_names(model.graph):
            raise
    return session(model)


def _unique_node_names(graph: onnx.GraphProto) -> bool:
    """Rename nodes whose name an earlier node of ``graph`` has; whether any was renamed."""
    names = unique_names([n.name for n in graph.node])
    renamed = False
    for node, name in zip(graph.node, names):
        renamed |= node.name != name
        node.name = name
    return renamed


def load_fault(path: Union[Path, bytes]) -> Optional[str]:
    """Why onnxruntime does not load the model file ``path`` (or serialized model) (None: it loads, or lacks one
    of its ops).

    Asked only when an output fails to load, to blame the input when it fails too (exit 2, not 1).
    """
    try:
        session(path, load_only=True)
    except Unrunnable:
        return None
    except Exception as exc:  # noqa: BLE001 - ORT raises its own pybind exception types
        return None if out_of_memory(exc) or isinstance(exc, ImportError) else first_line(exc)
    return None


_OUT_OF_MEMORY = ("bad_alloc", "Failed to allocate", "out of memory", "MemoryError", "Cannot allocate memory",
                  "pthread_create failed", "failed to map segment")


def out_of_memory(exc: BaseException) -> bool:
    """Whether onnxruntime (or numpy) failed for want of memory: the machine's fault, not the model's."""
    return isinstance(exc, MemoryError) or any(s in str(exc) for s in _OUT_OF_MEMORY)


def first_line(exc: BaseException) -> str:
    """An exception's first message line (its type when it has no message), at most 300 characters."""
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]


# --------------------------------------------------------------------------- inputs


def make_feeds(
    model: onnx.ModelProto, *, seed: int = 0, input_data: Optional[Union[str, os.PathLike, Mapping]] = None,
    symbolic_dim: int = 2, declared: Optional[Mapping[str, Sequence[Any]]] = None,
    run: Optional[Callable[[dict[str, np.ndarray]], list]] = None,
) -> verify_dims.Feeds:
    """One array per graph input: the user's (``input_data``: .npz path or dict) or seeded random ones.

    Symbolic dims get consistent sizes, ``symbolic_dim`` where the graph
    leaves them free (see :mod:`k3opt.pipeline.verify_dims`; ``declared`` are the
    input dims before ``--input-shape``). With ``run`` the sizes are searched
    until the original runs: raises verify_dims.NoConsistentSizes when none does.
    ``feeds.again(base, run)`` gives feeds at other sizes, chosen the same way.
    """
    user = _load_input_data(input_data)
    inits = {t.name for t in model.graph.initializer}
    limits = _index_limits(model.graph)
    types = {vi.name: dtypes.numpy_dtype(vi.type.tensor_type.elem_type)
             for vi in model.graph.input if vi.name not in inits}
    unknown = set(user) - set(types)
    if unknown:
        raise UsageError(f"--input-data names {', '.join(sorted(unknown))}, which are not graph inputs")
    shaped = {vi.name for vi in model.graph.input if vi.type.tensor_type.HasField("shape")}
    dims = {k: v for k, v in verify_dims.declared_dims(model).items() if k in shaped}
    user = {k: _user_array(k, v, types[k], dims.get(k)) for k, v in user.items()}

    def build(shapes: Mapping[str, list[int]]) -> dict[str, np.ndarray]:
        made = {name: (shapes[name], dtype) for name, dtype in types.items() if name not in user}
        need = sum(math.prod(shape) * dtype.itemsize for shape, dtype in made.values())
        if need > available_memory() // 2:  # sized before any is made: a declared dim of 2**40 allocates nothing
            what = ", ".join(f"'{n}' {list(shape)}" for n, (shape, _) in made.items())
            raise UnverifiableError(f"verification cannot run: its random inputs ({what[:200]}) would take "
                                    f"{need / 2**20:.0f} MB, over half the free memory; nothing was written "
                                    "(--input-shape or --input-data give smaller inputs; --no-verify writes the "
                                    "model unverified)")
        rng = np.random.default_rng(seed)
        return {name: user[name] if name in user else _random_input(name, dtype, shapes[name], limits.get(name), rng)
                for name, dtype in types.items()}

    return verify_dims.choose(model, build, declared=declared, given={k: v.shape for k, v in user.items()},
                              base=symbolic_dim, run=run)


def _load_input_data(input_data: Optional[Union[str, os.PathLike, Mapping]]) -> dict[str, np.ndarray]:
    if input_data is None:
        return {}
    if isinstance(input_data, Mapping):
        return dict(input_data)
    try:
        npz = np.load(Path(input_data), allow_pickle=False)
        if not hasattr(npz, "files"):  # a bare .npy: one array without a name
            raise ValueError("one array (.npy), not a .npz of arrays named like the graph inputs")
        with npz:
            return {k: npz[k] for k in npz.files}
    except Exception as exc:  # noqa: BLE001 - OSError, ValueError, BadZipFile, EOFError...: any bad file
        raise InputError(f"--input-data {input_data}: cannot read input data ({first_line(exc)})") from None


def _user_array(name: str, value: Any, dtype: np.dtype, dims: Optional[Sequence[Any]]) -> np.ndarray:
    """The user's array for input ``name`` in its dtype, refused (UsageError) when it cannot be that input."""
    try:
        array = np.asarray(value).astype(dtype, copy=False)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"--input-data: '{name}' cannot be {dtype} ({first_line(exc)})") from None
    if dims is not None:
        fixed = [d if isinstance(d, int) and d > 0 else None for d in dims]
        if len(fixed) != array.ndim or any(f is not None and f != n for f, n in zip(fixed, array.shape)):
            wanted = "[" + ", ".join("?" if f is None else str(f) for f in fixed) + "]"
            raise UsageError(f"--input-data: '{name}' has shape {list(array.shape)}, the graph input takes {wanted}")
    return array


def _random_input(name: str, dtype: np.dtype, shape: list[int], limit: Optional[int], rng) -> np.ndarray:
    if "mask" in name.lower():
        return np.ones(shape, dtype=dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(0, limit or 8, shape).astype(dtype)
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(shape).astype(dtype)
    return np.zeros(shape, dtype=dtype)


def _index_limits(graph: onnx.GraphProto) -> dict[str, int]:
    """For inputs used (maybe through Cast/Reshape...) as Gather indices into a constant: its row count."""
    consts = {t.name: list(t.dims) for t in graph.initializer}
    for n in graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].HasField("t"):
            consts[n.output[0]] = list(n.attribute[0].t.dims)
    users: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for x in n.input:
            users.setdefault(x, []).append(n)
    limits: dict[str, int] = {}
    for vi in graph.input:
        frontier, seen = [vi.name], set()
        while frontier:
            name = frontier.pop()
            seen.add(name)
            for n in users.get(name, []):
                if n.op_type == "Gather" and len(n.input) > 1 and n.input[1] == name and n.input[0] in consts:
                    axis = next((a.i for a in n.attribute if a.name == "axis"), 0)
                    dims = consts[n.input[0]]
                    if dims:
                        size = dims[axis]
                        limits[vi.name] = min(limits.get(vi.name, size), size)
                elif n.op_type in _PASSTHROUGH and n.input[0] == name and n.output[0] not in seen:
                    frontier.append(n.output[0])
    return limits


# --------------------------------------------------------------------------- comparing


def compare(
    expected: Sequence[np.ndarray], actual: Sequence[np.ndarray], names: Sequence[str], *,
    rtol: Optional[float] = None, atol: Optional[float] = None, random: Optional[Mapping[str, str]] = None,
) -> dict[str, Any]:
    """Per-output errors; ``status`` is "passed" or "failed".

    ``random``: outputs whose values change on every run (name -> the random node they depend on,
    :mod:`.random_outputs`): compared by shape and element type only.

    An element passes when ``|actual - expected| <= atol + rtol * |expected|``.
    Each output records ``tol_fraction``, the worst element's error divided by
    its own allowance (the figure the decision is made on: passed iff <= 1),
    ``max_abs``, and ``max_rel`` (error over ``|expected|``, huge near zeros:
    kept for the JSON report, not shown).
    """
    outputs = []
    ok = True
    for name, a, b in zip(names, expected, actual):
        a, b = np.asarray(a), np.asarray(b)
        default_rtol, default_atol = TOLERANCES.get(a.dtype, (1e-4, 1e-5))
        r = default_rtol if rtol is None else rtol
        t = default_atol if atol is None else atol
        entry: dict[str, Any] = {"name": name, "dtype": str(a.dtype), "rtol": r, "atol": t}
        if a.shape != b.shape:
            entry.update(max_abs=float("inf"), max_rel=float("inf"), tol_fraction=float("inf"), passed=False,
                         detail=f"shape {list(b.shape)} instead of {list(a.shape)}")
        elif random and name in random:
            same = a.dtype == b.dtype
            worst = 0.0 if same else float("inf")
            entry.update(max_abs=worst, max_rel=worst, tol_fraction=worst, passed=same,
                         detail=f"values not compared: random ({random[name]})" if same
                         else f"element type {b.dtype} instead of {a.dtype}")
        elif not np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_:
            same = bool(np.array_equal(a, b))
            worst = 0.0 if same else float("inf")
            entry.update(max_abs=worst, max_rel=worst, tol_fraction=worst, passed=same)
        else:
            a64, b64 = a.astype(np.float64), b.astype(np.float64)
            both_nan = np.isnan(a64) & np.isnan(b64)
            # inf - inf and inf / inf are nan: no warning on stderr (equal infinities are equal, the rest inf)
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                diff = np.where(both_nan | (a64 == b64), 0.0, np.abs(a64 - b64))
                # an infinite expected value allows anything by rtol: only the same infinity matches it
                diff = np.where(np.isnan(diff) | (np.isinf(a64) & (diff != 0)), np.inf, diff)
                rel = diff / np.maximum(np.abs(a64), np.finfo(np.float64).tiny)
                allowed = t + r * np.abs(a64)
                fraction = np.where(diff == 0, 0.0, diff / allowed)  # allowed is 0 only with atol 0
            entry.update(
                max_abs=float(diff.max(initial=0.0)),
                max_rel=float(np.where(diff == 0, 0.0, rel).max(initial=0.0)),
                tol_fraction=float(np.nan_to_num(fraction, nan=np.inf, posinf=np.inf).max(initial=0.0)),
                passed=bool(np.all(both_nan | (diff == 0) | (np.isfinite(diff) & (diff <= allowed)))),
            )
        ok = ok and entry["passed"]
        outputs.append(entry)
    if len(expected) != len(actual):
        ok = False
    used_rtol = max((o["rtol"] for o in outputs), default=rtol or 1e-4)
    used_atol = max((o["atol"] for o in outputs), default=atol or 1e-5)
    return {"status": "passed" if ok else "failed", "outputs": outputs, "rtol": used_rtol, "atol": used_atol,
            "tol_fraction": max((o["tol_fraction"] for o in outputs), default=0.0),
            "max_abs": max((o["max_abs"] for o in outputs), default=0.0)}


def error_figures(o: Mapping[str, Any]) -> str:
    """``worst 0.23 of tolerance, max abs err 4.8e-07`` for one output (or a whole result) of :func:`compare`."""
    return f"worst {o['tol_fraction']:.2g} of tolerance, max abs err {o['max_abs']:.3g}"


def summary_line(v: Mapping[str, Any]) -> str:
    """The report's verification line: status, the worst element against its tolerance, the tolerances."""
    if not v["outputs"]:
        return f"{v['status']} ({v.get('reason', 'no outputs compared')})"
    count = len(v["outputs"])
    return (f"{v['status']} ({count} output{'s' if count > 1 else ''}; {error_figures(v)}; "
            f"rtol {v['rtol']:g}, atol {v['atol']:g})")


def failure_detail(v: Mapping[str, Any]) -> str:
    """What a failed comparison says in the error line: the reason, or the first failing output's figures."""
    if v.get("reason"):
        return v["reason"]
    bad = [o for o in v["outputs"] if not o["passed"]]
    if not bad:
        return "output count differs"
    o = bad[0]
    return f"output '{o['name']}': {error_figures(o)} (rtol {o['rtol']:g}, atol {o['atol']:g})"



def skipped(reason: str) -> dict[str, Any]:
    """The verification record of a run that could not be verified."""
    return {"status": "skipped", "reason": reason, "outputs": []}


def failed(reason: str, rtol: Optional[float], atol: Optional[float]) -> dict[str, Any]:
    """The verification record of an optimized model that could not be compared output by output."""
    return {"status": "failed", "reason": reason, "outputs": [], "rtol": rtol or 0.0, "atol": atol or 0.0}


def run(sess, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """Outputs of an onnxruntime session, as a list in graph order (a failing run raises, without ORT's log line)."""
    import onnxruntime as ort

    quiet = ort.RunOptions()
    quiet.log_severity_level = 4  # the exception carries the message; sizes being searched fail by design
    return sess.run(None, dict(feeds), quiet)


def first_diverging_step(candidates: Sequence[int], diverges: Callable[[int], bool]) -> Optional[int]:
    """Smallest step count in sorted ``candidates`` whose result ``diverges`` (binary search).

    ``candidates`` are the step counts worth trying (after each step that
    rewrote something); the last one is assumed to diverge.
    """
    lo, hi = 0, len(candidates) - 1
    if hi < 0:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if diverges(candidates[mid]):
            hi = mid
        else:
            lo = mid + 1
    return candidates[lo]
