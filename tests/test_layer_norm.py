"""fuse-layernorm: every decomposed LayerNorm form exporters emit is fused, and every unsafe one is left alone.

Each case builds a small graph by hand (``Net``), runs the pass and compares
onnxruntime outputs of the original and the optimized model. The graph
builders (``Net``, ``rms_core``) are shared with tests/test_rms_norm.py.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper
from onnx.reference import ReferenceEvaluator

import k3opt.api
from k3opt.plugins import get_pass
from k3opt.report import Report
from tests.helpers import assert_equivalent, make_model, op_counts, run_passes
from tests.zoo import EXPORTERS, needs_torch, zoo_inputs, zoo_model, zoo_torch_model

NP_TYPES = {TP.FLOAT: np.float32, TP.FLOAT16: np.float16, TP.DOUBLE: np.float64, TP.BFLOAT16: ml_dtypes.bfloat16}


class Net:
    """A tiny ONNX graph writer: ``net("Op", a, b, attr=...)`` adds a node and returns its output name."""

    def __init__(self, opset: int = 17):
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.inits: dict[str, np.ndarray] = {}

    def const(self, value, elem_type: int = TP.FLOAT) -> str:
        name = f"c{len(self.inits)}"
        self.inits[name] = np.asarray(value, dtype=NP_TYPES.get(elem_type, np.int64))
        return name

    def __call__(self, op: str, *inputs: str, **attrs) -> str:
        out = f"t{len(self.nodes)}"
        self.nodes.append(helper.make_node(op, list(inputs), [out], name=f"n{len(self.nodes)}", **attrs))
        return out

    def mean(self, x: str, axes, keepdims: int = 1) -> str:
        """ReduceMean over ``axes``: an attribute below opset 18, an input from 18 on."""
        if self.opset >= 18:
            return self("ReduceMean", x, self.const(list(axes), TP.INT64), keepdims=keepdims)
        return self("ReduceMean", x, axes=list(axes), keepdims=keepdims)

    def model(self, out: str, inputs: list[tuple], out_type: int = TP.FLOAT, outputs: tuple = ()) -> onnx.ModelProto:
        """A checked model with inferred intermediate shapes; ``outputs`` adds extra graph outputs."""
        probe = make_model(self.nodes, inputs, [], self.inits, opset=self.opset)
        inferred = {vi.name: vi.type.tensor_type for vi in onnx.shape_inference.infer_shapes(probe).graph.value_info}

        def dims(name: str) -> list:
            return [d.dim_param or d.dim_value for d in inferred[name].shape.dim]

        outs = [(o, t, dims(o)) for o, t in [(out, out_type), *outputs]]
        model = make_model(self.nodes, inputs, outs, self.inits, opset=self.opset)
        return onnx.shape_inference.infer_shapes(model)


def rms_core(net: Net, v: str, *, square="pow", divide="div", axes=(-1,), eps=1e-5, ctype=TP.FLOAT,
             keepdims=1, exponent=2.0, one=1.0) -> str:
    """v / sqrt(mean(v*v) + eps) in one of the exporters' spellings."""
    sq = net("Pow", v, net.const(exponent, ctype)) if square == "pow" else net("Mul", v, v)
    eps_in = eps if isinstance(eps, str) else net.const(eps, ctype)
    var_eps = net("Add", net.mean(sq, axes, keepdims), eps_in)
    if divide == "pow":
        return net("Mul", v, net("Pow", var_eps, net.const(-0.5, ctype)))
    std = net("Sqrt", var_eps)
    if divide == "div":
        return net("Div", v, std)
    if divide == "reciprocal":
        return net("Mul", v, net("Reciprocal", std))
    assert divide == "div1"
    return net("Mul", v, net("Div", net.const(one, ctype), std))


def affine(net: Net, y: str, scale=None, bias=None, left=False, etype=TP.FLOAT) -> str:
    """``y * scale + bias`` with constant (array) or named (str) operands, in either operand order."""
    for op, p in (("Mul", scale), ("Add", bias)):
        if p is not None:
            p = p if isinstance(p, str) else net.const(p, etype)
            y = net(op, p, y) if left else net(op, y, p)
    return y


