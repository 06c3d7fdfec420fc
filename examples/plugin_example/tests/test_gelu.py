"""The fuse-gelu plugin: every exporter form is fused exactly, and look-alikes are refused.

Runs through k3opt's public API exactly as a user would: ``k3opt.optimize(model,
plugins=[...])``; each fused model is compared with the original in onnxruntime.
"""
from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import k3opt
from k3opt.report import Report

PLUGIN = "k3opt_gelu.rules:register"
F = TensorProto.FLOAT


class G:
    """A tiny graph builder: ``g.op("Mul", a, b)`` adds a node and returns its output name."""

    def __init__(self, const_nodes: bool = False):
        self.nodes, self.inits, self.const_nodes, self.n = [], [], const_nodes, 0

    def const(self, value: float) -> str:
        self.n += 1
        name, arr = f"c{self.n}", np.array(value, np.float32)
        if self.const_nodes:
            self.nodes.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(arr)))
        else:
            self.inits.append(numpy_helper.from_array(arr, name))
        return name

    def op(self, op_type: str, *inputs, **attrs) -> str:
        self.n += 1
        out = f"t{self.n}"
        names = [self.const(i) if isinstance(i, float) else i for i in inputs]
        self.nodes.append(helper.make_node(op_type, names, [out], **attrs))
        return out

    def model(self, outputs: list[str], opset: int = 20) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, "gelu", [helper.make_tensor_value_info("x", F, ["b", 8])],
                                  [helper.make_tensor_value_info(o, F, None) for o in outputs], self.inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})


def optimize_and_compare(model: onnx.ModelProto) -> dict[str, int]:
    out = k3opt.optimize(model, passes=["fuse-gelu"], plugins=[PLUGIN])
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32) * 3
    for a, b in zip(run(model, x), run(out, x)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    counts: dict[str, int] = {}
    for n in out.graph.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return counts


def erf_gelu(g: G, assoc: int, scale_by_mul: bool = False, swap: bool = False, half: float = 0.5) -> str:
    scaled = g.op("Mul", "x", 1 / math.sqrt(2)) if scale_by_mul else g.op("Div", "x", math.sqrt(2))
    erf = g.op("Erf", scaled)
    cdf = g.op("Add", 1.0, erf) if swap else g.op("Add", erf, 1.0)
    if assoc == 0:
        return g.op("Mul", g.op("Mul", "x", cdf), half)
    if assoc == 1:
        return g.op("Mul", g.op("Mul", half, "x"), cdf)
    return g.op("Mul", g.op("Mul", cdf, half), "x")


def tanh_gelu(g: G, pow_form: bool = True, k: float = 0.044715) -> str:
    cube = g.op("Pow", "x", 3.0) if pow_form else g.op("Mul", g.op("Mul", "x", "x"), "x")
    inner = g.op("Mul", math.sqrt(2 / math.pi), g.op("Add", "x", g.op("Mul", k, cube)))
    return g.op("Mul", g.op("Mul", 0.5, "x"), g.op("Add", 1.0, g.op("Tanh", inner)))


@pytest.mark.parametrize("assoc", [0, 1, 2])
@pytest.mark.parametrize("scale_by_mul,swap,const_nodes", [(False, False, False), (True, True, False),
                                                           (False, True, True)])
def test_erf_forms_fused(assoc, scale_by_mul, swap, const_nodes):
    g = G(const_nodes)
    y = erf_gelu(g, assoc, scale_by_mul, swap)
    assert optimize_and_compare(g.model([y])) == {"Gelu": 1}


@pytest.mark.parametrize("pow_form", [True, False])
def test_tanh_forms_fused(pow_form):
    g = G()
    y = tanh_gelu(g, pow_form)
    out = k3opt.optimize(g.model([y]), passes=["fuse-gelu"], plugins=[PLUGIN])
    assert [(n.op_type, n.attribute[0].s) for n in out.graph.node] == [("Gelu", b"tanh")]
    assert optimize_and_compare(g.model([y])) == {"Gelu": 1}


def test_wrong_constants_refused():
    g = G()
    y1 = erf_gelu(g, 0, half=0.6)
    y2 = tanh_gelu(g, k=0.05)
    assert "Gelu" not in optimize_and_compare(g.model([y1, y2]))


def test_shared_intermediate_refused():
    g = G()
    y = erf_gelu(g, 0)
    erf = next(n.output[0] for n in g.nodes if n.op_type == "Erf")
    assert "Gelu" not in optimize_and_compare(g.model([y, erf]))


def test_below_opset_20_skipped_with_note():
    g = G()
    y = erf_gelu(g, 0)
    report = Report()
    out = k3opt.optimize(g.model([y], opset=18), passes=["fuse-gelu"], plugins=[PLUGIN], report=report)
    assert "Gelu" not in {n.op_type for n in out.graph.node}
    assert any("fuse-gelu skipped: needs opset 20" in n for n in report.notes)


@pytest.mark.slow
@pytest.mark.parametrize("dynamo", [False, True])
def test_real_torch_export_of_hf_activations(dynamo):
    """Hugging Face's GELUActivation (erf) and NewGELUActivation (tanh, GPT-2) as torch exports them at
    opset 17; k3opt raises the opset to 20, fuses both, and its own verification compares outputs."""
    torch = pytest.importorskip("torch")
    activations = pytest.importorskip("transformers.activations")
    import io

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)
            self.erf_gelu, self.tanh_gelu = activations.GELUActivation(), activations.NewGELUActivation()

        def forward(self, x):
            return self.tanh_gelu(self.linear(self.erf_gelu(x)))

    buf = io.BytesIO()
    torch.onnx.export(Block().eval(), (torch.randn(2, 8),), buf, opset_version=17, dynamo=dynamo,
                      input_names=["x"])
    out = k3opt.optimize(onnx.load_from_string(buf.getvalue()), opset=20, passes=["fuse-gelu"], plugins=[PLUGIN],
                         verify=True)
    assert [n.op_type for n in out.graph.node if n.op_type != "Constant"] == ["Gelu", "Gemm", "Gelu"]
