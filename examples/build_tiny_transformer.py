"""Build examples/tiny_transformer.onnx: a 2-layer transformer encoder made with onnx.helper only.

The graph looks like an unoptimized exporter's output, so every k3opt pass
has something to do: decomposed LayerNorm (ReduceMean/Sub/Pow/Sqrt/Div),
MatMul + Add projections, Q/K/V sibling MatMuls reading one activation,
Identity and inference-mode Dropout nodes, and an erf GELU. Random weights
from a fixed seed; the file is rebuilt byte-identically.

    python examples/build_tiny_transformer.py [OUT.onnx]
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

VOCAB, HIDDEN, HEADS, FFN, LAYERS, MAX_POS = 100, 32, 4, 64, 2, 512


class _Builder:
    """Collects nodes and initializers with unique, readable names."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def const(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(self, name: str, *shape: int, scale: float = 0.1) -> str:
        return self.const(name, (self.rng.standard_normal(shape) * scale).astype(np.float32))

    def op(self, op_type: str, inputs: list[str], name: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op_type, inputs, [name], name=name, **attrs))
        return name

    def linear(self, x: str, prefix: str, n_in: int, n_out: int) -> str:
        mm = self.op("MatMul", [x, self.weight(f"{prefix}.weight", n_in, n_out)], f"{prefix}/MatMul")
        return self.op("Add", [mm, self.weight(f"{prefix}.bias", n_out)], f"{prefix}/Add")

    def layer_norm(self, x: str, prefix: str) -> str:
        """LayerNorm over the last axis, decomposed as exporters emit it."""
        mean = self.op("ReduceMean", [x], f"{prefix}/ReduceMean", axes=[-1], keepdims=1)
        centered = self.op("Sub", [x, mean], f"{prefix}/Sub")
        sq = self.op("Pow", [centered, self.const(f"{prefix}.two", np.float32(2.0))], f"{prefix}/Pow")
        var = self.op("ReduceMean", [sq], f"{prefix}/ReduceMean_1", axes=[-1], keepdims=1)
        var_eps = self.op("Add", [var, self.const(f"{prefix}.eps", np.float32(1e-5))], f"{prefix}/Add")
        std = self.op("Sqrt", [var_eps], f"{prefix}/Sqrt")
        normed = self.op("Div", [centered, std], f"{prefix}/Div")
        scaled = self.op("Mul", [normed, self.weight(f"{prefix}.weight", HIDDEN, scale=1.0)], f"{prefix}/Mul")
        return self.op("Add", [scaled, self.weight(f"{prefix}.bias", HIDDEN)], f"{prefix}/Add_1")

    def gelu(self, x: str, prefix: str) -> str:
        """x * 0.5 * (1 + erf(x / sqrt(2)))."""
        d = self.op("Div", [x, self.const(f"{prefix}.sqrt2", np.float32(np.sqrt(2.0)))], f"{prefix}/Div")
        e = self.op("Erf", [d], f"{prefix}/Erf")
        a = self.op("Add", [e, self.const(f"{prefix}.one", np.float32(1.0))], f"{prefix}/Add")
        m = self.op("Mul", [x, a], f"{prefix}/Mul")
        return self.op("Mul", [m, self.const(f"{prefix}.half", np.float32(0.5))], f"{prefix}/Mul_1")

    def heads(self, x: str, prefix: str) -> str:
        """[B, S, H*D] -> [B, H, S, D]."""
        shape = self.const(f"{prefix}.heads_shape", np.array([0, 0, HEADS, HIDDEN // HEADS], dtype=np.int64))
        r = self.op("Reshape", [x, shape], f"{prefix}/Reshape")
        return self.op("Transpose", [r], f"{prefix}/Transpose", perm=[0, 2, 1, 3])

    def attention(self, x: str, bias: str, prefix: str) -> str:
        q = self.heads(self.linear(x, f"{prefix}.query", HIDDEN, HIDDEN), f"{prefix}.q")
        k = self.heads(self.linear(x, f"{prefix}.key", HIDDEN, HIDDEN), f"{prefix}.k")
        v = self.heads(self.linear(x, f"{prefix}.value", HIDDEN, HIDDEN), f"{prefix}.v")
        kt = self.op("Transpose", [k], f"{prefix}/Transpose_kt", perm=[0, 1, 3, 2])
        scores = self.op("MatMul", [q, kt], f"{prefix}/MatMul_qk")
        scale = self.const(f"{prefix}.scale", np.float32(np.sqrt(HIDDEN // HEADS)))
        scores = self.op("Add", [self.op("Div", [scores, scale], f"{prefix}/Div"), bias], f"{prefix}/Add_mask")
        probs = self.op("Softmax", [scores], f"{prefix}/Softmax", axis=-1)
        probs = self.op("Dropout", [probs], f"{prefix}/Dropout")
        ctx = self.op("MatMul", [probs, v], f"{prefix}/MatMul_pv")
        ctx = self.op("Transpose", [ctx], f"{prefix}/Transpose_ctx", perm=[0, 2, 1, 3])
        merged = self.const(f"{prefix}.merge_shape", np.array([0, 0, HIDDEN], dtype=np.int64))
        ctx = self.op("Reshape", [ctx, merged], f"{prefix}/Reshape_ctx")
        return self.op("Identity", [self.linear(ctx, f"{prefix}.output", HIDDEN, HIDDEN)], f"{prefix}/Identity")

    def encoder_layer(self, x: str, bias: str, i: int) -> str:
        p = f"layer.{i}"
        attn = self.attention(x, bias, f"{p}.attention")
        x = self.layer_norm(self.op("Add", [attn, x], f"{p}/Add_res1"), f"{p}.ln1")
        h = self.gelu(self.linear(x, f"{p}.ffn.up", HIDDEN, FFN), f"{p}.ffn.gelu")
        h = self.op("Dropout", [self.linear(h, f"{p}.ffn.down", FFN, HIDDEN)], f"{p}.ffn/Dropout")
        return self.layer_norm(self.op("Add", [h, x], f"{p}/Add_res2"), f"{p}.ln2")


def build(seed: int = 0) -> onnx.ModelProto:
    """The tiny encoder: (input_ids, attention_mask) [batch, seq] int64 -> last_hidden_state [batch, seq, 32]."""
    b = _Builder(seed)
    words = b.op("Gather", [b.weight("embeddings.word", VOCAB, HIDDEN, scale=1.0), "input_ids"], "embed/Gather")
    shape = b.op("Shape", ["input_ids"], "embed/Shape")
    seq = b.op("Gather", [shape, b.const("embed.one", np.array(1, dtype=np.int64))], "embed/Gather_seq", axis=0)
    zero, one = b.const("embed.zero", np.array(0, dtype=np.int64)), "embed.one"
    positions = b.op("Range", [zero, seq, one], "embed/Range")
    pos = b.op("Gather", [b.weight("embeddings.position", MAX_POS, HIDDEN, scale=1.0), positions], "embed/Gather_pos")
    x = b.layer_norm(b.op("Add", [words, pos], "embed/Add"), "embeddings.ln")
    x = b.op("Dropout", [x], "embed/Dropout")
    # Additive attention bias [B, 1, 1, S]: 0 where mask == 1, -10000 where mask == 0.
    m = b.op("Cast", [b.op("Unsqueeze", ["attention_mask", b.const("mask.axes", np.array([1, 2], dtype=np.int64))],
                           "mask/Unsqueeze")], "mask/Cast", to=TensorProto.FLOAT)
    inv = b.op("Sub", [b.const("mask.one", np.float32(1.0)), m], "mask/Sub")
    bias = b.op("Mul", [inv, b.const("mask.neg", np.float32(-10000.0))], "mask/Mul")
    for i in range(LAYERS):
        x = b.encoder_layer(x, bias, i)
    b.nodes.append(helper.make_node("Identity", [x], ["last_hidden_state"], name="output/Identity"))
    graph = helper.make_graph(
        b.nodes, "tiny_transformer",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", "sequence", HIDDEN])],
        b.inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="k3opt-examples")
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("tiny_transformer.onnx")
    onnx.save(build(), out)
    print(f"wrote {out} ({out.stat().st_size} bytes)")
