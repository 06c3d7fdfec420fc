"""Small seed models the mutators start from: each a different corner of what k3opt reads and rewrites."""
from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto as T, helper, numpy_helper

F, H, I64 = T.FLOAT, T.FLOAT16, T.INT64


def _model(nodes, inputs, outputs, inits=None, opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "seed", [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_tensor_value_info(*o) for o in outputs],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in (inits or {}).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _weights(*shapes: tuple) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def mlp() -> onnx.ModelProto:
    """MatMul + Add -> Relu -> MatMul (fuse-matmul-add, Gemm)."""
    w1, b1, w2 = _weights((8, 16), (16,), (16, 4))
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m"]), helper.make_node("Add", ["m", "b1"], ["a"]),
             helper.make_node("Relu", ["a"], ["r"]), helper.make_node("MatMul", ["r", "w2"], ["y"])]
    return _model(nodes, [("x", F, [2, 8])], [("y", F, [2, 4])], {"w1": w1, "b1": b1, "w2": w2})


def layer_norm() -> onnx.ModelProto:
    """A decomposed LayerNorm (fuse-layernorm), as exporters below opset 17 write it."""
    scale, bias = _weights((8,), (8,))
    nodes = [helper.make_node("ReduceMean", ["x"], ["mu"], axes=[-1]), helper.make_node("Sub", ["x", "mu"], ["d"]),
             helper.make_node("Pow", ["d", "two"], ["sq"]), helper.make_node("ReduceMean", ["sq"], ["var"], axes=[-1]),
             helper.make_node("Add", ["var", "eps"], ["ve"]), helper.make_node("Sqrt", ["ve"], ["sd"]),
             helper.make_node("Div", ["d", "sd"], ["n"]), helper.make_node("Mul", ["n", "scale"], ["s"]),
             helper.make_node("Add", ["s", "bias"], ["y"])]
    return _model(nodes, [("x", F, [2, 4, 8])], [("y", F, [2, 4, 8])],
                  {"two": np.float32(2), "eps": np.float32(1e-5), "scale": scale, "bias": bias}, opset=13)


def shapes() -> onnx.ModelProto:
    """Shape arithmetic with Constant nodes (fold-constants), a Transpose pair and a Softmax."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Constant", [], ["i0"], value=numpy_helper.from_array(np.array(0, np.int64))),
             helper.make_node("Gather", ["s", "i0"], ["b"]), helper.make_node("Unsqueeze", ["b", "ax"], ["b1"]),
             helper.make_node("Concat", ["b1", "rest"], ["target"], axis=0),
             helper.make_node("Reshape", ["x", "target"], ["r"]),
             helper.make_node("Transpose", ["r"], ["t1"], perm=[0, 2, 1]),
             helper.make_node("Transpose", ["t1"], ["t2"], perm=[0, 2, 1]),
             helper.make_node("Softmax", ["t2"], ["y"], axis=-1)]
    return _model(nodes, [("x", F, ["batch", 6])], [("y", F, ["batch", 2, 3])],
                  {"ax": np.array([0], np.int64), "rest": np.array([2, 3], np.int64)})


def branches() -> onnx.ModelProto:
    """An If on a constant condition (inline-constant-if), Identity and an inference Dropout (clean-ups)."""
    then = helper.make_graph([helper.make_node("Neg", ["x"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", F, [3])])
    other = helper.make_graph([helper.make_node("Abs", ["x"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", F, [3])])
    nodes = [helper.make_node("If", ["c"], ["b"], then_branch=then, else_branch=other),
             helper.make_node("Identity", ["b"], ["i"]), helper.make_node("Dropout", ["i"], ["y"])]
    return _model(nodes, [("x", F, [3])], [("y", F, [3])], {"c": np.array(True)})


def half() -> onnx.ModelProto:
    """float16 arithmetic between Casts, on a constant too (folding in float16)."""
    nodes = [helper.make_node("Cast", ["x"], ["h"], to=H), helper.make_node("Exp", ["k"], ["ek"]),
             helper.make_node("Mul", ["h", "ek"], ["m"]), helper.make_node("Cast", ["m"], ["y"], to=F)]
    return _model(nodes, [("x", F, [4])], [("y", F, [4])], {"k": np.array([0.5, 1, 2, 3], np.float16)})


def embedding() -> onnx.ModelProto:
    """Token ids into an embedding table (verification sizes ids below the rows), then a residual Add."""
    table, pos = _weights((16, 8), (4, 8))
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"]), helper.make_node("Add", ["e", "pos"], ["y"])]
    return _model(nodes, [("ids", I64, [1, 4])], [("y", F, [1, 4, 8])], {"table": table, "pos": pos})


SEEDS: dict[str, Callable[[], onnx.ModelProto]] = {
    "mlp": mlp, "layer_norm": layer_norm, "shapes": shapes, "branches": branches, "half": half,
    "embedding": embedding,
}
