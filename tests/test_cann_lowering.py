"""lower-rmsnorm-npu: RMSNorm -> NPURmsNorm exactly where ATC's plugin (fixed eps 1e-6) computes the same thing.

The lowering runs as a pass of ``--target cann`` (after the verified passes); ``lowered`` runs only it,
through the production pipeline (import, pass manager, export, the target's form and invariants).
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import k3opt
from k3opt import modelio
from k3opt.cann_bridge import finish_model, invariant_violations
from k3opt.pipeline.pass_base import PassContext
from k3opt.passes.cleanup.castlike_to_cast import CastLikeToCast
from k3opt.report import Report
from k3opt.targets import get_target
from tests.cann_models import decompose_npu_rmsnorm, rms_model, rmsnorm_nodes
from tests.helpers import assert_equivalent, make_model, op_counts


def lowered(model, passes=("lower-rmsnorm-npu",)):
    report = Report()
    out = k3opt.optimize(model, target="cann", passes=list(passes), report=report)
    assert invariant_violations(out) == []
    assert report.passes[-1]["name"] == passes[-1]  # counted like any pass
    return out, report.lowering


def test_eps_1e6_becomes_npu_rmsnorm_and_matches_the_plugin_formula():
    model = rms_model(eps=1e-6)
    out, lines = lowered(model)
    counts = op_counts(out)
    assert counts.get("NPURmsNorm") == 1 and "ReduceMean" not in counts and "Sqrt" not in counts
    node = next(n for n in out.graph.node if n.op_type == "NPURmsNorm")
    assert len(node.input) == 2 and len(node.output) == 2 and node.domain == "" and not node.attribute
    assert lines[0].startswith("NPURmsNorm: 1 of 1 RMSNorm(s) lowered")
    assert lines[1] == "RMSNorm at 'rms0_mean' -> NPURmsNorm"
    assert_equivalent(model, decompose_npu_rmsnorm(out))


def test_other_eps_stays_decomposed_with_reason():
    model = rms_model(eps=1e-5)
    out, lines = lowered(model)
    assert "NPURmsNorm" not in op_counts(out)
    assert lines == ["NPURmsNorm: 0 of 1 RMSNorm(s) lowered (ATC's plugin fixes eps at 1e-6)",
                     "RMSNorm at 'rms0_mean' kept decomposed: epsilon 1e-05 is not the NPURmsNorm plugin's fixed 1e-06"]
    assert_equivalent(model, out)


def test_count_equals_rmsnorms_with_eps_1e6():
    model = rms_model(eps=1e-6, layers=(1e-5, 1e-6, 1e-6 * 1.5))
    out, lines = lowered(model)
    assert op_counts(out)["NPURmsNorm"] == 2
    assert lines[0].startswith("NPURmsNorm: 2 of 4")
    assert sum("kept decomposed" in line for line in lines) == 2
    assert_equivalent(model, decompose_npu_rmsnorm(out))


def test_fp16_export_with_casts():
    model = rms_model(eps=1e-6, dtype=np.float16)
    out, _ = lowered(model)
    assert op_counts(out).get("NPURmsNorm") == 1 and "Cast" not in op_counts(out)
    assert_equivalent(model, decompose_npu_rmsnorm(out), rtol=1e-2, atol=1e-2)


def test_broadcast_weight_is_reshaped_to_the_normalized_dims():
    model = rms_model(eps=1e-6, weight_shape=(1, 1, 16))
    out, _ = lowered(model)
    node = next(n for n in out.graph.node if n.op_type == "NPURmsNorm")
    gamma = next(i for i in out.graph.initializer if i.name == node.input[1])
    assert list(gamma.dims) == [16]
    assert_equivalent(model, decompose_npu_rmsnorm(out))


def test_without_weight_gets_ones():
    nodes, inits = rmsnorm_nodes("x", None, "y", 1e-6, "r")
    model = make_model(nodes, [("x", TensorProto.FLOAT, [2, 16])], [("y", TensorProto.FLOAT, [2, 16])], inits)
    out, _ = lowered(model)
    node = next(n for n in out.graph.node if n.op_type == "NPURmsNorm")
    gamma = numpy_helper.to_array(next(i for i in out.graph.initializer if i.name == node.input[1]))
    assert gamma.shape == (16,) and np.all(gamma == 1)
    assert_equivalent(model, decompose_npu_rmsnorm(out))


def test_non_trailing_axes_not_lowered():
    model = rms_model(eps=1e-6, axes=(1,), shape=(2, 16, 16))
    out, lines = lowered(model)
    assert "NPURmsNorm" not in op_counts(out) and lines == ["NPURmsNorm: no RMSNorm found"]


def test_graph_output_keeps_its_name():
    nodes, inits = rmsnorm_nodes("x", "w", "y", 1e-6, "r")
    inits["w"] = np.ones(16, np.float32)
    model = make_model(nodes, [("x", TensorProto.FLOAT, [2, 16])], [("y", TensorProto.FLOAT, [2, 16])], inits)
    out, _ = lowered(model)
    assert [o.name for o in out.graph.output] == ["y"]
    assert_equivalent(model, decompose_npu_rmsnorm(out))


def test_through_the_pipeline_target_cann():
    model = rms_model(eps=1e-6, layers=(1e-5,))
    model.opset_import[0].version = 14
    report = Report()
    out = k3opt.optimize(model, target="cann", verify=True, report=report)
    assert [(o.domain, o.version) for o in out.opset_import] == [("", 17)]
    assert op_counts(out)["NPURmsNorm"] == 1
    assert report.verification["status"] == "passed"
    assert report.lowering[0].startswith("NPURmsNorm: 1 of 2")
    assert invariant_violations(out) == []
    assert_equivalent(model, decompose_npu_rmsnorm(out))


def test_the_target_form_refuses_a_model_breaking_the_invariants():
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [("x", TensorProto.FLOAT, [2])],
                       [("y", TensorProto.FLOAT, [2])], opset=18)
    with pytest.raises(k3opt.CompileError, match="cann target's invariants"):
        finish_model(model)


def test_lowering_is_bisected_like_any_pass():
    """A lowering step is a pass step: the report has its statistics, and --skip switches it off."""
    report = Report()
    out = k3opt.optimize(rms_model(eps=1e-6), target="cann", skip=["lower-rmsnorm-npu"], report=report)
    assert "NPURmsNorm" not in op_counts(out) and not any(line.startswith("NPURmsNorm") for line in report.lowering)
    report = Report()
    k3opt.optimize(rms_model(eps=1e-6), target="cann", report=report)
    stats = next(p for p in report.passes if p["name"] == "lower-rmsnorm-npu")
    assert stats["rewrites"] == 1 and stats["runs"] >= 1



@pytest.mark.parametrize("like_type", [TensorProto.FLOAT16, TensorProto.INT64, TensorProto.BFLOAT16])
def test_cast_like_becomes_cast(like_type):
    nodes = [helper.make_node("Constant", [], ["like"], value=helper.make_tensor("v", like_type, [1], [0])),
             helper.make_node("CastLike", ["x", "like"], ["c"], name="cl"),
             helper.make_node("CastLike", ["c", "x"], ["y"], name="back")]
    model = make_model(nodes, [("x", TensorProto.FLOAT, [2, 3])], [("y", TensorProto.FLOAT, [2, 3])])
    out = k3opt.optimize(model, target="cann")  # castlike-to-cast, a default pass of every target
    assert op_counts(out) == {"Cast": 2}
    assert [a.i for n in out.graph.node for a in n.attribute if a.name == "to"] == [like_type, TensorProto.FLOAT]
    feeds = {"x": (np.random.default_rng(0).standard_normal((2, 3)) * 10).astype(np.float32)}
    assert_equivalent(model, out, feeds=feeds, rtol=0, atol=0)


def test_cast_like_with_unknown_dtype_is_kept_and_reported():
    model = make_model([helper.make_node("CastLike", ["x", "like"], ["y"], name="cl")],
                       [("x", TensorProto.FLOAT, [2]), ("like", TensorProto.FLOAT16, [1])],
                       [("y", TensorProto.FLOAT16, [2])])
    graph = modelio.import_graph(model)
    graph.inputs[1].dtype = None
    ctx = PassContext(opset=17, target=get_target("cann"))
    assert CastLikeToCast().run(graph, ctx) == 0
    CastLikeToCast().finish(graph, ctx)
    assert ctx.notes == ["1 CastLike kept for cann, which has no CastLike parser (dtype of the second input "
                         "unknown: cl)"]
    assert graph.nodes[0].op == "CastLike"


def test_the_lowered_graph_is_verified_by_the_reference_evaluator():
    report = Report()
    k3opt.optimize(rms_model(eps=1e-6, layers=(1e-5,)), target="cann", verify=True, report=report)
    assert report.verification["status"] == "passed"
    assert report.lowering_verification["status"] == "passed"
    assert "lowering verification (reference evaluator): passed" in report.table()
    report = Report()
    k3opt.optimize(rms_model(eps=1e-6), target="cann", verify=False, report=report)
    assert report.lowering_verification is None


def test_an_inexact_lowering_fails_the_verification_and_is_bisected(monkeypatch):
    """A lowering that pretends eps 1e-5 is the plugin's: the reference (fixed 1e-6) tells the difference."""
    import k3opt.targets.cann.passes.lower_rmsnorm_npu as lowering

    monkeypatch.setattr(lowering, "PLUGIN_EPSILON", 1e-5)
    small = {"x": (1e-3 * np.random.default_rng(0).standard_normal((2, 3, 16))).astype(np.float32)}
    report = Report()
    with pytest.raises(k3opt.VerificationError, match="reference evaluator .*first diverging pass: lower-rmsnorm-npu"):
        k3opt.optimize(rms_model(eps=1e-5), target="cann", verify=True, input_data=small, report=report)
    assert report.verification["status"] == "passed"
    assert report.lowering_verification["first_diverging_pass"] == "lower-rmsnorm-npu"


def test_a_model_over_the_bound_skips_the_reference_verification_with_a_warning(monkeypatch):
    import k3opt.api

    monkeypatch.setattr(k3opt.pipeline.run, "REFERENCE_MAX_NODES", 1)
    report = Report()
    k3opt.optimize(rms_model(eps=1e-6), target="cann", verify=True, report=report)
    assert report.lowering_verification["status"] == "skipped"
    assert any("verification of the lowering skipped" in w for w in report.warnings)
