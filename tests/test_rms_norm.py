"""fuse-rmsnorm: RMSNorm in the Llama/Qwen2/DeepSeek forms becomes RMSNormalization at opset >= 23 (target onnx),
is counted and left decomposed otherwise; the recogniser is reusable by lowerings (rmsnorm_rules)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto as TP

from k3opt.graph.ir import NameScope
from k3opt.passes._shared.norm_match import NormMatch, OrderedRulesPass, affine_input, norm_input
from k3opt.pipeline.pass_base import PassContext
from k3opt.plugins import get_pass
from k3opt.passes._shared.norm_match import rmsnorm_rules
from tests.helpers import assert_equivalent, op_counts, run_passes
from tests.test_layer_norm import (H, RNG, Net, affine, assert_bf16_equivalent, attrs, export_fp16, needs_torch,
                                   norm_modules, optimize_fp16, optimize_zoo, rms_core, zoo_cases)

W = RNG.standard_normal(H).astype(np.float32) + 1.0


def fuse(model: onnx.ModelProto, target: str = "onnx"):
    return run_passes(model, [get_pass("fuse-rmsnorm")()], target=target)


def rms(net: Net, x: str, *, weight=W, left=False, cast_in=None, cast_out=None, etype=TP.FLOAT, eps=1e-6,
        **core) -> str:
    """An RMSNorm of ``x``, with the Casts of Llama's ``hidden.to(float32)`` / ``.to(input_dtype)`` when given."""
    x1 = net("Cast", x, to=cast_in) if cast_in else x
    y = rms_core(net, x1, eps=eps, **core)
    y = net("Cast", y, to=cast_out) if cast_out else y
    return affine(net, y, weight, None, left, etype)


def rms_model(shape=(2, 3, H), opset=23, etype=TP.FLOAT, **kw) -> onnx.ModelProto:
    net = Net(opset)
    return net.model(rms(net, "x", etype=etype, **kw), [("x", etype, list(shape))], etype)


def rms_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "RMSNormalization"]


def assert_fused(model, *, leftover=None, axis=-1, eps=1e-6, rtol=1e-4, atol=1e-5):
    out, pm, ctx = fuse(model)
    (node,) = rms_nodes(out)
    a = attrs(node)
    assert a["axis"] == axis and a["epsilon"] == pytest.approx(eps, rel=1e-6)
    if leftover is not None:
        assert op_counts(out) == {"RMSNormalization": 1, **leftover}
    assert_equivalent(model, out, rtol=rtol, atol=atol)
    again, pm2, _ = fuse(out)
    assert pm.stats["fuse-rmsnorm"].rewrites == 1 and pm2.stats["fuse-rmsnorm"].rewrites == 0
    return out


def assert_untouched(model, target="onnx"):
    out, pm, ctx = fuse(model, target)
    assert pm.stats["fuse-rmsnorm"].rewrites == 0 and op_counts(out) == op_counts(model)
    assert_equivalent(model, out, rtol=0, atol=0)
    return ctx


# -- every spelling at opset 23 -------------------------------------------------------------------------------

@pytest.mark.parametrize("opset", [17, 23])
@pytest.mark.parametrize("weight", ["right", "left", "none"])
@pytest.mark.parametrize("divide", ["div", "reciprocal", "div1", "pow"])
@pytest.mark.parametrize("square", ["pow", "mul"])
def test_every_form_is_recognised(square, divide, weight, opset):
    """Fused at opset 23 (axes as input); at 17 (axes as attribute) counted and left as it is."""
    model = rms_model(opset=opset, square=square, divide=divide, weight=None if weight == "none" else W,
                      left=weight == "left")
    if opset == 23:
        assert_fused(model, leftover={})
    else:
        assert assert_untouched(model).counters["rmsnorm_found"] == 1