def layer_norm(net: Net, x: str, *, axes=(-1,), var_axes=None, cast_in=None, cast_mid=None, cast_out=None,
               mean_of=None, reverse_sub=False, ctype=TP.FLOAT, **core) -> str:
    """A decomposed LayerNorm of ``x`` (optionally with the Casts of fp16 exports) without scale/bias."""
    x1 = net("Cast", x, to=cast_in) if cast_in else x
    mean = net.mean(mean_of or x1, axes)
    d = net("Sub", mean, x1) if reverse_sub else net("Sub", x1, mean)
    d1 = net("Cast", d, to=cast_mid) if cast_mid else d
    y = rms_core(net, d1, axes=var_axes or axes, ctype=ctype, **core)
    return net("Cast", y, to=cast_out) if cast_out else y


RNG = np.random.default_rng(0)
H = 8
SCALE = RNG.standard_normal(H).astype(np.float32) + 1.0
BIAS = RNG.standard_normal(H).astype(np.float32)


def fuse(model: onnx.ModelProto, **kw):
    return run_passes(model, [get_pass("fuse-layernorm")()], **kw)


def ln_model(shape=(2, 3, H), opset=17, scale=SCALE, bias=BIAS, left=False, etype=TP.FLOAT, **kw):
    net = Net(opset)
    y = affine(net, layer_norm(net, "x", **kw), scale, bias, left, etype)
    return net.model(y, [("x", etype, list(shape))], etype)


def ln_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "LayerNormalization"]


def attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def assert_fused(model, *, n=1, axis=-1, eps=1e-5, leftover=None, rtol=1e-4, atol=1e-5):
    """One pass run fuses ``n`` LayerNorms exactly (numerics, attributes, fixed point)."""
    out, pm, _ = fuse(model)
    lns = ln_nodes(out)
    assert len(lns) == n, op_counts(out)
    for node in lns:
        a = attrs(node)
        assert a["axis"] == axis and a["epsilon"] == pytest.approx(eps, rel=1e-6)
    if leftover is not None:
        assert op_counts(out) == {"LayerNormalization": n, **leftover}
    assert_equivalent(model, out, rtol=rtol, atol=atol)
    again, _, _ = fuse(out)
    assert pm.stats["fuse-layernorm"].rewrites == n and op_counts(again) == op_counts(out)
    return out


def assert_untouched(model):
    """The pass declines: no rewrite, same ops, same outputs."""
    out, pm, _ = fuse(model)
    assert pm.stats["fuse-layernorm"].rewrites == 0
    assert op_counts(out) == op_counts(model)
    assert_equivalent(model, out, rtol=0, atol=0)


# -- every spelling -------------------------------------------------------------------------------------------

AFFINE = {"scale+bias": (SCALE, BIAS, False), "scale+bias-left": (SCALE, BIAS, True), "scale": (SCALE, None, False),
          "scale-left": (SCALE, None, True), "bias": (None, BIAS, False), "bias-left": (None, BIAS, True),
          "none": (None, None, False)}


@pytest.mark.parametrize("opset", [17, 18])
@pytest.mark.parametrize("affine_form", sorted(AFFINE))
@pytest.mark.parametrize("divide", ["div", "reciprocal", "div1", "pow"])
@pytest.mark.parametrize("square", ["pow", "mul"])
def test_every_form_fuses_exactly(square, divide, affine_form, opset):
    scale, bias, left = AFFINE[affine_form]
    model = ln_model(opset=opset, scale=scale, bias=bias, left=left, square=square, divide=divide)
    out = assert_fused(model, leftover={})
    node = ln_nodes(out)[0]
    assert len(node.input) == (3 if bias is not None else 2)


def test_missing_scale_becomes_ones_of_the_input_dtype():
    out = assert_fused(ln_model(scale=None, bias=BIAS), leftover={})
    scale = next(i for i in out.graph.initializer if i.name == ln_nodes(out)[0].input[1])
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(scale), np.ones(H, np.float32))


