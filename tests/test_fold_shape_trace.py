"""fold-constants: dims shape inference leaves unknown are traced through their producers (Reshape, Transpose, broadcasts)."""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto as T, helper

from k3opt.graph.symbolic.algebra import broadcast_of, dim_product
from k3opt.graph.symbolic.dims import MAX_SHAPE_DEPTH, Dims
from k3opt.pipeline.analyses import DimAnalysis
from tests.helpers import assert_equivalent, assert_optimizes_within, make_model, op_counts
from tests.test_fold_constants import fold
from tests.zoo import needs_torch, zoo_inputs, zoo_model

F, I64 = T.FLOAT, T.INT64


def dim_at(t: gs.Tensor, i: int) -> object:
    """Dim ``i`` of ``t`` as a fresh :class:`Dims` traces it, no symbol taken as declared (an empty graph's)."""
    return Dims(gs.Graph()).at(t, i)


def _heads_model(third: int, last: int = 8, x_shape: tuple = ("N", "S", 16), pick: int = 1) -> onnx.ModelProto:
    """y = dim ``pick`` of Transpose(Reshape(x, [dim0(x), dim1(x), third, last])), as float."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "i0"], ["g0"], axis=0),
        helper.make_node("Gather", ["s", "i1"], ["g1"], axis=0),
        helper.make_node("Unsqueeze", ["g0", "ax"], ["u0"]),
        helper.make_node("Unsqueeze", ["g1", "ax"], ["u1"]),
        helper.make_node("Concat", ["u0", "u1", "third", "last"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["r"]),
        helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1, 3]),
        helper.make_node("Shape", ["t"], ["ts"]),
        helper.make_node("Gather", ["ts", "pick"], ["d"], axis=0),
        helper.make_node("Cast", ["d"], ["y"], to=F),
    ]
    inits = dict(i0=np.int64(0), i1=np.int64(1), ax=np.int64([0]), third=np.int64([third]), last=np.int64([last]),
                 pick=np.int64(pick))
    return make_model(nodes, [("x", F, list(x_shape))], [("y", F, [])], inits, opset=14)


def _feeds(shape: tuple) -> dict:
    return {"x": np.random.rand(*shape).astype(np.float32)}


@pytest.mark.parametrize("third", [-1, 2], ids=["minus-one", "literal"])
def test_reshape_target_dim_traced_through_transpose(third):
    model = _heads_model(third)
    out, _ = fold(model)
    assert set(op_counts(out)) <= {"Constant"}
    for shape in ((2, 3, 16), (1, 5, 16)):
        assert_equivalent(model, out, feeds=_feeds(shape))


def test_minus_one_refused_when_symbols_do_not_cancel():
    """Reshape(x[N, S, 16], [N, 4, -1, 8]): the -1 is S / 2, not a number."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "i0"], ["g0"], axis=0),
        helper.make_node("Unsqueeze", ["g0", "ax"], ["u0"]),
        helper.make_node("Concat", ["u0", "four", "m1", "eight"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["r"]),
        helper.make_node("Shape", ["r"], ["rs"]),
        helper.make_node("Gather", ["rs", "i2"], ["d"], axis=0),
        helper.make_node("Cast", ["d"], ["y"], to=F),
    ]
    inits = dict(i0=np.int64(0), i2=np.int64(2), ax=np.int64([0]), four=np.int64([4]), m1=np.int64([-1]),
                 eight=np.int64([8]))
    model = make_model(nodes, [("x", F, ["N", "S", 16])], [("y", F, [])], inits, opset=14)
    out, _ = fold(model)
    assert "Reshape" in op_counts(out) and "Shape" in op_counts(out)
    for shape in ((2, 4, 16), (1, 8, 16)):
        assert_equivalent(model, out, feeds=_feeds(shape))


