"""remove-zero-rnn-states: proven-zero initial states become omitted inputs; anything else stays."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from k3opt.passes.cleanup.remove_dead_nodes import RemoveDeadNodes
from k3opt.passes.cleanup.remove_zero_rnn_states import RemoveZeroRnnStates
from tests.helpers import assert_equivalent, make_model, op_counts, run_passes

F, I64 = TensorProto.FLOAT, TensorProto.INT64
RNG = np.random.default_rng(7)
H = 5


def rnn_model(op: str, state_nodes, state_inits, h="h0", c=None, extra_inputs=()):
    """x (T=4, B, 3) -> op with initial state ``h`` (and ``c``) -> Y."""
    gates = {"RNN": 1, "GRU": 3, "LSTM": 4}[op]
    inits = {"W": RNG.standard_normal((1, gates * H, 3)).astype(np.float32),
             "R": RNG.standard_normal((1, gates * H, H)).astype(np.float32), **state_inits}
    ins = ["x", "W", "R", "", "", h] + ([c] if c else [])
    nodes = list(state_nodes) + [helper.make_node(op, ins, ["Y"], hidden_size=H)]
    return make_model(nodes, [("x", F, [4, "B", 3])] + list(extra_inputs), [("Y", F, [4, 1, "B", H])], inits)


def zeros_of_batch(name="h0", value=None):
    """``ConstantOfShape([1, batch, H])`` built from x's shape, as PyTorch exports it."""
    attrs = {} if value is None else {"value": helper.make_tensor("v", F, [1], [value])}
    return [helper.make_node("Shape", ["x"], ["sh"]),
            helper.make_node("Gather", ["sh", "one"], ["b"], axis=0),
            helper.make_node("Unsqueeze", ["b", "zero_axis"], ["b1"]),
            helper.make_node("Concat", ["dirs", "b1", "hid"], ["shape"], axis=0),
            helper.make_node("ConstantOfShape", ["shape"], [name], **attrs)], \
        {"one": np.array(1, np.int64), "zero_axis": np.array([0], np.int64), "dirs": np.array([1], np.int64),
         "hid": np.array([H], np.int64)}


def run(model):
    out, pm, _ = run_passes(model, [RemoveZeroRnnStates(), RemoveDeadNodes()])
    return out, pm.stats["remove-zero-rnn-states"].rewrites


@pytest.mark.parametrize("op", ["RNN", "GRU"])
def test_constant_of_shape_state_goes(op):
    nodes, inits = zeros_of_batch()
    model = rnn_model(op, nodes, inits)
    out, n = run(model)
    assert n == 1 and op_counts(out) == {op: 1}
    assert_equivalent(model, out)


def test_lstm_sliced_and_constant_states():
    nodes, inits = zeros_of_batch("z", value=0.0)
    nodes += [helper.make_node("Slice", ["z", "s0", "s1", "s2"], ["h0"])]
    inits.update(s0=np.array([0], np.int64), s1=np.array([1], np.int64), s2=np.array([0], np.int64),
                 c0=np.zeros((1, 2, H), np.float32))
    model = rnn_model("LSTM", nodes, inits, c="c0")
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 2
    out, n = run(model)
    assert n == 1 and op_counts(out) == {"LSTM": 1}
    assert_equivalent(model, out)


def test_non_zero_states_stay():
    nodes, inits = zeros_of_batch(value=0.5)
    model = rnn_model("GRU", nodes, inits)
    assert run(model)[1] == 0
    model = rnn_model("GRU", [], {"h0": np.full((1, 2, H), 1e-3, np.float32)})
    assert run(model)[1] == 0
    nodes, inits = zeros_of_batch("z")
    model = rnn_model("GRU", nodes + [helper.make_node("Add", ["z", "bump"], ["h0"])], {**inits},
                      extra_inputs=[("bump", F, [1, "B", H])])
    out, n = run(model)
    assert n == 0
    model = rnn_model("GRU", [], {}, extra_inputs=[("h0", F, [1, "B", H])])
    out, n = run(model)
    assert n == 0 and assert_equivalent(model, out) is None
