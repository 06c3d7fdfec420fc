"""k3opt.optimize on every zoo export: exact (vs the original and vs torch), idempotent, and the issue-#4 invariants.

Invariants checked on each optimized model: no decomposed LayerNorm left and
as many LayerNormalization nodes as the torch model has nn.LayerNorm modules;
no MatMul(x, constant W) + per-column constant bias pair left (optimized with
``matmul_add_nd="flatten"``, the form that fuses rank > 2 activations too);
no activation read by MatMuls with constant weights whose merge would save a node (siblings merged);
no Identity and no node whose outputs nobody reads.
"""
from __future__ import annotations

import functools
import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import k3opt
from tests.helpers import op_counts, run_ort
from tests.zoo import (max_rel_err, needs_torch, torch_outputs, zoo_inputs, zoo_model, zoo_params,
                       zoo_torch_model)

pytestmark = needs_torch

PAIRS = zoo_params()

@functools.lru_cache(maxsize=None)
def optimized(name: str, exporter: str, **options) -> onnx.ModelProto:
    """``k3opt.optimize`` of a zoo export (cached per run: several tests read the same result)."""
    return k3opt.optimize(str(zoo_model(name, exporter)), **options)


def flattened(name: str, exporter: str) -> onnx.ModelProto:
    """Optimized with rank > 2 MatMul+Add fused too (the default leaves them for --target onnx)."""
    return optimized(name, exporter, matmul_add_nd="flatten")


# ---- graph queries on a ModelProto -------------------------------------------------------------------------

def _constants(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Constant tensor name -> shape (initializers and Constant nodes with a tensor value)."""
    shapes = {t.name: tuple(t.dims) for t in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant":
            value = next((a.t for a in n.attribute if a.name == "value"), None)
            shapes[n.output[0]] = tuple(value.dims) if value is not None else ()
    return shapes


def _consumers(model: onnx.ModelProto) -> dict[str, list[onnx.NodeProto]]:
    uses: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        for i in n.input:
            uses.setdefault(i, []).append(n)
    return uses


def decomposed_layernorms(model: onnx.ModelProto) -> list[str]:
    """ReduceMean -> Sub(x, mean) -> Pow(d, 2) or Mul(d, d): the centred variance of a LayerNorm, unfused."""
    uses = _consumers(model)
    found = []
    for n in model.graph.node:
        if n.op_type != "ReduceMean":
            continue
        for sub in (u for u in uses.get(n.output[0], []) if u.op_type == "Sub" and u.input[1] == n.output[0]):
            d = sub.output[0]
            if any(u.op_type == "Pow" or (u.op_type == "Mul" and u.input[0] == u.input[1] == d)
                   for u in uses.get(d, [])):
                found.append(n.name)
    return found


def unfused_matmul_bias(model: onnx.ModelProto) -> list[str]:
    """MatMul(x, constant 2-D W) whose only reader is an Add with a constant per-column bias."""
    consts, uses = _constants(model), _consumers(model)
    found = []
    for n in model.graph.node:
        w = consts.get(n.input[1]) if n.op_type == "MatMul" else None
        readers = uses.get(n.output[0], []) if w is not None and len(w) == 2 else []
        if len(readers) != 1 or readers[0].op_type != "Add":
            continue
        bias = consts.get(next(i for i in readers[0].input if i != n.output[0]))
        if bias is not None and bias and bias[-1] == w[1] and all(d == 1 for d in bias[:-1]):
            found.append(n.name)
    return found


def unmerged_siblings(model: onnx.ModelProto) -> list[str]:
    """Activations read (as A) by MatMuls with constant 2-D weights whose merge would save a node: three or
    more, or two that each feed a bias Add (a plain pair, SwiGLU's gate/up, is left alone by design)."""
    consts, uses = _constants(model), _consumers(model)
    biased = set(unfused_matmul_bias(model))
    found = []
    for t, readers in uses.items():
        siblings = [r for r in readers
                    if r.op_type == "MatMul" and r.input[0] == t and len(consts.get(r.input[1], ())) == 2]
        if len(siblings) > 2 or (len(siblings) == 2 and all(r.name in biased for r in siblings)):
            found.append(t)
    return found


def dead_or_identity(model: onnx.ModelProto) -> list[str]:
    """Identity nodes, and nodes none of whose outputs is read or a graph output."""
    read = set(_consumers(model)) | {o.name for o in model.graph.output}
    return [f"{n.op_type} {n.name}" for n in model.graph.node
            if n.op_type == "Identity" or not any(o and o in read for o in n.output)]


def torch_layernorms(name: str) -> int:
    import torch

    return sum(isinstance(m, torch.nn.LayerNorm) for m in zoo_torch_model(name).modules())


def _signature(model: onnx.ModelProto) -> tuple:
    return (tuple((n.op_type, tuple(n.input), tuple(n.output)) for n in model.graph.node),
            tuple(sorted(t.name for t in model.graph.initializer)))


# ---- tests -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,exporter", PAIRS)
def test_outputs_match_original_and_torch(name: str, exporter: str) -> None:
    original = onnx.load(zoo_model(name, exporter))
    for model in (optimized(name, exporter), flattened(name, exporter)):
        for feeds in (zoo_inputs(name), zoo_inputs(name, batch=3, seq=5, seed=1)):
            got = run_ort(model, feeds)
            assert max_rel_err(got, run_ort(original, feeds)) < 1e-4
            assert max_rel_err(got, torch_outputs(name, feeds)) < 1e-4


@pytest.mark.parametrize("name,exporter", PAIRS)
def test_idempotent(name: str, exporter: str) -> None:
    once = optimized(name, exporter)
    twice = k3opt.optimize(once)
    assert _signature(twice) == _signature(once)
    for a, b in zip(once.graph.initializer, twice.graph.initializer):
        np.testing.assert_array_equal(numpy_helper.to_array(a), numpy_helper.to_array(b))


@pytest.mark.parametrize("name,exporter", PAIRS)
def test_layernorms_fused(name: str, exporter: str) -> None:
    model = optimized(name, exporter)
    assert not decomposed_layernorms(model)
    assert op_counts(model).get("LayerNormalization", 0) == torch_layernorms(name)


@pytest.mark.parametrize("name,exporter", PAIRS)
def test_matmul_bias_pairs_fused(name: str, exporter: str) -> None:
    assert not unfused_matmul_bias(flattened(name, exporter))


@pytest.mark.parametrize("name,exporter", PAIRS)
def test_sibling_projections_merged(name: str, exporter: str) -> None:
    assert not unmerged_siblings(optimized(name, exporter))


@pytest.mark.parametrize("name,exporter", PAIRS)
def test_no_identity_or_dead_node(name: str, exporter: str) -> None:
    assert not dead_or_identity(optimized(name, exporter))


def test_invariant_checks_see_what_they_look_for() -> None:
    """The queries above find each leftover in the raw TorchScript BERT export (so a pass is what removes it)."""
    raw = onnx.load(zoo_model("bert", "torchscript"))
    assert len(decomposed_layernorms(raw)) == 5
    assert unfused_matmul_bias(raw) and unmerged_siblings(raw)