def test_several_layer_norms_and_epsilon_from_the_match():
    net = Net(17)
    y = affine(net, layer_norm(net, "x", eps=1e-6), SCALE, BIAS)
    y = affine(net, layer_norm(net, net("Relu", y), eps=1e-12, square="mul"), SCALE, None)
    out, _, _ = fuse(net.model(y, [("x", TP.FLOAT, [2, 3, H])]))
    assert [attrs(n)["epsilon"] for n in ln_nodes(out)] == pytest.approx([1e-6, 1e-12])
    assert_equivalent(net.model(y, [("x", TP.FLOAT, [2, 3, H])]), out)


def test_positive_trailing_axis_and_dynamic_leading_dims():
    assert_fused(ln_model(shape=["batch", "seq", H], axes=(2,)), leftover={})


def test_last_two_axes_with_exactly_broadcasting_scale():
    scale = RNG.standard_normal((3, H)).astype(np.float32)
    assert_fused(ln_model(axes=(-2, -1), scale=scale, bias=None), axis=-2, leftover={})
    assert_fused(ln_model(axes=(1, 2), scale=scale, bias=scale), axis=-2, leftover={})


def test_scale_with_leading_ones_that_keep_the_rank():
    assert_fused(ln_model(shape=(4, H), scale=SCALE.reshape(1, H), bias=BIAS.reshape(1, H)), leftover={})
    assert_fused(ln_model(scale=np.float32(2.0), bias=None), leftover={})


# -- low precision --------------------------------------------------------------------------------------------

def fp16(a):
    return None if a is None else np.asarray(a, np.float16)


def test_fp16_torchscript_form_with_double_statistics():
    """torch.onnx (TorchScript, opset < 17) on fp16: Sub in fp16, Cast to double, stats, Cast back."""
    model = ln_model(etype=TP.FLOAT16, scale=fp16(SCALE), bias=fp16(BIAS), cast_mid=TP.DOUBLE,
                     cast_out=TP.FLOAT16, ctype=TP.DOUBLE)
    out = assert_fused(model, leftover={}, rtol=1e-2, atol=1e-2)
    assert attrs(ln_nodes(out)[0]).get("stash_type", 1) == 1


def test_fp16_with_float32_statistics_cast_back():
    model = ln_model(etype=TP.FLOAT16, scale=fp16(SCALE), bias=fp16(BIAS), cast_in=TP.FLOAT, cast_out=TP.FLOAT16)
    assert_fused(model, leftover={}, rtol=1e-2, atol=1e-2)


def test_fp16_input_float32_output_normalizes_the_widened_input():
    net = Net(17)
    y = affine(net, layer_norm(net, "x", cast_in=TP.FLOAT), SCALE, BIAS)
    model = net.model(y, [("x", TP.FLOAT16, [2, 3, H])])
    out = assert_fused(model, leftover={"Cast": 1}, rtol=1e-3, atol=1e-3)
    assert out.graph.output[0].type.tensor_type.elem_type == TP.FLOAT


def assert_bf16_equivalent(model: onnx.ModelProto, out: onnx.ModelProto) -> None:
    """onnxruntime has no bf16 CPU kernels: compare through the ONNX reference evaluator."""
    x = RNG.standard_normal((2, 3, H)).astype(ml_dtypes.bfloat16)
    want, got = (ReferenceEvaluator(m).run(None, {"x": x})[0].astype(np.float32) for m in (model, out))
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


def test_bf16_with_float32_statistics():
    bf = ml_dtypes.bfloat16
    model = ln_model(etype=TP.BFLOAT16, scale=SCALE.astype(bf), bias=BIAS.astype(bf), cast_in=TP.FLOAT,
                     cast_out=TP.BFLOAT16)
    out, _, _ = fuse(model)
    assert op_counts(out) == {"LayerNormalization": 1}
    assert_bf16_equivalent(model, out)


def test_bf16_throughout():
    """No Casts at all (a bf16 epsilon): LayerNormalization in bf16 with float32 statistics."""
    bf = ml_dtypes.bfloat16
    model = ln_model(etype=TP.BFLOAT16, scale=SCALE.astype(bf), bias=BIAS.astype(bf), ctype=TP.BFLOAT16)
    out, _, _ = fuse(model)
    assert op_counts(out) == {"LayerNormalization": 1}
    assert_bf16_equivalent(model, out)