@pytest.mark.parametrize("a_shape,b_shape,folds", [
    (["N", 4], ["N", 1], True), (["N", 4], [1, "M"], True), (["N", "K"], [1, "M"], False), (["N", "K"], ["N", 1], False),
], ids=["one-broadcasts", "number-wins-over-symbol", "different-symbols", "symbol-not-folded"])
def test_broadcast_dim(a_shape, b_shape, folds):
    """Dim 1 of Add(a, b): a number other than 1 is the result (the other side is 1 or equal), symbols never fold."""
    nodes = [
        helper.make_node("Add", ["a", "b"], ["c"]),
        helper.make_node("Shape", ["c"], ["s"]),
        helper.make_node("Gather", ["s", "i1"], ["d"], axis=0),
        helper.make_node("Cast", ["d"], ["y"], to=F),
    ]
    model = make_model(nodes, [("a", F, a_shape), ("b", F, b_shape)], [("y", F, [])], {"i1": np.int64(1)})
    out, _ = fold(model)
    assert ("Add" not in op_counts(out)) == folds
    size = {"N": 3, "K": 4, "M": 4}
    feeds = {k: np.zeros([size.get(d, d) for d in shape], np.float32) for k, shape in (("a", a_shape), ("b", b_shape))}
    assert_equivalent(model, out, feeds=feeds)


@pytest.mark.parametrize("shapes", [
    ([None, 6], [None, 1], [5]), ([1, "S"], [-3, 3], ["N", None]), (["S"], [1], [None]), ([-2], [None], [3]),
    ([None], [4], None), (None, [4], [4]), ([None, 1], ["S", 1], [1, None]), ([-7, 1], [1, 2], [7, -2]),
    ([-1, "S"], ["S", -1], [1, 1]),
], ids=str)
def test_broadcast_stops_at_the_first_number(shapes):
    """A broadcast's dims are traced up to the first number other than 1 (the broadcast's): the answer is
    :func:`broadcast_of` of every operand's dim, an unknown rank anywhere still None. An operand is an
    Identity of an input of that shape (None: of unknown rank); a negative number is the input's size, which
    the Identity's own inferred shape does not know (traced)."""
    x = {n: gs.Variable(f"x_{n}", np.float32, None if shape is None else [abs(d) if isinstance(d, int) else d
                                                                          for d in shape])
         for n, shape in zip("abc", shapes)}
    ops = {n: gs.Variable(n, np.float32, None if shape is None else [None if isinstance(d, int) and d < 0 else d
                                                                      for d in shape])
           for n, shape in zip("abc", shapes)}
    rank = max(len(shape or ()) for shape in shapes)
    y = gs.Variable("y", np.float32, [None] * rank)
    nodes = [gs.Node("Identity", inputs=[x[n]], outputs=[ops[n]]) for n in "abc"]
    graph = gs.Graph(nodes + [gs.Node("Where", inputs=list(ops.values()), outputs=[y])], list(x.values()), [y])
    for i in range(rank):
        every = None if any(t.shape is None for t in ops.values()) else broadcast_of(
            [1 if i < rank - len(t.shape) else dim_at(t, i - rank + len(t.shape)) for t in ops.values()])
        assert DimAnalysis(graph).at(y, i) == every, (i, every)


@pytest.mark.parametrize("shape", [[None, 6], [-4, None, 2], ["S", -3], [-2, 1], [], None], ids=str)
def test_all_dims_stop_at_the_first_unknown(shape, monkeypatch):
    """The dims a Reshape's -1 is divided from (``Dims.complete``) are ``Dims.of``'s, or None as soon as one is
    None (the later ones are not traced). A negative number is traced (the inferred shape does not know it)."""
    x = gs.Variable("x", np.float32, None if shape is None else [abs(d) if isinstance(d, int) else d for d in shape])
    t = gs.Variable("t", np.float32, None if shape is None else [None if isinstance(d, int) and d < 0 else d
                                                                  for d in shape])
    graph = gs.Graph([gs.Node("Identity", inputs=[x], outputs=[t])], [x], [t])
    plain = Dims(graph).of(t)
    traced = []
    real = Dims.at
    monkeypatch.setattr(Dims, "at", lambda self, u, i, depth=MAX_SHAPE_DEPTH: (u is t and traced.append(i))
                        or real(self, u, i, depth))
    assert Dims(graph).complete(t, MAX_SHAPE_DEPTH) == (None if plain is None or None in plain else plain)
    assert traced == ([] if plain is None else list(range(plain.index(None) + 1 if None in plain else len(plain))))


