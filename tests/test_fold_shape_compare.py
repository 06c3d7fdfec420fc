"""fold-constants: Equal of a shape computation folds when every element pair is decided (dims are never negative)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T, helper

import k3opt
from tests.helpers import assert_equivalent, make_model, op_counts, run_ort
from tests.test_fold_constants import fold
from tests.zoo import needs_torch, zoo_inputs, zoo_model

F, I64 = T.FLOAT, T.INT64


def _expand_model(x_shape: list, probe: list[int], dims: tuple[int, ...] = (0, 1),
                  reshape_to: "list[int] | None" = None) -> onnx.ModelProto:
    """TorchScript's expand spelling: Where(Equal(Concat(dims of x..., 4), probe), 1, shape), then Expand;
    ``reshape_to``: the Concat goes through ``Reshape(shape, reshape_to)`` first (as in the Llama export)."""
    nodes = [helper.make_node("Shape", ["x"], ["s"])]
    pieces = []
    for k, d in enumerate(dims):
        nodes += [
            helper.make_node("Gather", ["s", f"i{k}"], [f"g{k}"], axis=0),
            helper.make_node("Unsqueeze", [f"g{k}", "ax"], [f"u{k}"]),
        ]
        pieces.append(f"u{k}")
    concat = "shape" if reshape_to is None else "pieces"
    nodes.append(helper.make_node("Concat", pieces + ["four"], [concat], axis=0))
    if reshape_to is not None:
        nodes.append(helper.make_node("Reshape", ["pieces", "to"], ["shape"]))
    nodes += [
        helper.make_node("Equal", ["shape", "probe"], ["eq"]),
        helper.make_node("Where", ["eq", "ones", "shape"], ["target"]),
        helper.make_node("Expand", ["x", "target"], ["y"]),
    ]
    n = len(dims) + 1
    inits = {f"i{k}": np.int64(d) for k, d in enumerate(dims)}
    inits.update(ax=np.int64([0]), four=np.int64([4]), probe=np.int64(probe), ones=np.ones(n, np.int64))
    if reshape_to is not None:
        inits["to"] = np.int64(reshape_to)
    return make_model(nodes, [("x", F, x_shape)], [("y", F, ["a", "b", "c"])], inits, opset=14)


def test_equal_of_dynamic_dims_and_negative_constant_folds():
    model = _expand_model(["N", "S", 1], [-1, -1, -1])
    out, _ = fold(model)
    assert "Equal" not in op_counts(out)
    assert_equivalent(model, out)
    assert_equivalent(model, out, feeds={"x": np.random.rand(3, 5, 1).astype(np.float32)})


@pytest.mark.parametrize("to", [[-1], [3]])
def test_equal_of_a_reshaped_shape_vector_folds_in_one_run(to):
    """``Reshape(shape, [-1])`` keeps the elements: the Equal folds before remove-noop-ops drops the Reshape."""
    model = _expand_model(["N", "S", 1], [-1, -1, -1], reshape_to=to)
    out, _ = fold(model)
    assert "Equal" not in op_counts(out)
    assert_equivalent(model, out, feeds={"x": np.random.rand(3, 5, 1).astype(np.float32)})


@pytest.mark.parametrize("to", [[1, 3], [2]], ids=["2-D", "wrong-length"])
def test_equal_of_a_reshape_to_another_layout_is_refused(to):
    model = _expand_model(["N", "S", 1], [-1, -1, -1], reshape_to=to)
    out, _ = fold(model)
    assert op_counts(out)["Equal"] == 1


def test_equal_with_known_elements_compares_them():
    model = _expand_model(["N", 2, 1], [-1, 2, 4])  # mixed result: [False, True, True]
    out, _ = fold(model)
    assert "Equal" not in op_counts(out)
    assert_equivalent(model, out)


@pytest.mark.parametrize("probe", [[0, -1, -1], [-1, 5, -1]], ids=["zero-vs-dynamic", "nonneg-vs-dynamic"])
def test_equal_refused_when_a_dynamic_dim_may_match(probe):
    model = _expand_model(["N", "S", 1], probe)
    out, _ = fold(model)
    assert op_counts(out)["Equal"] == 1
    assert_equivalent(model, out)


def test_equal_refused_when_shapes_differ():
    """A 1-element probe broadcasts: the element lists are not compared pairwise."""
    model = _expand_model(["N", "S", 1], [-1])
    out, _ = fold(model)
    assert op_counts(out)["Equal"] == 1
    assert_equivalent(model, out)


def test_equal_of_non_shape_input_refused():
    nodes = [helper.make_node("Equal", ["a", "probe"], ["eq"]), helper.make_node("Cast", ["eq"], ["y"], to=F)]
    model = make_model(nodes, [("a", I64, [2])], [("y", F, [2])], {"probe": np.int64([-1, -1])})
    out, _ = fold(model)
    assert op_counts(out)["Equal"] == 1


@needs_torch
def test_llama_torchscript_expand_probes_fold():
    """Every ``Equal(shape, -1)`` of the Llama TorchScript export's expands folds (5 nodes fewer; 260 -> 255)."""
    model = onnx.load(zoo_model("llama", "torchscript"))
    assert op_counts(model)["Equal"] == 5
    out = k3opt.optimize(model)
    assert "Equal" not in op_counts(out)
    feeds = zoo_inputs("llama")
    for a, b in zip(run_ort(model, feeds), run_ort(out, feeds)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
