"""inline-constant-if: the taken branch replaces the If (outer reads, initializers, names), else nothing changes."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import k3opt
from k3opt.passes.fold.inline_constant_if import InlineConstantIf
from k3opt.passes.cleanup.remove_identity import RemoveIdentity
from tests.helpers import assert_equivalent, make_model, op_counts, run_passes

F = TensorProto.FLOAT


def branch(name: str, scale: float, clash: bool = False, passthrough: bool = False) -> onnx.GraphProto:
    """``Relu(h * k)`` with a branch initializer ``k``; ``clash``: local names both branches use;
    ``passthrough``: the branch returns the outer ``h`` (through an Identity, as ONNX requires)."""
    m, r, k = ("m", "r", f"{name}_k") if clash else (f"{name}_m", f"{name}_r", f"{name}_k")
    if passthrough:
        return helper.make_graph([helper.make_node("Identity", ["h"], [r])], name, [],
                                 [helper.make_tensor_value_info(r, F, None)])
    nodes = [helper.make_node("Mul", ["h", k], [m]), helper.make_node("Relu", [m], [r])]
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(r, F, None)],
                             [numpy_helper.from_array(np.array([scale], np.float32), k)])


def if_model(cond, clash=False, passthrough=False, cond_input=False):
    nodes = [helper.make_node("Add", ["x", "w"], ["h"])]
    inputs = [("x", F, [2, 3])]
    if cond_input:
        inputs.append(("c", TensorProto.BOOL, []))
    else:
        nodes.append(helper.make_node("Constant", [], ["c"], value=helper.make_tensor("cv", TensorProto.BOOL, [], [cond])))
    nodes += [helper.make_node("If", ["c"], ["y"], then_branch=branch("then", 2.0, clash, passthrough),
                               else_branch=branch("else", 3.0, clash))]
    return make_model(nodes, inputs, [("y", F, [2, 3])], {"w": np.ones((2, 3), np.float32)})


@pytest.mark.parametrize("cond", [True, False])
def test_branch_taken(cond):
    model = if_model(cond)
    out, pm, _ = run_passes(model, [InlineConstantIf(), RemoveIdentity()])
    assert pm.stats["inline-constant-if"].rewrites == 1
    assert op_counts(out) == {"Add": 1, "Mul": 1, "Relu": 1} and out.graph.output[0].name == "y"
    assert_equivalent(model, out)


def test_clashing_names_are_renamed():
    model = if_model(True, clash=True)
    out, _, _ = run_passes(model, [InlineConstantIf(), RemoveIdentity()])
    names = [o for n in out.graph.node for o in n.output] + [i.name for i in out.graph.initializer]
    assert len(names) == len(set(names))
    onnx.checker.check_model(out)
    assert_equivalent(model, out)


def test_branch_returning_an_outer_value():
    model = if_model(True, passthrough=True)
    out, _, _ = run_passes(model, [InlineConstantIf(), RemoveIdentity()])
    assert op_counts(out) == {"Add": 1}
    assert_equivalent(model, out)


def test_nested_if_inlines_in_the_default_pipeline():
    inner = if_model(False)
    outer_branch = helper.make_graph(list(inner.graph.node)[1:], "outer_then", [],
                                     [helper.make_tensor_value_info("y", F, None)])
    nodes = [inner.graph.node[0], helper.make_node("Constant", [], ["t"], value=helper.make_tensor("tv", TensorProto.BOOL, [], [True])),
             helper.make_node("If", ["t"], ["z"], then_branch=outer_branch, else_branch=branch("other", 5.0))]
    model = make_model(nodes, [("x", F, [2, 3])], [("z", F, [2, 3])], {"w": np.ones((2, 3), np.float32)})
    out = k3opt.optimize(model)
    assert "If" not in op_counts(out)
    assert_equivalent(model, out)


def test_runtime_condition_stays():
    model = if_model(True, cond_input=True)
    out, pm, _ = run_passes(model, [InlineConstantIf()])
    assert pm.stats["inline-constant-if"].rewrites == 0 and op_counts(out)["If"] == 1
