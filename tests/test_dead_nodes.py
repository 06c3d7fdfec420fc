"""remove-dead-nodes: dead nodes, initializers and value_info go; values read by subgraphs stay."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto as T, helper

from k3opt.passes.cleanup.remove_dead_nodes import RemoveDeadNodes
from tests.helpers import assert_equivalent, make_model, op_counts, run_passes

F = T.FLOAT


def test_dead_nodes_initializers_and_value_info_are_removed():
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Mul", ["r", "w"], ["dead1"]),
             helper.make_node("Neg", ["dead1"], ["dead2"]), helper.make_node("Neg", ["r"], ["y"])]
    model = make_model(nodes, [("x", F, [3])], [("y", F, [3])], {"w": np.float32([1, 2, 3])})
    model.graph.value_info.append(helper.make_tensor_value_info("dead2", F, [3]))
    out, pm, _ = run_passes(model, [RemoveDeadNodes()])
    assert pm.stats["remove-dead-nodes"].rewrites == 2
    assert op_counts(out) == {"Relu": 1, "Neg": 1}
    assert not out.graph.initializer and all(v.name != "dead2" for v in out.graph.value_info)
    assert [i.name for i in out.graph.input] == ["x"]
    assert_equivalent(model, out)


def test_value_read_only_inside_a_branch_is_live_and_dead_body_nodes_go():
    then_g = helper.make_graph([helper.make_node("Add", ["x", "c"], ["t"]), helper.make_node("Neg", ["t"], ["unused"])],
                               "then", [], [helper.make_tensor_value_info("t", F, [2])])
    else_g = helper.make_graph([helper.make_node("Sub", ["x", "c"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", F, [2])])
    nodes = [helper.make_node("Exp", ["x"], ["c"]),
             helper.make_node("If", ["cond"], ["y"], then_branch=then_g, else_branch=else_g)]
    model = make_model(nodes, [("x", F, [2]), ("cond", T.BOOL, [])], [("y", F, [2])])
    out, pm, _ = run_passes(model, [RemoveDeadNodes()])
    assert pm.stats["remove-dead-nodes"].rewrites == 1  # only the Neg inside the then-branch
    assert op_counts(out) == {"Exp": 1, "If": 1}
    for cond in (True, False):
        assert_equivalent(model, out, feeds={"x": np.float32([1, 2]), "cond": np.array(cond)})


def test_nothing_dead_is_a_fixed_point():
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [("x", F, [3])], [("y", F, [3])])
    out, pm, _ = run_passes(model, [RemoveDeadNodes()])
    assert pm.stats["remove-dead-nodes"].rewrites == 0 and op_counts(out) == {"Relu": 1}