def test_llama_fp16_form():
    """hidden.to(float32); pow(2).mean(-1); hidden * rsqrt(var + eps); weight * hidden.to(float16)."""
    model = rms_model(etype=TP.FLOAT16, cast_in=TP.FLOAT, cast_out=TP.FLOAT16, weight=W.astype(np.float16),
                      left=True, divide="reciprocal")
    assert_fused(model, leftover={}, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("opset", [17, 23])
def test_fp16_with_double_statistics_cast_back(opset):
    """Statistics in double, cast back to fp16: fused at 23 (float32 statistics suffice for an fp16 result), and
    counted below 23 although only the weighted rule, with its Cast back, accepts it."""
    model = rms_model(opset=opset, etype=TP.FLOAT16, cast_in=TP.DOUBLE, cast_out=TP.FLOAT16,
                      weight=W.astype(np.float16), ctype=TP.DOUBLE)
    if opset == 23:
        assert_fused(model, leftover={}, rtol=1e-2, atol=1e-2)
    else:
        assert assert_untouched(model).counters["rmsnorm_found"] == 1


def test_fp32_export_with_no_op_casts():
    """TorchScript keeps .to(float32) on an fp32 model as Casts to float."""
    model = rms_model(cast_in=TP.FLOAT, cast_out=TP.FLOAT, divide="div1", left=True)
    assert_fused(model, leftover={})


def test_fp16_input_float32_weight_normalizes_the_widened_input():
    net = Net(23)
    model = net.model(rms(net, "x", cast_in=TP.FLOAT), [("x", TP.FLOAT16, [2, 3, H])])
    assert_fused(model, leftover={"Cast": 1}, rtol=1e-3, atol=1e-3)


def test_bf16_through_the_reference_evaluator():
    bf = ml_dtypes.bfloat16
    model = rms_model(etype=TP.BFLOAT16, cast_in=TP.FLOAT, cast_out=TP.BFLOAT16, weight=W.astype(bf))
    out, _, _ = fuse(model)
    assert op_counts(out) == {"RMSNormalization": 1}
    assert_bf16_equivalent(model, out)


def test_last_two_axes():
    w2 = RNG.standard_normal((3, H)).astype(np.float32)
    assert_fused(rms_model(axes=(-2, -1), weight=w2), axis=-2, leftover={})


# -- counted, not fused ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("opset", [17, 18])
def test_below_opset_23_counted_and_left_decomposed(opset):
    net = Net(opset)
    y = rms(net, "x", left=True)
    y = rms(net, net("MatMul", y, net.const(np.eye(H, dtype=np.float32))), square="mul", divide="div1")
    y = rms(net, y, cast_in=TP.FLOAT, cast_out=TP.FLOAT, weight=None)
    ctx = assert_untouched(net.model(y, [("x", TP.FLOAT, [2, 3, H])]))
    assert ctx.counters["rmsnorm_found"] == 3
    assert "3 RMSNorm found, left decomposed: opset < 23" in ctx.notes


def test_other_target_counted_and_left_decomposed_at_opset_23():
    ctx = assert_untouched(rms_model(), target="cann")
    assert ctx.counters["rmsnorm_found"] == 1
    assert "1 RMSNorm found, left decomposed: target cann (its lowering passes decide, see the lowering lines)" in ctx.notes


@pytest.mark.parametrize("opset", [14, 16, 18])
def test_a_layernorm_core_is_no_rmsnorm(opset):
    """A LayerNorm's core is the RMS core of x - mean(x): not counted as an RMSNorm; below opset 17 (where
    fuse-layernorm cannot run) it is counted as the LayerNorm it is."""
    from tests.test_layer_norm import ln_model

    ctx = assert_untouched(ln_model(opset=opset))
    assert not ctx.counters.get("rmsnorm_found")
    assert ctx.notes == (["1 LayerNorm found, left decomposed: opset < 17 (LayerNormalization)"] if opset < 17 else [])


def test_nothing_found_leaves_no_note():
    net = Net(17)
    ctx = assert_untouched(net.model(net("Relu", "x"), [("x", TP.FLOAT, [2, H])]))
    assert not ctx.counters.get("rmsnorm_found") and not ctx.notes


# -- refusals -------------------------------------------------------------------------------------------------

def test_non_trailing_axes_are_left_alone():
    ctx = assert_untouched(rms_model(axes=(1,), weight=None))
    assert_untouched(rms_model(axes=(-3, -2)))
    assert_untouched(rms_model(opset=17, axes=(1,)))
    assert not ctx.counters.get("rmsnorm_found")


def test_statistics_of_another_tensor_are_left_alone():
    net = Net(23)
    sq = net("Mul", "z", "z")
    std = net("Sqrt", net("Add", net.mean(sq, (-1,)), net.const(1e-6)))
    y = affine(net, net("Div", "x", std), W)
    assert_untouched(net.model(y, [("x", TP.FLOAT, [2, 3, H]), ("z", TP.FLOAT, [2, 3, H])]))


def test_non_constant_epsilon_is_left_alone():
    net = Net(23)
    y = affine(net, rms_core(net, "x", eps="e"), W)
    assert_untouched(net.model(y, [("x", TP.FLOAT, [2, 3, H]), ("e", TP.FLOAT, [])]))


def test_rank0_input_is_left_alone():
    """RMSNormalization's axis must exist: a scalar input is never fused (nor counted)."""
    net = Net(23)
    sq = net("Mul", "x", "x")
    std = net("Sqrt", net("Add", net("ReduceMean", sq, keepdims=1), net.const(1e-6)))
    model = net.model(net("Div", "x", std), [("x", TP.FLOAT, [])])
    assert not assert_untouched(model).counters.get("rmsnorm_found")
    assert not assert_untouched(model, target="cann").counters.get("rmsnorm_found")


def test_eps_outside_the_sqrt_is_left_alone():
    net = Net(23)
    std = net("Add", net("Sqrt", net.mean(net("Mul", "x", "x"), (-1,))), net.const(1e-3))
    assert_untouched(net.model(affine(net, net("Div", "x", std), W), [("x", TP.FLOAT, [2, 3, H])]))


def test_weight_over_other_axes_stays_outside():
    per_pos = RNG.standard_normal((3, H)).astype(np.float32)
    assert_fused(rms_model(weight=per_pos), leftover={"Mul": 1})


@pytest.mark.parametrize("escaping", range(5))  # square, mean, mean+eps, sqrt, inverse
def test_escaping_intermediate_is_left_alone(escaping):
    net = Net(23)
    y = rms(net, "x", divide="reciprocal")
    kept = net.nodes[escaping].output[0]
    assert_untouched(net.model(y, [("x", TP.FLOAT, [2, 3, H])], outputs=((kept, TP.FLOAT),)))


def test_narrowing_cast_stays_outside():
    """fp32 -> fp16 statistics -> fp32: an fp16 RMSNorm of the Cast, never one of the fp32 input."""
    net = Net(23)
    x1 = net("Cast", "x", to=TP.FLOAT16)
    y = net("Cast", rms_core(net, x1, eps=1e-6, ctype=TP.FLOAT16), to=TP.FLOAT)
    model = net.model(affine(net, y, W), [("x", TP.FLOAT, [2, 3, H])])
    out = assert_fused(model, leftover={"Cast": 2, "Mul": 1}, eps=float(np.float16(1e-6)), rtol=1e-3, atol=1e-3)
    assert out.graph.node[0].op_type == "Cast"


# -- the lowering entry point ---------------------------------------------------------------------------------

def test_rmsnorm_rules_hand_the_match_to_a_lowering():
    """A lowering gets x, weight, eps, dtypes and Casts; it may decline (eps 1e-5 here) and the norm stays."""
    net = Net(17)
    y = rms(net, "x", etype=TP.FLOAT16, cast_in=TP.FLOAT, cast_out=TP.FLOAT16, weight=W.astype(np.float16))
    y = rms(net, net("Cast", y, to=TP.FLOAT), eps=1e-5)
    model = net.model(y, [("x", TP.FLOAT16, [2, 3, H])])
    seen: list[NormMatch] = []

    def lower(op, nm: NormMatch):
        seen.append(nm)
        if nm.epsilon != pytest.approx(1e-6):
            return None
        return op.MyRmsNorm(norm_input(op, nm), affine_input(op, nm, nm.weight, 1.0), _domain="test")

    graph = gs.import_onnx(model)
    ctx = PassContext(opset=17, names=NameScope(graph))
    assert OrderedRulesPass(rmsnorm_rules(lower), name="lower").run(graph, ctx) == 1
    graph.cleanup()
    assert [n.op for n in graph.nodes].count("MyRmsNorm") == 1
    (llama,) = [nm for nm in seen if nm.epsilon == pytest.approx(1e-6)]
    assert (llama.input_dtype, llama.compute_dtype, llama.output_dtype) == (TP.FLOAT16, TP.FLOAT, TP.FLOAT16)
    assert [c.attrs["to"] for c in llama.casts] == [TP.FLOAT, TP.FLOAT16]
    assert llama.x.name == "x" and llama.axes == (-1,) and llama.normalized_shape == (H,)
    # the declined one is offered again by the weightless rule (its weight Mul then stays outside)
    declined = [nm for nm in seen if nm is not llama]
    assert [nm.weight is not None for nm in declined] == [True, False]
    assert declined[0].reduce is declined[1].reduce and declined[0].input_dtype == TP.FLOAT16


# -- real exports (tests/zoo.py) ------------------------------------------------------------------------------

@needs_torch
@pytest.mark.parametrize("name, exporter", zoo_cases(("llama", "qwen2", "deepseek_v3")))
def test_every_rmsnorm_of_real_exports(name, exporter):
    """Every RMSNorm module (DeepSeek-V3: also MLA's q_a/kv_a norms) is found: fused at opset 23, counted below."""
    expected = norm_modules(name, "RMSNorm")
    _, fused, _ = optimize_zoo(name, exporter, opset=23)
    counts = op_counts(fused)
    assert counts.get("RMSNormalization") == expected and "ReduceMean" not in counts
    _, kept, report = optimize_zoo(name, exporter)
    assert f"{expected} RMSNorm found, left decomposed: opset < 23" in report.notes
    assert op_counts(kept).get("ReduceMean") == expected


def llama_rms_norm(torch):
    """transformers' LlamaRMSNorm (Qwen2/DeepSeek-V3 have the same), fp32 statistics of an fp16 input."""

    class RMSNorm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(H))

        def forward(self, hidden):
            dtype = hidden.dtype
            hidden = hidden.to(torch.float32)
            variance = hidden.pow(2).mean(-1, keepdim=True)
            hidden = hidden * torch.rsqrt(variance + 1e-6)
            return self.weight * hidden.to(dtype)

    return RMSNorm()


@needs_torch
@pytest.mark.parametrize("exporter", ["torchscript", pytest.param("dynamo", marks=pytest.mark.slow)])
def test_fp16_llama_rms_norm_exports(exporter, tmp_path):
    model = export_fp16(llama_rms_norm, exporter, tmp_path)
    assert op_counts(model)["Cast"] == 2
    assert op_counts(optimize_fp16(model)) == {"RMSNormalization": 1}
