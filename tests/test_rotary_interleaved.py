"""The interleaved rotary form (GPT-J, CodeGen): ``x * cos + rotate_every_two(x) * sin`` with
``rotate_every_two(x) = stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)`` and cos/sin
``repeat_interleave(2)`` of half-width angles. fuse-rotary makes it RotaryEmbedding interleaved=1,
lower-rotary-npu NPURotaryPositionEmbedding mode 1 (11SD angles only); anything not proven stays as it is."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP

import k3opt
from k3opt.cann_bridge import check_model, invariant_violations
from k3opt.report import Report
from tests.helpers import op_counts
from tests.test_layer_norm import Net, needs_torch
from tests.test_rotary import D, INV_FREQ, X, assert_fused, fuse, i64, model_of, refused, rope_nodes

BIG = np.iinfo(np.int64).max
NPU_ROPE = "NPURotaryPositionEmbedding"


def paired_angles(net: Net, repeat: str = "tile", flatten: str = "const", batch: bool = False,
                  axes=(1, 4), repeats=(1, 1, 1, 1, 2)) -> list[str]:
    """cos/sin (1|B, 1, S, D) as GPT-J builds them: ``repeat_interleave(trig(pos * inv_freq)[:, None], 2, 3)``,
    the repeat as TorchScript (Tile) or dynamo (Expand) writes it; ``batch``: GPT-J's position_ids input (B, S)."""
    if batch:
        pos = "pos"
    else:
        seq = net("Gather", net("Shape", "x"), i64(net, 2), axis=0)
        pos = net("Unsqueeze", net("Range", i64(net, 0), seq, i64(net, 1)), i64(net, [0]))
    ang = net("Mul", net("Cast", net("Unsqueeze", pos, i64(net, [2])), to=TP.FLOAT), net.const(INV_FREQ))
    out = []
    for trig in ("Cos", "Sin"):
        pairs = net("Unsqueeze", net(trig, ang), i64(net, list(axes)))
        twice = net("Tile" if repeat == "tile" else "Expand", pairs, i64(net, list(repeats)))
        out.append(net("Reshape", twice, flat_shape(net, twice, flatten)))
    return out


def flat_shape(net: Net, t: str, flatten: str) -> str:
    """The shape of ``flatten(-2)``: a constant (dynamo) or ``Concat(Shape(t)[0:3], [-1])`` (TorchScript)."""
    if flatten == "const":
        return i64(net, [0, 0, 0, -1])
    return net("Concat", net("Slice", net("Shape", t), i64(net, [0]), i64(net, [3]), i64(net, [0])), i64(net, [-1]),
               axis=0)


def every_two(net: Net, cos: str, sin: str, neg: str = "neg", steps=(0, 1, 2), swap: bool = False, x: str = "x"
              ) -> str:
    """``x * cos + stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2) * sin`` (GPT-J's apply_rotary_pos_emb);
    ``steps``: (first, second, step) of the slices; ``swap``: the minus on the even elements."""
    first, second, step = steps
    stop = BIG if step == 2 else second
    even = net("Slice", x, i64(net, [first]), i64(net, [stop]), i64(net, [3]), i64(net, [step]))
    odd = net("Slice", x, i64(net, [second]), i64(net, [BIG]), i64(net, [3]), i64(net, [step]))
    if swap:
        even, odd = odd, even
    minus = net("Neg", odd) if neg == "neg" else net("Mul", odd, net.const(-1.0))
    stacked = net("Concat", net("Unsqueeze", minus, i64(net, [-1])), net("Unsqueeze", even, i64(net, [-1])), axis=-1)
    rotated = net("Reshape", stacked, flat_shape(net, stacked, "const"))  # a Shape of it would be a second use
    return net("Add", net("Mul", x, cos), net("Mul", rotated, sin))


POS = ("pos", TP.INT64, ["b", "s"])


def gptj_model(opset: int = 23, angles=None, inputs=(X,), **kw) -> onnx.ModelProto:
    net = Net(opset)
    cos, sin = angles(net) if angles else paired_angles(net)
    return model_of(net, every_two(net, cos, sin, **kw), inputs=inputs)


# -- fused --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flatten", ["const", "shape"])
@pytest.mark.parametrize("repeat", ["tile", "expand"])
@pytest.mark.parametrize("neg", ["neg", "mul"])
def test_interleaved_becomes_rotary_embedding_interleaved(neg, repeat, flatten):
    model = gptj_model(angles=lambda net: paired_angles(net, repeat, flatten), neg=neg)
    assert "Neg" not in op_counts(assert_fused(model, interleaved=1))


def test_positions_per_batch_row_give_batch_caches():
    assert_fused(gptj_model(angles=lambda net: paired_angles(net, batch=True), inputs=(X, POS)), interleaved=1)