def test_cast_to_lower_precision_in_the_middle_is_refused():
    model = ln_model(cast_mid=TP.FLOAT16, ctype=TP.FLOAT16, cast_out=TP.FLOAT)
    assert_untouched(model)


def test_narrowing_final_cast_stays_outside_the_fusion():
    """fp32 statistics rounded to fp16 before an fp16 scale: LayerNorm in fp32, the Cast and affine stay."""
    net = Net(17)
    y = affine(net, layer_norm(net, "x", cast_out=TP.FLOAT16), fp16(SCALE), fp16(BIAS), etype=TP.FLOAT16)
    model = net.model(y, [("x", TP.FLOAT, [2, 3, H])], TP.FLOAT16)
    assert_fused(model, leftover={"Cast": 1, "Mul": 1, "Add": 1}, rtol=1e-3, atol=1e-3)


# -- refusals -------------------------------------------------------------------------------------------------

def test_reduction_over_a_non_trailing_axis_is_left_alone():
    """Normalizing over axis 1 of a 3-D tensor is not LayerNormalization(axis=1) (that would span axes 1 and 2)."""
    assert_untouched(ln_model(axes=(1,), scale=None, bias=None))
    assert_untouched(ln_model(axes=(1,)))
    assert_untouched(ln_model(axes=(-3, -2), scale=None, bias=None))


def test_the_two_means_over_different_axes_are_left_alone():
    assert_untouched(ln_model(axes=(-1,), var_axes=(-2, -1)))
    assert_untouched(ln_model(axes=(-2, -1), var_axes=(-1,)))


def test_the_two_means_of_different_inputs_are_left_alone():
    net = Net(17)
    y = affine(net, layer_norm(net, "x", mean_of="z"), SCALE, BIAS)
    assert_untouched(net.model(y, [("x", TP.FLOAT, [2, 3, H]), ("z", TP.FLOAT, [2, 3, H])]))


def test_mean_minus_x_is_left_alone():
    assert_untouched(ln_model(reverse_sub=True))


def test_keepdims_zero_is_left_alone():
    net = Net(17)
    mean = net.mean("x", (-1,), keepdims=0)
    d = net("Sub", "x", mean)
    y = rms_core(net, d, keepdims=0)
    assert_untouched(net.model(y, [("x", TP.FLOAT, [4, 4])]))


def test_wrong_constants_are_left_alone():
    assert_untouched(ln_model(exponent=3.0))
    assert_untouched(ln_model(divide="div1", one=2.0))


def test_non_constant_or_non_scalar_epsilon_is_left_alone():
    net = Net(17)
    y = layer_norm(net, "x", eps="e")
    assert_untouched(net.model(y, [("x", TP.FLOAT, [2, 3, H]), ("e", TP.FLOAT, [])]))
    assert_untouched(ln_model(eps=np.full((H,), 1e-5, np.float32)))


def test_scale_or_bias_broadcasting_over_other_axes_stays_outside():
    """A (S, H) scale/bias is applied after a LayerNorm without it: exact, never absorbed."""
    per_pos = RNG.standard_normal((3, H)).astype(np.float32)
    assert_fused(ln_model(scale=per_pos, bias=BIAS), leftover={"Mul": 1, "Add": 1})
    assert_fused(ln_model(scale=SCALE, bias=per_pos), leftover={"Add": 1})
    assert_fused(ln_model(shape=(4, H), scale=SCALE.reshape(1, 1, H), bias=None), leftover={"Mul": 1})
    # x (4, 1) normalized over its size-1 last axis; a (H,) bias widens that axis: not LayerNorm's bias
    assert_fused(ln_model(shape=(4, 1), scale=None, bias=BIAS), leftover={"Add": 1})


def test_non_constant_scale_stays_outside():
    net = Net(17)
    y = affine(net, layer_norm(net, "x"), "g", BIAS)
    model = net.model(y, [("x", TP.FLOAT, [2, 3, H]), ("g", TP.FLOAT, [H])])
    assert_fused(model, leftover={"Mul": 1, "Add": 1})


