"""Shape arithmetic over a KV cache's length: Concat sums along the cache axis, Add of a dim and a number.

The present keys and values of every layer are ``past + new`` long; once that
is known, the Shape/Gather chains reading them are one value, and TorchScript's
``Equal(shape, -1)`` over ``past + 1`` folds. On the decode zoo models k3opt
then leaves fewer nodes than onnxsim and onnxslim.
"""
from __future__ import annotations

import contextlib
import io

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T, helper

import k3opt
from k3opt.graph.symbolic.algebra import dim_sum
from k3opt.report import Report
from k3opt.pipeline.shapes import fix_inputs
from tests.helpers import assert_equivalent, make_model, op_counts
from tests.zoo import needs_torch, zoo_decode_inputs, zoo_decode_model

F, I64 = T.FLOAT, T.INT64


@pytest.mark.parametrize("parts,want", [
    ([2, 3], 5), (["past", 1], "past + 1"), ([1, "past"], "past + 1"), (["past + 1", "new"], "new + past + 1"),
    (["past_sequence + sequence", 0], "past_sequence + sequence"), (["s", None], None),
])
def test_dim_sum_is_canonical(parts, want) -> None:
    assert dim_sum(parts) == want


def _cache_step() -> onnx.ModelProto:
    """Two caches (k and v) grown by one step each; each reshaped by a shape read from its own present."""
    nodes = []
    for part in ("k", "v"):
        nodes += [helper.make_node("Concat", [f"past_{part}", f"new_{part}"], [f"present_{part}"], axis=2),
                  helper.make_node("Shape", [f"present_{part}"], [f"shape_{part}"]),
                  helper.make_node("Gather", [f"shape_{part}", "two"], [f"len_{part}"]),
                  helper.make_node("Unsqueeze", [f"len_{part}", "zero1"], [f"len1_{part}"]),
                  helper.make_node("Concat", ["lead", f"len1_{part}", "eight"], [f"target_{part}"], axis=0),
                  helper.make_node("Reshape", [f"present_{part}", f"target_{part}"], [f"flat_{part}"])]
    nodes.append(helper.make_node("Add", ["flat_k", "flat_v"], ["y"]))
    inits = {"two": np.array(2), "zero1": np.array([0]), "lead": np.array([-1]), "eight": np.array([8])}
    cache = lambda name, length: (name, F, [1, 2, length, 8])  # noqa: E731
    model = make_model(nodes, [cache("past_k", "past"), cache("new_k", 1), cache("past_v", "past"), cache("new_v", 1)],
                       [("y", F, [None, None, 8]), ("present_k", F, [1, 2, "Concatpresent_k_dim_2", 8]),
                        ("present_v", F, [1, 2, "Concatpresent_v_dim_2", 8])], inits)
    return model


def _feeds(past: int) -> dict:
    rng = np.random.default_rng(past)
    return {n: rng.standard_normal((1, 2, past if n.startswith("past") else 1, 8)).astype(np.float32)
            for n in ("past_k", "new_k", "past_v", "new_v")}


def test_present_lengths_are_one_value() -> None:
    """The exporter names the two presents' lengths apart; both are past + 1: one Shape/Gather chain is left."""
    model = _cache_step()
    out = k3opt.optimize(model)
    assert op_counts(out)["Shape"] == 1 and op_counts(out)["Gather"] == 1 and op_counts(out)["Concat"] == 3
    for past in (1, 4):
        assert_equivalent(model, out, feeds=_feeds(past))


def test_equal_over_past_plus_one_folds() -> None:
    """TorchScript's expand: Where(Equal(shape, -1), 1, shape) with shape [1, past + 1]: the Equal is all False."""
    nodes = [helper.make_node("Shape", ["past"], ["s"]), helper.make_node("Gather", ["s", "one"], ["p"]),
             helper.make_node("Add", ["p", "one"], ["total"]), helper.make_node("Unsqueeze", ["total", "zero1"], ["t1"]),
             helper.make_node("Concat", ["one1", "t1"], ["shape"], axis=0),
             helper.make_node("Equal", ["shape", "minus1"], ["is_neg"]),
             helper.make_node("Where", ["is_neg", "ones", "shape"], ["target"]),
             helper.make_node("Expand", ["x", "target"], ["y"])]
    inits = {"one": np.array(1), "zero1": np.array([0]), "one1": np.array([1]), "minus1": np.array([-1, -1]),
             "ones": np.array([1, 1])}
    model = make_model(nodes, [("past", F, [1, "past"]), ("x", F, [1, 1])], [("y", F, [1, None])], inits)
    out = k3opt.optimize(model)
    assert "Equal" not in op_counts(out)
    feeds = {"past": np.zeros((1, 3), np.float32), "x": np.ones((1, 1), np.float32)}
    assert_equivalent(model, out, feeds=feeds)


def test_add_of_a_dim_and_a_negative_number_is_not_an_element() -> None:
    """past - 1 may be -1 (an empty cache): the Equal with -1 must stay."""
    nodes = [helper.make_node("Shape", ["past"], ["s"]), helper.make_node("Gather", ["s", "one"], ["p"]),
             helper.make_node("Add", ["p", "minus1"], ["q"]), helper.make_node("Equal", ["q", "minus1"], ["y"])]
    model = make_model(nodes, [("past", F, [1, "past"])], [("y", T.BOOL, [])],
                       {"one": np.array(1), "minus1": np.array(-1)})
    out = k3opt.optimize(model)
    assert "Equal" in op_counts(out)
    assert_equivalent(model, out, feeds={"past": np.zeros((1, 0), np.float32)})


def _peer_counts(path: str) -> dict[str, int]:
    onnxsim = pytest.importorskip("onnxsim")
    onnxslim = pytest.importorskip("onnxslim")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return {"onnxsim": len(onnxsim.simplify(onnx.load(path))[0].graph.node),
                "onnxslim": len(onnxslim.slim(onnx.load(path)).graph.node)}


@needs_torch
@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("new", [None, 1], ids=["dynamic", "one-token"])
def test_decode_step_has_fewer_nodes_than_peers(tmp_path, name: str, new) -> None:
    model = onnx.load(zoo_decode_model(name))
    if new is not None:  # what --input-shape input_ids:2,1 does
        fix_inputs(model, {"input_ids": [2, new]})
    path = str(tmp_path / "in.onnx")
    onnx.save(model, path)
    report = Report()
    out = k3opt.optimize(path, verify=True, report=report)
    assert report.verification["status"] == "passed"
    peers = _peer_counts(path)
    assert len(out.graph.node) < min(peers.values()), (len(out.graph.node), peers)
    assert_equivalent(model, out, feeds=zoo_decode_inputs(name, past=5, new=new or 2))