def test_partial_interleaved_becomes_rotary_embedding_dim():
    """GPT-J with rotary_dim < head_dim: cat(rope(q[..., :8]), q[..., 8:]) of a head dim 12."""
    net = Net(23)
    head = net("Slice", "x", i64(net, [0]), i64(net, [D]), i64(net, [-1]), i64(net, [1]))
    tail = net("Slice", "x", i64(net, [D]), i64(net, [BIG]), i64(net, [-1]), i64(net, [1]))
    y = net("Concat", every_two(net, *paired_angles(net), x=head), tail, axis=-1)
    out = assert_fused(model_of(net, y, inputs=[("x", TP.FLOAT, ["b", 4, "s", 12])]), rewrites=2, interleaved=1,
                       rotary_embedding_dim=D)
    assert rope_nodes(out)[0].input[0] == "x"


def test_constant_angles_with_equal_pairs():
    """A folded cache (1, 1, S, D) whose pairs (2i, 2i+1) are equal: taken as it is."""
    emb = np.repeat(np.arange(6, dtype=np.float32)[:, None] * INV_FREQ, 2, axis=-1)[None, None]
    x = ("x", TP.FLOAT, [2, 4, 6, D])
    net = Net(23)
    model = model_of(net, every_two(net, net.const(np.cos(emb)), net.const(np.sin(emb))), inputs=[x])
    assert_fused(model, interleaved=1)


# -- refused ------------------------------------------------------------------------------------------------------

def test_constant_angles_with_unequal_pairs_are_refused():
    emb = np.random.default_rng(0).standard_normal((1, 1, 6, D)).astype(np.float32)
    net = Net(23)
    refused(model_of(net, every_two(net, net.const(np.cos(emb)), net.const(np.sin(emb))),
                     inputs=[("x", TP.FLOAT, [2, 4, 6, D])]))


def test_angles_repeated_as_a_whole_are_refused():
    """``repeat(f, 2)`` on the last axis (Concat(f, f)): halves equal, pairs not."""
    def doubled(net: Net) -> list[str]:
        seq = net("Gather", net("Shape", "x"), i64(net, 2), axis=0)
        pos = net("Unsqueeze", net("Range", i64(net, 0), seq, i64(net, 1)), i64(net, [0, 2]))
        ang = net("Mul", net("Cast", pos, to=TP.FLOAT), net.const(INV_FREQ))
        return [net("Unsqueeze", net(trig, net("Concat", ang, ang, axis=-1)), i64(net, [1])) for trig in ("Cos", "Sin")]
    refused(gptj_model(angles=doubled))


def tiled_constants(net: Net, axes, repeats) -> list[str]:
    """cos/sin ``Reshape(Tile(Unsqueeze(f, axes), repeats))`` of constant half-width angles f (1, 6, D/2)."""
    f = (np.arange(6, dtype=np.float32)[:, None] * INV_FREQ)[None]
    unsqueezed = [net("Unsqueeze", net.const(trig(f)), i64(net, list(axes))) for trig in (np.cos, np.sin)]
    return [net("Reshape", net("Tile", u, i64(net, list(repeats))), i64(net, [0, 0, 0, -1])) for u in unsqueezed]


def test_constants_repeat_interleaved_in_the_graph():
    net = Net(23)
    cos, sin = tiled_constants(net, (1, 4), (1, 1, 1, 1, 2))
    assert_fused(model_of(net, every_two(net, cos, sin), inputs=[("x", TP.FLOAT, [2, 4, 6, D])]), interleaved=1)


def test_angles_tiled_whole_are_refused():
    """``Reshape(Tile(Unsqueeze(f, 3), [1, 1, 1, 2, 1]))`` is ``repeat(f, 2)`` (Concat(f, f)), not repeat_interleave."""
    net = Net(23)
    cos, sin = tiled_constants(net, (1, 3), (1, 1, 1, 2, 1))
    model = model_of(net, every_two(net, cos, sin), inputs=[("x", TP.FLOAT, [2, 4, 6, D])])
    refused(model)
    _, _, ctx = fuse(model)
    assert [site["reason"] for site in ctx.sites.values()] == [
        "check declined: cos is not proven repeat_interleave(2) of half-width angles (equal pairs)"]


def test_minus_on_the_even_elements_is_refused():
    refused(gptj_model(swap=True))