@pytest.mark.parametrize("escaping", range(6))  # mean, Sub output, square, variance, variance+eps, std
def test_escaping_intermediate_is_left_alone(escaping):
    net = Net(17)
    y = affine(net, layer_norm(net, "x"), SCALE, BIAS)
    kept = net.nodes[escaping].output[0]
    assert_untouched(net.model(y, [("x", TP.FLOAT, [2, 3, H])], outputs=((kept, TP.FLOAT),)))
    net.nodes.append(helper.make_node("Relu", [kept], ["extra"]))
    assert_untouched(net.model(y, [("x", TP.FLOAT, [2, 3, H])], outputs=(("extra", TP.FLOAT),)))


def test_normalized_output_used_twice_keeps_the_affine_outside():
    net = Net(17)
    normed = layer_norm(net, "x")
    y = affine(net, normed, SCALE, BIAS)
    net.nodes.append(helper.make_node("Relu", [normed], ["extra"]))
    model = net.model(y, [("x", TP.FLOAT, [2, 3, H])], outputs=(("extra", TP.FLOAT),))
    assert_fused(model, leftover={"Mul": 1, "Add": 1, "Relu": 1})


def test_rank0_input_is_left_alone():
    """A scalar "normalized" over all of its (zero) axes: LayerNormalization needs an axis to exist."""
    net = Net(17)
    mean = net("ReduceMean", "x", keepdims=1)  # no axes: every axis, here none
    d = net("Sub", "x", mean)
    sq = net("Mul", d, d)
    std = net("Sqrt", net("Add", net("ReduceMean", sq, keepdims=1), net.const(1e-5)))
    assert_untouched(net.model(net("Div", d, std), [("x", TP.FLOAT, [])]))


def test_rank_raising_epsilon_and_eps_outside_the_sqrt_are_left_alone():
    """A (1, 1, 1) eps on a 2-D input makes the result 3-D; sqrt(var) + eps is another function."""
    assert_untouched(ln_model(shape=(4, H), eps=np.full((1, 1, 1), 1e-5, np.float32), scale=None, bias=None))
    net = Net(17)
    mean = net.mean("x", (-1,))
    d = net("Sub", "x", mean)
    std = net("Add", net("Sqrt", net.mean(net("Mul", d, d), (-1,))), net.const(1e-3))
    assert_untouched(net.model(net("Div", d, std), [("x", TP.FLOAT, [2, 3, H])]))


def test_intermediate_read_inside_a_branch_is_left_alone():
    """An outer-scope use (a node in an If branch) is a use like any other: the statistics escape."""
    net = Net(17)
    y = layer_norm(net, "x")
    kept = net.nodes[1].output[0]  # x - mean
    branch = [helper.make_graph([helper.make_node(op, [kept], [f"{op}_out"])], op, [],
                                [helper.make_tensor_value_info(f"{op}_out", TP.FLOAT, None)]) for op in ("Neg", "Abs")]
    net.nodes.append(helper.make_node("If", ["c"], ["z"], then_branch=branch[0], else_branch=branch[1]))
    model = net.model(y, [("x", TP.FLOAT, [2, 3, H]), ("c", TP.BOOL, [])], outputs=(("z", TP.FLOAT),))
    assert_untouched(model)


def test_unknown_normalized_dim_is_left_alone():
    assert_untouched(ln_model(shape=["b", "s", "h"], scale=None, bias=None))


def test_below_opset_17_the_pass_is_skipped():
    out, pm, _ = fuse(ln_model(opset=16))
    assert pm.stats["fuse-layernorm"].skipped and not ln_nodes(out)


def test_graph_output_name_is_kept():
    model = ln_model()
    out, _, _ = fuse(model)
    assert out.graph.output[0].name == model.graph.output[0].name and ln_nodes(out)[0].output[0] == "t8"


# -- real exports (tests/zoo.py) ------------------------------------------------------------------------------