@pytest.mark.parametrize("b_dim,folds", [("N", True), ("M", False)], ids=["same-symbol", "different-symbols"])
def test_equal_of_shapes_with_symbols(b_dim, folds):
    nodes = [
        helper.make_node("Shape", ["a"], ["sa"]),
        helper.make_node("Shape", ["b"], ["sb"]),
        helper.make_node("Equal", ["sa", "sb"], ["eq"]),
        helper.make_node("Cast", ["eq"], ["y"], to=F),
    ]
    model = make_model(nodes, [("a", F, ["N", 4]), ("b", F, [b_dim, 4])], [("y", F, [2])])
    out, _ = fold(model)
    assert ("Equal" not in op_counts(out)) == folds
    assert_equivalent(model, out)


@needs_torch
def test_llama_torchscript_head_counts_fold():
    """The Llama TorchScript export's head dims (Reshape to [b, s, -1, 8]) fold in every layer: 255 -> 239 nodes."""
    assert_optimizes_within(zoo_model("llama", "torchscript"), zoo_inputs("llama"), max_nodes=239)


def _split_graph(x_shape: list, opset: int, n: int, **split) -> list:
    """The Split outputs of ``x``, with the shapes inference would lose (all unknown): tracing must find them."""
    inits = {}
    inputs = ["x"]
    if "sizes" in split:
        inits["sizes"] = np.int64(split.pop("sizes"))
        inputs.append("sizes")
    outs = [f"o{j}" for j in range(n)]
    node = helper.make_node("Split", inputs, outs, axis=-1, **split)
    model = make_model([node], [("x", F, x_shape)], [(o, F, [None] * len(x_shape)) for o in outs], inits, opset=opset)
    graph = gs.import_onnx(model)
    for o in graph.outputs:
        o.shape = [None] * len(x_shape)
    return graph.outputs


@pytest.mark.parametrize("opset, x_last, split, want", [
    (13, 24, dict(sizes=[8, 16]), [8, 16]),
    (11, 24, dict(split=[16, 8]), [16, 8]),
    (13, 24, {}, [8, 8, 8]),
    (18, 26, dict(num_outputs=3), [9, 9, 8]),
    (18, 24, dict(num_outputs=3), [8, 8, 8]),
    (13, 25, {}, [None, None, None]),  # not an equal split: invalid, nothing is claimed
    (18, 4, dict(num_outputs=3), [None, None, None]),  # ceil(4 / 3) * 2 leaves nothing for the last
    (13, "C", {}, [None, None, None]),  # the split dim is not a number
], ids=["split-input", "split-attribute", "equal", "num-outputs-uneven", "num-outputs-even", "uneven-refused",
        "num-outputs-empty-last", "symbolic-refused"])
def test_split_dims_traced(opset, x_last, split, want):
    """Split's outputs keep the input's other dims; on the split axis they have the ``split`` sizes, else equal
    shares (``num_outputs``: ceil(dim / n) each, the rest in the last)."""
    outs = _split_graph(["N", 5, x_last], opset, len(want), **split)
    assert [dim_at(o, 0) for o in outs] == ["N"] * len(want)
    assert [dim_at(o, 1) for o in outs] == [5] * len(want)
    assert [dim_at(o, 2) for o in outs] == want


