"""Graphs other tools made, rebuilt by hand: the forms issue #34 names, where k3opt lost to onnxsim/onnxslim.

Each builder returns a checked ``onnx.ModelProto`` in the shape the exporter emits (fixed seeds, small
sizes); :data:`GRAPHS` maps a name to ``(builder, feeds)`` where ``feeds(batch)`` gives seeded inputs, so
tests can check numerics at two batch sizes (the symbolic dims must come out right for both).
``bench.run --models 'foreign-*'`` compares node counts with onnxsim and onnxslim on the same graphs.

- ``tf-bert-reshape``: tf2onnx's BERT (opset 11, inputs ``[batch_size, 7]``): every Reshape target is
  computed from ``Shape(x)`` through ``Cast``/``Slice``/``Gather``/``ReduceProd``/``Unsqueeze``/``Concat``
  and a Squeeze/Mul of dims, through the symbolic batch;
- ``distilbert-stale-shape``: a reshape graph whose declared output shape holds ``-1`` (strict inference
  fails), with a fully static Shape chain and an unfused MatMul+Add;
- ``distilbert-size-merge``: older PyTorch's head merge, the last dim spelled ``Size(t) / (batch * 5)``;
- ``tf-cnn-pad``: TensorFlow CNN habits: explicit zero ``Pad`` before ``Conv``, before a ``MaxPool`` of a
  Relu, and before an ``AveragePool`` with ``count_include_pad``;
- ``expand-broadcast``: an ``Expand`` to ``Shape`` of the tensor the consumer broadcasts it with anyway;
- ``clip-slice``: ``Clip`` twins differing only in an empty optional input, an unbounded ``Clip``, and a
  ``Slice`` over a dim of size 1 (a no-op);
- ``gemm-scale-where``: a rank-2 MatMul+Add with a computed bias, Whisper's scalar ``Mul`` of a
  projection, ``Where(Not(c), a, b)``, and two identical nodes that both give graph outputs;
- ``softmax-op12``: an opset-12 ``Softmax`` over the trailing axes of a rank-3 tensor (opset 13 changed
  its meaning: converting costs Flatten/Reshape nodes).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper

from .helpers import make_model

F, I64, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _w(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return (rng.standard_normal(shape) * 0.3).astype(np.float32)


def _i64(*v: int) -> np.ndarray:
    return np.array(v, np.int64)


def tf_bert_reshape() -> onnx.ModelProto:
    """tf2onnx BERT self-attention head split/merge on ``x: [batch_size, 7, 16]``, two layers; tf2onnx
    computes shapes in int32 (TensorFlow's ``tf.shape``) and casts the target to int64 at the Reshape."""
    rng = _rng(1)
    S, H, N, D = 7, 16, 2, 8
    i32 = lambda *v: np.array(v, np.int32)  # noqa: E731
    n, inits = [], {"idx0": np.array(0, np.int64), "c_sd": i32(S, N, D), "c_h": i32(H), "c_s": i32(S),
                    "c_s_h": i32(S, H), "start0": _i64(0), "end2": _i64(2), "axes0": _i64(0)}
    x = "x"
    for layer in range(2):
        p = f"l{layer}_"
        inits[p + "w"], inits[p + "b"] = _w(rng, H, H), _w(rng, H)
        # flatten: Cast(Shape(x), int32) -> Slice[0:2] -> ReduceProd -> Concat(prod, H) -> Cast int64 -> Reshape
        n += [helper.make_node("Shape", [x], [p + "sh"]),
              helper.make_node("Cast", [p + "sh"], [p + "shc"], to=TensorProto.INT32),
              helper.make_node("Slice", [p + "shc", "start0", "end2", "axes0"], [p + "bs"]),
              helper.make_node("ReduceProd", [p + "bs"], [p + "prod"], keepdims=1),
              helper.make_node("Concat", [p + "prod", "c_h"], [p + "flat32"], axis=0),
              helper.make_node("Cast", [p + "flat32"], [p + "flat_shape"], to=TensorProto.INT64),
              helper.make_node("Reshape", [x, p + "flat_shape"], [p + "x2"]),
              helper.make_node("MatMul", [p + "x2", p + "w"], [p + "mm"]),
              helper.make_node("Add", [p + "mm", p + "b"], [p + "proj"]),
              # split heads: [Gather(Shape(x), 0), S, N, D]
              helper.make_node("Gather", [p + "shc", "idx0"], [p + "batch"], axis=0),
              helper.make_node("Unsqueeze", [p + "batch"], [p + "batch_u"], axes=[0]),
              helper.make_node("Concat", [p + "batch_u", "c_sd"], [p + "heads32"], axis=0),
              helper.make_node("Cast", [p + "heads32"], [p + "heads_shape"], to=TensorProto.INT64),
              helper.make_node("Reshape", [p + "proj", p + "heads_shape"], [p + "heads"]),
              helper.make_node("Transpose", [p + "heads"], [p + "t"], perm=[0, 2, 1, 3]),
              helper.make_node("Relu", [p + "t"], [p + "r"]),
              helper.make_node("Transpose", [p + "r"], [p + "t2"], perm=[0, 2, 1, 3]),
              # merge: [batch * S (a Mul of dims), H] then [batch, S, H]
              helper.make_node("Mul", [p + "batch_u", "c_s"], [p + "bxs"]),
              helper.make_node("Concat", [p + "bxs", "c_h"], [p + "m32"], axis=0),
              helper.make_node("Cast", [p + "m32"], [p + "m_shape"], to=TensorProto.INT64),
              helper.make_node("Reshape", [p + "t2", p + "m_shape"], [p + "m"]),
              helper.make_node("Concat", [p + "batch_u", "c_s_h"], [p + "o32"], axis=0),
              helper.make_node("Cast", [p + "o32"], [p + "o_shape"], to=TensorProto.INT64),
              helper.make_node("Reshape", [p + "m", p + "o_shape"], [p + "out"])]
        x = p + "out"
    n.append(helper.make_node("Identity", [x], ["y"]))
    return make_model(n, [("x", F, ["batch_size", S, H])], [("y", F, ["batch_size", S, H])], inits, opset=11)


def distilbert_stale_shape() -> onnx.ModelProto:
    """A static ``[1, 4, 16]`` reshape graph whose output declares ``[1, -1, 16]``: strict inference fails."""
    rng = _rng(2)
    inits = {"w": _w(rng, 16, 16), "b": _w(rng, 16), "idx0": np.array(0, np.int64), "idx1": np.array(1, np.int64), "ax0": _i64(0), "c_hd": _i64(2, 8),
             "c_h": _i64(16)}
    n = [helper.make_node("MatMul", ["x", "w"], ["mm"]),
         helper.make_node("Add", ["mm", "b"], ["proj"]),
         helper.make_node("Shape", ["proj"], ["sh"]),
         helper.make_node("Gather", ["sh", "idx0"], ["d0"], axis=0),
         helper.make_node("Gather", ["sh", "idx1"], ["d1"], axis=0),
         helper.make_node("Unsqueeze", ["d0", "ax0"], ["d0u"]),
         helper.make_node("Unsqueeze", ["d1", "ax0"], ["d1u"]),
         helper.make_node("Concat", ["d0u", "d1u", "c_hd"], ["shape4"], axis=0),
         helper.make_node("Reshape", ["proj", "shape4"], ["heads"]),
         helper.make_node("Softmax", ["heads"], ["sm"], axis=-1),
         helper.make_node("Concat", ["d0u", "d1u", "c_h"], ["shape3"], axis=0),
         helper.make_node("Reshape", ["sm", "shape3"], ["y"])]
    model = make_model(n, [("x", F, [1, 4, 16])], [("y", F, [1, 4, 16])], inits, opset=13)
    model.graph.output[0].type.tensor_type.shape.dim[1].Clear()
    model.graph.output[0].type.tensor_type.shape.dim[1].dim_value = -1
    return model


def distilbert_size_merge() -> onnx.ModelProto:
    """DistilBERT's head merge of older PyTorch exports: ``[batch, 5, Size(t) / (batch * 5)]``."""
    rng = _rng(7)
    inits = {"w": _w(rng, 16, 16), "idx0": np.array(0, np.int64), "c5": _i64(5),
             "c5s": np.array(5, np.int64), "hd": _i64(5, 2, 8)}
    n = [helper.make_node("MatMul", ["x", "w"], ["mm"]),
         helper.make_node("Shape", ["x"], ["sh"]),
         helper.make_node("Gather", ["sh", "idx0"], ["b"], axis=0),
         helper.make_node("Unsqueeze", ["b"], ["bu"], axes=[0]),
         helper.make_node("Concat", ["bu", "hd"], ["split_shape"], axis=0),
         helper.make_node("Reshape", ["mm", "split_shape"], ["heads"]),
         helper.make_node("Relu", ["heads"], ["t"]),
         helper.make_node("Size", ["t"], ["n"]),
         helper.make_node("Mul", ["b", "c5s"], ["b5"]),
         helper.make_node("Div", ["n", "b5"], ["last"]),
         helper.make_node("Unsqueeze", ["last"], ["last_u"], axes=[0]),
         helper.make_node("Concat", ["bu", "c5", "last_u"], ["merge_shape"], axis=0),
         helper.make_node("Reshape", ["t", "merge_shape"], ["y"])]
    return make_model(n, [("x", F, ["batch", 5, 16])], [("y", F, ["batch", 5, 16])], inits, opset=11)


def tf_cnn_pad() -> onnx.ModelProto:
    """Explicit zero Pads before a Conv, a MaxPool of a Relu and an AveragePool (opset 13, NCHW)."""
    rng = _rng(3)
    inits = {"w1": _w(rng, 4, 3, 3, 3), "b1": _w(rng, 4), "w2": _w(rng, 4, 4, 3, 3),
             "p_conv": _i64(0, 0, 1, 1, 0, 0, 1, 1), "p_pool": _i64(0, 0, 0, 1, 0, 0, 1, 0),
             "p_avg": _i64(0, 0, 1, 1, 0, 0, 1, 1), "zero": np.array(0, np.float32)}
    n = [helper.make_node("Pad", ["x", "p_conv", "zero"], ["xp"], mode="constant"),
         helper.make_node("Conv", ["xp", "w1", "b1"], ["c1"], kernel_shape=[3, 3]),
         helper.make_node("Relu", ["c1"], ["r1"]),
         helper.make_node("Pad", ["r1", "p_pool"], ["rp"], mode="constant"),
         helper.make_node("MaxPool", ["rp"], ["mp"], kernel_shape=[2, 2], strides=[2, 2]),
         helper.make_node("Pad", ["mp", "p_conv"], ["mpp"]),
         helper.make_node("Conv", ["mpp", "w2"], ["c2"], kernel_shape=[3, 3]),
         helper.make_node("Pad", ["c2", "p_avg"], ["c2p"]),
         helper.make_node("AveragePool", ["c2p"], ["y"], kernel_shape=[3, 3], count_include_pad=1)]
    return make_model(n, [("x", F, ["N", 3, 12, 12])], [("y", F, ["N", 4, 6, 6])], inits, opset=13)


def expand_broadcast() -> onnx.ModelProto:
    """``Add(x, Expand(b, Shape(x)))`` and ``Mul(Expand(m, [1, 1, 16]), x)``: the broadcast gives the Expand."""
    rng = _rng(4)
    inits = {"b": _w(rng, 16), "m": _w(rng, 1, 7, 1), "s": _i64(1, 1, 16)}
    n = [helper.make_node("Shape", ["x"], ["sh"]),
         helper.make_node("Expand", ["b", "sh"], ["be"]),
         helper.make_node("Add", ["x", "be"], ["a"]),
         helper.make_node("Expand", ["m", "s"], ["me"]),
         helper.make_node("Mul", ["me", "a"], ["y"])]
    return make_model(n, [("x", F, ["batch", 7, 16])], [("y", F, ["batch", 7, 16])], inits, opset=13)


def clip_slice() -> onnx.ModelProto:
    """Clip twins (one spells the empty max), an unbounded Clip, and a Slice over a dim of size 1."""
    inits = {"lo": np.array(-0.5, np.float32), "s0": _i64(0), "e1": _i64(1), "ax1": _i64(1),
             "em": _i64(-1), "eb": _i64(-(2 ** 63)), "stepm": _i64(-1)}
    n = [helper.make_node("Clip", ["x", "lo"], ["c1"]),
         helper.make_node("Clip", ["x", "lo", ""], ["c2"]),
         helper.make_node("Clip", ["c1"], ["c3"]),
         helper.make_node("Add", ["c3", "c2"], ["a"]),
         helper.make_node("Slice", ["a", "s0", "e1", "ax1"], ["sl"]),
         helper.make_node("Slice", ["sl", "em", "eb", "ax1", "stepm"], ["y"])]
    return make_model(n, [("x", F, ["batch", 1, 8])], [("y", F, ["batch", 1, 8])], inits, opset=13)


def gemm_scale_where() -> onnx.ModelProto:
    """A rank-2 MatMul+Add of computed operands, a scalar-scaled projection, Where(Not(c)), output twins."""
    rng = _rng(5)
    inits = {"wq": _w(rng, 16, 16), "bq": _w(rng, 16), "scale": np.array(0.125, np.float32)}
    n = [helper.make_node("MatMul", ["x", "wt"], ["mm"]),
         helper.make_node("Add", ["mm", "bias"], ["g"]),
         helper.make_node("MatMul", ["g", "wq"], ["q0"]),
         helper.make_node("Add", ["q0", "bq"], ["q1"]),
         helper.make_node("Mul", ["q1", "scale"], ["q"]),
         helper.make_node("Not", ["c"], ["nc"]),
         helper.make_node("Where", ["nc", "q", "g"], ["y"]),
         helper.make_node("Relu", ["g"], ["r1"]),
         helper.make_node("Relu", ["g"], ["r2"])]
    return make_model(n, [("x", F, [4, 16]), ("wt", F, [16, 16]), ("bias", F, [16]), ("c", BOOL, [4, 16])],
                      [("y", F, [4, 16]), ("r1", F, [4, 16]), ("r2", F, [4, 16])], inits, opset=13)


def softmax_op12() -> onnx.ModelProto:
    """Opset-12 Softmax with axis 1 of a rank-3 tensor: the trailing axes flattened, then a MatMul."""
    rng = _rng(6)
    inits = {"w": _w(rng, 8, 8)}
    n = [helper.make_node("MatMul", ["x", "w"], ["mm"]),
         helper.make_node("Softmax", ["mm"], ["y"], axis=1)]
    return make_model(n, [("x", F, ["batch", 4, 8])], [("y", F, ["batch", 4, 8])], inits, opset=12)


def _feeds(model_fn: Callable[[], onnx.ModelProto]) -> Callable[[int], dict[str, np.ndarray]]:
    """Seeded inputs for ``model_fn``'s model with its symbolic dims set to ``batch``."""

    def feeds(batch: int, seed: int = 0) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        out = {}
        for vi in model_fn().graph.input:
            tt = vi.type.tensor_type
            shape = [d.dim_value if d.HasField("dim_value") else batch for d in tt.shape.dim]
            if tt.elem_type == BOOL:
                out[vi.name] = rng.integers(0, 2, shape).astype(bool)
            else:
                out[vi.name] = rng.standard_normal(shape).astype(np.float32)
        return out

    return feeds


#: name -> (builder, feeds(batch)); the batch is free only where the graph declares it symbolic.
GRAPHS: dict[str, tuple[Callable[[], onnx.ModelProto], Callable[..., dict[str, np.ndarray]]]] = {
    name: (fn, _feeds(fn)) for name, fn in {
        "tf-bert-reshape": tf_bert_reshape,
        "distilbert-stale-shape": distilbert_stale_shape,
        "distilbert-size-merge": distilbert_size_merge,
        "tf-cnn-pad": tf_cnn_pad,
        "expand-broadcast": expand_broadcast,
        "clip-slice": clip_slice,
        "gemm-scale-where": gemm_scale_where,
        "softmax-op12": softmax_op12,
    }.items()
}
