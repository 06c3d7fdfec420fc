"""Shared test helpers: hand-made graphs, running passes, and numeric comparison with onnxruntime."""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
from onnx import TensorProto, helper

from k3opt import modelio
from k3opt.pipeline.pass_base import Pass, PassContext
from k3opt.pipeline.manager import PassManager
from k3opt.targets import get_target

_NP = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16, TensorProto.DOUBLE: np.float64,
       TensorProto.INT64: np.int64, TensorProto.INT32: np.int32, TensorProto.BOOL: np.bool_}


def make_model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[tuple],
    outputs: Sequence[tuple],
    initializers: Optional[dict[str, np.ndarray]] = None,
    opset: int = 17,
    extra_opsets: Iterable[tuple[str, int]] = (),
) -> onnx.ModelProto:
    """A checked model from nodes; inputs/outputs are ``(name, elem_type, shape)`` tuples."""
    inits = [onnx.numpy_helper.from_array(np.asarray(v), k) for k, v in (initializers or {}).items()]
    graph = helper.make_graph(
        list(nodes),
        "test",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs],
        inits,
    )
    imports = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, v) for d, v in extra_opsets]
    model = helper.make_model(graph, opset_imports=imports)
    model.ir_version = min(model.ir_version, 10)
    onnx.checker.check_model(model)
    return model


def import_graph(model: onnx.ModelProto) -> gs.Graph:
    """``model``'s graph as ``k3opt.optimize`` imports it (k3opt's fast import, not gs's), from a copy: the
    graph shares TensorProtos with the model it was imported from."""
    own = onnx.ModelProto()
    own.CopyFrom(model)
    return modelio.import_graph(own)


def export_graph(graph: gs.Graph, model: onnx.ModelProto) -> onnx.ModelProto:
    """``graph`` cleaned up, sorted and exported as ``k3opt.optimize`` does it (k3opt's fast export), with
    ``model``'s metadata and opset imports."""
    return modelio.export_graph(graph, model)


def run_passes(model: onnx.ModelProto, passes: Sequence[Pass], target: str = "onnx") -> tuple[onnx.ModelProto, PassManager, PassContext]:
    """Run ``passes`` to a fixed point on a copy of ``model``, imported and exported as ``k3opt.optimize``
    does it; returns (model, manager, ctx)."""
    graph = import_graph(model)
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    ctx = PassContext(opset=opset, target=get_target(target))
    pm = PassManager(list(passes))
    pm.run(graph, ctx)
    return export_graph(graph, model), pm, ctx


def random_feeds(model: onnx.ModelProto, seed: int = 0, dims: int = 2) -> dict[str, np.ndarray]:
    """Seeded random inputs for every graph input; symbolic dims become ``dims``."""
    rng = np.random.default_rng(seed)
    inits = {i.name for i in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else dims for d in tt.shape.dim]
        dtype = _NP[tt.elem_type]
        if np.issubdtype(dtype, np.floating):
            feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype == np.bool_:
            feeds[vi.name] = rng.integers(0, 2, shape).astype(bool)
        else:
            feeds[vi.name] = rng.integers(0, 8, shape).astype(dtype)
    return feeds


def run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Outputs of ``model`` in onnxruntime with every graph optimization off."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def assert_equivalent(
    original: onnx.ModelProto, optimized: onnx.ModelProto, *, rtol: float = 1e-4, atol: float = 1e-5,
    feeds: Optional[dict[str, np.ndarray]] = None, seed: int = 0,
) -> None:
    """Both models give the same outputs (names and values) on the same seeded inputs."""
    feeds = feeds if feeds is not None else random_feeds(original, seed)
    assert [o.name for o in original.graph.output] == [o.name for o in optimized.graph.output]
    for a, b in zip(run_ort(original, feeds), run_ort(optimized, feeds)):
        np.testing.assert_allclose(b, a, rtol=rtol, atol=atol)


def op_counts(model: onnx.ModelProto) -> dict[str, int]:
    """How many nodes of each op type the main graph has."""
    return graph_op_counts(model.graph)


def graph_op_counts(graph: onnx.GraphProto) -> dict[str, int]:
    """How many nodes of each op type ``graph`` has (not counting its bodies)."""
    counts: dict[str, int] = {}
    for n in graph.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return counts


def body_op_counts(model: onnx.ModelProto, attr: str) -> dict[str, int]:
    """:func:`graph_op_counts` of the body ``attr`` (then_branch, body...) of the main graph's first node."""
    return graph_op_counts(next(a.g for a in model.graph.node[0].attribute if a.name == attr))


def assert_value_info_holds(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> None:
    """Every shape the model declares (inputs, value_info, outputs) is what onnxruntime computes:
    fixed dims equal, and one symbol stands for one size throughout the graph."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    declared = list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output)
    outputs = {o.name for o in model.graph.output}
    probe.graph.output.extend(vi for vi in model.graph.value_info if vi.name not in outputs)
    actual = dict(zip([o.name for o in probe.graph.output], run_ort(probe, feeds)))
    actual.update(feeds)
    sizes: dict[str, int] = {}
    for vi in declared:
        if vi.name not in actual or not vi.type.tensor_type.HasField("shape"):
            continue
        dims, shape = vi.type.tensor_type.shape.dim, actual[vi.name].shape
        assert len(dims) == len(shape), f"{vi.name}: declared rank {len(dims)}, actual shape {shape}"
        for d, n in zip(dims, shape):
            if d.HasField("dim_value"):
                assert d.dim_value == n, f"{vi.name}: declared {d.dim_value}, actual shape {shape}"
            elif d.dim_param:
                assert sizes.setdefault(d.dim_param, n) == n, \
                    f"{vi.name}: symbol {d.dim_param} is {n} here, {sizes[d.dim_param]} elsewhere"


def assert_optimizes_within(path, feeds: dict[str, np.ndarray], max_nodes: int) -> onnx.ModelProto:
    """``k3opt.optimize(path)`` has at most ``max_nodes`` nodes and the original's outputs on ``feeds``."""
    import k3opt

    model = onnx.load(path)
    out = k3opt.optimize(model)
    assert len(out.graph.node) <= max_nodes
    for a, b in zip(run_ort(model, feeds), run_ort(out, feeds)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
    return out