def test_gemm_dims_traced():
    """Gemm's rows are A's (its dim 1 with transA), its columns B's (dim 0 with transB)."""
    nodes = [helper.make_node("Gemm", ["a", "b"], ["y"], transA=1, transB=1)]
    model = make_model(nodes, [("a", F, [16, "M"]), ("b", F, ["K", 16])], [("y", F, [None, None])])
    graph = gs.import_onnx(model)
    y = graph.outputs[0]
    y.shape = [None, None]
    assert (dim_at(y, 0), dim_at(y, 1)) == ("M", "K")


def _traced_output(node: onnx.NodeProto, inputs: list, rank: int, opset: int = 17) -> gs.Variable:
    """``node``'s first output, its shape forgotten (as inference leaves it unknown): tracing must find it."""
    model = make_model([node], inputs, [(node.output[0], F, [None] * rank)], opset=opset)
    y = gs.import_onnx(model).outputs[0]
    y.shape = [None] * rank
    return y


@pytest.mark.parametrize("a_shape, b_shape, want", [
    (["B", 4, "S", 8], ["B", 4, 8, "T"], ["B", 4, "S", "T"]),  # probs @ v, q @ k^T: heads are batch dims
    ([1, 4, "S", 8], ["B", 1, 8, "T"], ["B", 4, "S", "T"]),  # batch dims broadcast
    (["S", 8], ["B", 4, 8, "T"], ["B", 4, "S", "T"]),  # a lower-rank operand aligns right
    (["B", 4, "S", 8], [None, 4, 8, "T"], [None, 4, "S", "T"]),  # an unknown beside a symbol stays unknown
    (["B", 4, "S", 8], ["C", 4, 8, "T"], [None, 4, "S", "T"]),  # two symbols: either may be 1, unknown
], ids=["same", "broadcast", "lower-rank", "unknown-refused", "two-symbols-refused"])
def test_matmul_dims_traced(a_shape, b_shape, want):
    """MatMul's rows are a's, its columns b's, its batch dims a's and b's broadcast (numpy's matmul)."""
    y = _traced_output(helper.make_node("MatMul", ["a", "b"], ["y"]), [("a", F, a_shape), ("b", F, b_shape)], 4)
    assert [dim_at(y, i) for i in range(4)] == want


@pytest.mark.parametrize("a_shape, b_shape, rank", [([8], ["B", 4, 8, "T"], 3), (["B", "M", 8], [8], 2)],
                         ids=["1-D-first", "1-D-second"])
def test_matmul_dims_need_both_ranks(a_shape, b_shape, rank):
    """A 1-D operand drops an axis of the output: no dim is claimed (``(B, M, K) @ (K,)`` is ``(B, M)``: its
    dim 0 is not the rows' M)."""
    y = _traced_output(helper.make_node("MatMul", ["a", "b"], ["y"]), [("a", F, a_shape), ("b", F, b_shape)], rank)
    assert [dim_at(y, i) for i in range(rank)] == [None] * rank


def test_attention_output_dims_traced():
    """Attention-23 on 4-D inputs: Y is (batch, q heads, q sequence) of Q and v's head size."""
    node = helper.make_node("Attention", ["q", "k", "v"], ["y"])
    y = _traced_output(node, [("q", F, ["B", 4, "S", 8]), ("k", F, ["B", 2, "T", 8]), ("v", F, ["B", 2, "T", 16])],
                       4, opset=23)
    assert [dim_at(y, i) for i in range(4)] == ["B", 4, "S", 16]
    y3 = _traced_output(node, [("q", F, ["B", "S", 32]), ("k", F, ["B", "T", 32]), ("v", F, ["B", "T", 32])], 3,
                        opset=23)
    assert dim_at(y3, 0) is None  # 3-D inputs: not traced