def test_halves_instead_of_step_2_slices_are_refused():
    """``stack((-x[..., D/2:], x[..., :D/2]), -1).flatten(-2)``: step-1 slices, not GPT-J's rotation."""
    refused(gptj_model(steps=(0, D // 2, 1)))


# -- lowered to the NPU -------------------------------------------------------------------------------------------

def cann(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    report = Report()
    out = k3opt.optimize(model, target="cann", verify=True, report=report)
    assert report.verification["status"] == "passed"
    assert report.lowering_verification["status"] == "passed", report.lowering_verification
    assert invariant_violations(out) == [] and [str(f) for f in check_model(out) if f.kind != "dynamic"] == []
    return out, [line for line in report.lowering if "rotary" in line.lower()]


def test_interleaved_becomes_mode_1_with_11sd_angles():
    out, lines = cann(gptj_model(opset=17))
    nodes = [node for node in out.graph.node if node.op_type == NPU_ROPE]
    assert [[(a.name, a.i) for a in node.attribute] for node in nodes] == [[("mode", 1)]]
    assert lines[0] == "NPURotaryPositionEmbedding: 1 of 1 rotary embedding(s) lowered (mode 1)"
    assert lines[1].endswith("-> NPURotaryPositionEmbedding (mode 1)")
    assert "Expand" not in op_counts(out)  # 11SD as multiplied: mode 1 has no B1SD layout


def test_angles_with_x_s_batch_are_kept_for_mode_1():
    out, lines = cann(gptj_model(opset=17, angles=lambda net: paired_angles(net, batch=True), inputs=(X, POS)))
    assert NPU_ROPE not in op_counts(out)
    assert lines[1].endswith("kept decomposed: cos/sin have x's batch: mode 1 (interleave) takes only 11SD cos/sin")


# -- exported from torch -----------------------------------------------------------------------------------------

def gptj_rotation():
    """A tiny torch module applying GPT-J's apply_rotary_pos_emb to a (B, N, S, D) tensor, at positions
    ``arange(S)`` or GPT-J's ``position_ids`` input (B, S)."""
    import torch

    class Rotation(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("inv_freq", torch.from_numpy(INV_FREQ))

        def forward(self, x, position_ids=None):
            pos = torch.arange(x.shape[2])[None] if position_ids is None else position_ids
            ang = pos[:, :, None].float() * self.inv_freq
            sin = torch.repeat_interleave(torch.sin(ang)[:, None], 2, 3)
            cos = torch.repeat_interleave(torch.cos(ang)[:, None], 2, 3)
            x1, x2 = x[:, :, :, ::2], x[:, :, :, 1::2]
            return x * cos + torch.stack((-x2, x1), dim=-1).flatten(-2) * sin

    return Rotation().eval()


def export(exporter: str, batch_positions: bool, tmp_path) -> onnx.ModelProto:
    import torch

    torch.manual_seed(0)
    path = str(tmp_path / f"{exporter}.onnx")
    args = (torch.randn(2, 4, 5, D),) + ((torch.arange(5)[None].expand(2, 5),) if batch_positions else ())
    names = ["x", "position_ids"][:len(args)]
    if exporter == "dynamo":
        b, s = torch.export.Dim("b"), torch.export.Dim("s")
        shapes = {"x": {0: b, 2: s}, "position_ids": {0: b, 1: s}}
        shapes = {k: v for k, v in shapes.items() if k in names}
        torch.onnx.export(gptj_rotation(), args, path, input_names=names, dynamo=True, dynamic_shapes=shapes,
                          opset_version=18)
    else:
        axes = {"x": {0: "b", 2: "s"}, "position_ids": {0: "b", 1: "s"}}
        torch.onnx.export(gptj_rotation(), args, path, input_names=names, dynamo=False, opset_version=17,
                          dynamic_axes={k: v for k, v in axes.items() if k in names})
    return onnx.load(path)


@needs_torch
@pytest.mark.parametrize("batch_positions", [False, True])
@pytest.mark.parametrize("exporter", ["torchscript", pytest.param("dynamo", marks=pytest.mark.slow)])
def test_torch_exports_fuse_and_lower(exporter, batch_positions, tmp_path):
    model = export(exporter, batch_positions, tmp_path)
    report = Report()
    out = k3opt.optimize(model, opset=23, verify=True, report=report)
    assert report.verification["status"] == "passed"
    assert [[(a.name, a.i) for a in node.attribute] for node in rope_nodes(out)] == [[("interleaved", 1)]]
    lowered, _ = cann(model)
    assert op_counts(lowered).get(NPU_ROPE, 0) == (0 if batch_positions else 1)


@needs_torch
@pytest.mark.slow
def test_transformers_gptj_stays_decomposed(tmp_path):
    """The CURRENT REFUSAL, documented: transformers' GPT-J rotates q/k in the (batch, positions, heads, D)
    layout, before the head transpose, with angles (batch, positions, 1, D) that vary along dim 1; that is not
    RotaryEmbedding's 4-D layout, so its rotations stay as they are (and the model's outputs with them)."""
    import torch
    from transformers import GPTJConfig, GPTJForCausalLM

    torch.manual_seed(0)
    config = GPTJConfig(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=4, rotary_dim=8, use_cache=False)

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = GPTJForCausalLM(config).eval()

        def forward(self, input_ids):
            return self.lm(input_ids=input_ids, use_cache=False).logits

    path = str(tmp_path / "gptj.onnx")
    dims = {"input_ids": {0: torch.export.Dim("b"), 1: torch.export.Dim("s")}}
    torch.onnx.export(Logits(), (torch.randint(0, 64, (2, 5)),), path, input_names=["input_ids"], dynamo=True,
                      dynamic_shapes=dims, opset_version=18)
    report = Report()
    out = k3opt.optimize(onnx.load(path), opset=23, verify=True, report=report)
    assert report.verification["status"] == "passed" and rope_nodes(out) == []
    assert {site["status"] for site in report.sites if site["rule"] == "rotary-interleaved"} == {"declined"}