#: What the real-export tests run: the passes that expose the norms (folded axes, Split for shape inference) + ours.
ZOO_PASSES = ["fold-constants", "sequence-to-split", "fuse-layernorm", "fuse-rmsnorm"]


def zoo_cases(names: tuple[str, ...]) -> list:
    """(name, exporter) params; dynamo exports are slow to make, so marked slow."""
    return [pytest.param(n, e, marks=[pytest.mark.slow] if e == "dynamo" else [], id=f"{n}-{e}")
            for n in names for e in EXPORTERS]


def optimize_zoo(name: str, exporter: str, opset=None):
    """(original, optimized, report) of zoo model ``name`` through :data:`ZOO_PASSES`; outputs checked equal."""
    model = onnx.load(str(zoo_model(name, exporter)))
    report = Report()
    out = k3opt.api.optimize(model, passes=ZOO_PASSES, opset=opset, report=report)
    assert_equivalent(model, out, feeds=zoo_inputs(name), rtol=1e-4, atol=1e-5)
    return model, out, report


def norm_modules(name: str, suffix: str) -> int:
    """How many normalization modules (class name ending in ``suffix``) the torch model has."""
    return sum(type(m).__name__.endswith(suffix) for m in zoo_torch_model(name).modules())


@needs_torch
@pytest.mark.parametrize("name, exporter", zoo_cases(("bert", "gpt2", "vit")))
def test_every_layer_norm_of_real_exports_is_fused(name, exporter):
    """TorchScript (opset 14, raised to 17) decomposes every LayerNorm; all come back as LayerNormalization."""
    _, out, _ = optimize_zoo(name, exporter)
    counts = op_counts(out)
    assert counts.get("LayerNormalization") == norm_modules(name, "LayerNorm") and "ReduceMean" not in counts


def export_fp16(module_fn, exporter: str, tmp_path) -> onnx.ModelProto:
    """A tiny fp16 torch module (``module_fn(torch)``) exported on (2, 3, H) input: the real fp16 Cast forms."""
    import torch

    torch.manual_seed(0)
    module = module_fn(torch).half().eval()
    path = tmp_path / f"{exporter}.onnx"
    x = torch.randn(2, 3, H, dtype=torch.float16)
    kwargs = {"dynamo": True, "optimize": False, "opset_version": 18} if exporter == "dynamo" \
        else {"dynamo": False, "opset_version": 14}
    torch.onnx.export(module, (x,), str(path), input_names=["x"], **kwargs)
    return onnx.load(str(path))


def optimize_fp16(model: onnx.ModelProto, opset: int = 23) -> onnx.ModelProto:
    out = k3opt.api.optimize(model, passes=ZOO_PASSES, opset=opset)
    feeds = {"x": RNG.standard_normal((2, 3, H)).astype(np.float16)}
    assert_equivalent(model, out, feeds=feeds, rtol=1e-2, atol=1e-2)
    return out


@needs_torch
def test_torchscript_fp16_layer_norm_export(tmp_path):
    """TorchScript on fp16: the Sub in fp16, a Cast to double for the statistics, a Cast back: all fused."""
    model = export_fp16(lambda torch: torch.nn.LayerNorm(H), "torchscript", tmp_path)
    assert "Cast" in op_counts(model)
    assert op_counts(optimize_fp16(model)) == {"LayerNormalization": 1}


@pytest.mark.parametrize("exponent, divide", [(2.000002, "div"), (-0.5000003, "pow")])
def test_an_exponent_near_but_not_exactly_the_norms_is_declined(exponent, divide):
    """Constants match to a relative 1e-6, which is not exact for an exponent: Pow(d, 2.000002) is NaN for a
    negative d (the fuzz suite found fuse-layernorm fusing it)."""
    model = ln_model(square="pow", divide=divide)
    want = 2.0 if exponent > 0 else -0.5
    for t in model.graph.initializer:
        if t.dims == [] and onnx.numpy_helper.to_array(t).item() == want:
            t.CopyFrom(onnx.numpy_helper.from_array(np.array(exponent, np.float32), t.name))
            break
    else:
        raise AssertionError("no exponent initializer")
    assert_untouched(model)