def _merged_qkv_heads(batch: tuple = ("N",)) -> onnx.ModelProto:
    """y = the heads of q in ``Reshape(Split(Reshape(Gemm(Reshape(h, [-1, 32]), w), [-1, 5, 96]))[0],
    [dim0(h), 5, -1, 8])`` as float: the merged-QKV head split of a TorchScript ViT once fuse-matmul-add
    flattened the batch; ``h`` is x, or x + z (``batch`` two symbols: the sum's batch is unknown)."""
    nodes = [
        helper.make_node("Add", ["x", "z"], ["h"]) if len(batch) == 2 else helper.make_node("Identity", ["x"], ["h"]),
        helper.make_node("Reshape", ["h", "flat"], ["h2"]),
        helper.make_node("Gemm", ["h2", "w"], ["g"]),
        helper.make_node("Reshape", ["g", "unflat"], ["qkv"]),
        helper.make_node("Split", ["qkv", "sizes"], ["q", "k", "v"], axis=-1),
        helper.make_node("Shape", ["h"], ["s"]),
        helper.make_node("Gather", ["s", "i0"], ["g0"], axis=0),
        helper.make_node("Unsqueeze", ["g0", "ax"], ["u0"]),
        helper.make_node("Concat", ["u0", "rest"], ["target"], axis=0),
        helper.make_node("Reshape", ["q", "target"], ["r"]),
        helper.make_node("Shape", ["r"], ["rs"]),
        helper.make_node("Gather", ["rs", "i2"], ["d"], axis=0),
        helper.make_node("Cast", ["d"], ["y"], to=F),
    ]
    inits = dict(flat=np.int64([-1, 32]), w=np.random.rand(32, 96).astype(np.float32), unflat=np.int64([-1, 5, 96]),
                 sizes=np.int64([32, 32, 32]), i0=np.int64(0), ax=np.int64([0]), rest=np.int64([5, -1, 8]),
                 i2=np.int64(2))
    inputs = [("x", F, [batch[0], 5, 32])] + ([("z", F, [batch[1], 5, 32])] if len(batch) == 2 else [])
    model = make_model(nodes, inputs, [("y", F, [])], inits, opset=13)
    model.graph.value_info.append(helper.make_tensor_value_info("r", F, [None] * 4))  # as exporters declare it
    return model


def test_merged_qkv_head_count_folds():
    """The flattened batch of the Gemm (``N * 5``) cancels in the Reshape's -1, Split keeps it: q has 4 heads."""
    model = _merged_qkv_heads()
    out, _ = fold(model)
    assert set(op_counts(out)) <= {"Constant"}
    for n in (1, 3):
        assert_equivalent(model, out, feeds=_feeds((n, 5, 32)))


def test_unknown_dims_are_named_only_within_the_block():
    """``x + z`` of batches N and M has an unknown batch; a Dims made with ``name_unknown`` names it, so the
    head split's -1 (a quotient by the dim read from ``Shape(x + z)``) is proven 4; a plain one does not."""
    graph = gs.import_onnx(onnx.shape_inference.infer_shapes(_merged_qkv_heads(("N", "M"))))
    r = graph.tensors()["r"]
    for t in graph.tensors().values():
        if t.shape is not None and not isinstance(t, gs.Constant) and t not in graph.inputs:
            t.shape = [d if isinstance(d, int) else None for d in t.shape]
    plain, named = DimAnalysis(graph), Dims(graph, name_unknown=True)
    assert plain.at(r, 2) is None
    assert named.at(r, 2) == 4
    assert named.at(r, 0).startswith("<")
    assert plain.at(r, 0) is None


def test_products_of_sums_are_not_spelled():
    """``(past + 1) * 2`` has no spelling (a sum symbol's terms would be read apart): unknown; ``batch * 5``
    and a lone sum are symbols, and they cancel in a quotient."""
    assert dim_product(2, ["past + 1"]) is None and dim_product(1, ["past + 1"]) == "past + 1"
    assert dim_product(5, ["batch"]) == "batch * 5" and dim_product(3, []) == 3
    nodes = [helper.make_node("Reshape", ["x", "flat"], ["y"])]
    model = make_model(nodes, [("x", F, ["past + 1", 2, 4])], [("y", F, [None, 4])], {"flat": np.int64([-1, 4])})
    y = gs.import_onnx(model).outputs[0]
    y.shape = [None, 4]
    assert dim_at(y, 0) is None
