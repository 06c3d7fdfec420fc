"""fold-constants on hand-made graphs: every variant and every refusal, checked with onnxruntime."""
from __future__ import annotations

from typing import Any, Optional

import ml_dtypes
import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto as T, helper, numpy_helper

import k3opt
from k3opt.passes.fold import fold_constants as fc
from k3opt.pipeline.pass_base import PassContext
from k3opt.passes.fold.fold_constants import FoldConstants
from k3opt.passes.fold._eval import EvalError
from k3opt.pipeline.manager import PassManager
from k3opt.modelio import ExternalValues
from tests.helpers import assert_equivalent, export_graph, import_graph, make_model, op_counts, run_ort

F = T.FLOAT


def fold(model: onnx.ModelProto, options: Optional[dict[str, Any]] = None) -> tuple[onnx.ModelProto, int]:
    """Infer shapes, run fold-constants to a fixed point with ``options``; returns (model, rewrites)."""
    model = onnx.shape_inference.infer_shapes(model)
    graph = import_graph(model)
    ctx = PassContext(opset=model.opset_import[0].version, options=dict(options or {}))
    rewrites = PassManager([FoldConstants()]).run(graph, ctx)
    return export_graph(graph, model), rewrites


def compute_ops(model: onnx.ModelProto) -> set[str]:
    return {n.op_type for n in model.graph.node if n.op_type != "Constant"}


def test_constant_subgraph_folds_and_matches():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    nodes = [
        helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.float32([2.0]), "kv")),
        helper.make_node("Mul", ["a", "k"], ["ak"]),
        helper.make_node("Transpose", ["ak"], ["akt"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "akt"], ["y"]),
    ]
    model = make_model(nodes, [("x", F, ["N", 3])], [("y", F, ["N", 3])], {"a": a})
    out, n = fold(model)
    assert n > 0 and op_counts(out) == {"MatMul": 1}
    assert not out.graph.node[0].input[1].endswith("_1")  # the folded weight keeps the tensor's name
    assert_equivalent(model, out)
    assert fold(out)[1] == 0  # fixed point


def test_folded_graph_output_stays_a_named_node_output():
    nodes = [helper.make_node("Add", ["a", "a"], ["y"]), helper.make_node("Relu", ["x"], ["z"])]
    model = make_model(nodes, [("x", F, [2])], [("y", F, [2]), ("z", F, [2])], {"a": np.float32([1, -2])})
    out, _ = fold(model)
    assert op_counts(out) == {"Constant": 1, "Relu": 1}
    assert [o.name for o in out.graph.output] == ["y", "z"]
    assert_equivalent(model, out)


def _shape_model(gather_index: int, x_shape: list) -> onnx.ModelProto:
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "i"], ["d"], axis=0),
        helper.make_node("Unsqueeze", ["d", "zero"], ["d1"]),
        helper.make_node("Concat", ["minus1", "d1"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["y"]),
    ]
    inits = {"i": np.array(gather_index), "zero": np.array([0]), "minus1": np.array([-1])}
    return make_model(nodes, [("x", F, x_shape)], [("y", F, ["M", x_shape[1]])], inits)


def test_gather_of_shape_folds_when_only_that_dim_is_known():
    model = _shape_model(1, ["N", 4])
    out, _ = fold(model)
    assert op_counts(out) == {"Reshape": 1}
    assert_equivalent(model, out)


def test_gather_of_shape_refused_when_the_dim_is_dynamic():
    model = _shape_model(0, ["N", 4])
    out, n = fold(model)
    assert n == 0 and op_counts(out) == op_counts(model)


@pytest.mark.parametrize("start,end,expect", [(None, None, [2, 3, 4]), (1, None, [3, 4]), (-1, None, [4]), (0, -1, [2, 3])])
def test_shape_with_start_end_folds(start, end, expect):
    attrs = {k: v for k, v in (("start", start), ("end", end)) if v is not None}
    nodes = [helper.make_node("Shape", ["x"], ["s"], **attrs), helper.make_node("Cast", ["s"], ["y"], to=F)]
    model = make_model(nodes, [("x", F, [2, 3, 4])], [("y", F, [len(expect)])])
    out, _ = fold(model)
    assert compute_ops(out) == set()
    assert run_ort(out, {"x": np.zeros((2, 3, 4), np.float32)})[0].tolist() == expect


def test_shape_with_start_reads_only_known_dims():
    nodes = [helper.make_node("Shape", ["x"], ["s"], start=1), helper.make_node("Cast", ["s"], ["y"], to=F)]
    model = make_model(nodes, [("x", F, ["N", 3, 4])], [("y", F, [2])])
    out, _ = fold(model)
    assert compute_ops(out) == set()
    assert_equivalent(model, out)


@pytest.mark.parametrize("starts,ends,steps,folds", [([1], [3], [1], True), ([-2], [100], [1], True),
                                                     ([0], [2], [1], False), ([-1], [-100], [-1], False),
                                                     ([3], [0], [-1], True)])
def test_slice_of_shape_folds_only_known_dims(starts, ends, steps, folds):
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Slice", ["s", "st", "en", "ax", "sp"], ["d"]),
             helper.make_node("Cast", ["d"], ["y"], to=F)]
    inits = {"st": np.array(starts), "en": np.array(ends), "ax": np.array([0]), "sp": np.array(steps)}
    model = make_model(nodes, [("x", F, ["N", 3, 4, 5])], [("y", F, ["K"])], inits)
    out, _ = fold(model)
    assert (compute_ops(out) == set()) == folds
    assert_equivalent(model, out)


def test_static_input_shapes_fold_the_whole_shape_subgraph():
    """A transformer-style head split: with static shapes only the data path remains."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "i0"], ["b"], axis=0),
        helper.make_node("Gather", ["s", "i1"], ["t"], axis=0),
        helper.make_node("Unsqueeze", ["b", "zero"], ["b1"]),
        helper.make_node("Unsqueeze", ["t", "zero"], ["t1"]),
        helper.make_node("Concat", ["b1", "t1", "heads", "hd"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["r"]),
        helper.make_node("Transpose", ["r"], ["y"], perm=[0, 2, 1, 3]),
    ]
    inits = {"i0": np.array(0), "i1": np.array(1), "zero": np.array([0]), "heads": np.array([2]), "hd": np.array([4])}
    model = make_model(nodes, [("x", F, [2, 5, 8])], [("y", F, [2, 2, 5, 4])], inits)
    out, _ = fold(model)
    assert op_counts(out) == {"Reshape": 1, "Transpose": 1}
    assert_equivalent(model, out)


GROWING = [
    ("ConstantOfShape", {"shape": np.array([512, 1024])}),
    ("Expand", {"v": np.float32([1.0]), "shape": np.array([512, 1024])}),
    ("Tile", {"v": np.float32([[1.0]]), "reps": np.array([512, 1024])}),
]


@pytest.mark.parametrize("op,inputs", GROWING)
def test_size_guard_keeps_growing_ops(op, inputs):
    nodes = [helper.make_node(op, list(inputs), ["big"]), helper.make_node("Relu", ["big"], ["r"]),
             helper.make_node("Add", ["x", "r"], ["y"])]
    model = make_model(nodes, [("x", F, [512, 1024])], [("y", F, [512, 1024])], inputs)
    out, n = fold(model)
    assert n == 0 and op in op_counts(out)
    # ... configurable: a looser limit folds it
    out, n = fold(model, {"fold_max_bytes": 4 << 20, "fold_max_elements": 1 << 20})
    assert op not in op_counts(out) and "Relu" not in op_counts(out)
    assert_equivalent(model, out)


def test_size_guard_range_and_element_limit():
    inputs = {"s": np.float32(0), "l": np.float32(1000), "d": np.float32(1)}
    nodes = [helper.make_node("Range", ["s", "l", "d"], ["r"]), helper.make_node("Add", ["x", "r"], ["y"])]
    model = make_model(nodes, [("x", F, [1000])], [("y", F, [1000])], inputs)
    assert "Range" in op_counts(fold(model, {"fold_max_elements": 999})[0])
    assert "Range" not in op_counts(fold(model)[0])


def test_size_guard_allows_growing_ops_read_only_for_their_shape():
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["big"]), helper.make_node("Shape", ["big"], ["s"]),
             helper.make_node("Reshape", ["x", "s"], ["y"])]
    model = make_model(nodes, [("x", F, [512 * 1024])], [("y", F, [512, 1024])], {"shape": np.array([512, 1024])})
    out, _ = fold(model)
    assert op_counts(out) == {"Reshape": 1}
    assert sum(np.prod(i.dims) for i in out.graph.initializer) == 2
    assert_equivalent(model, out)


@pytest.mark.parametrize("node", [
    helper.make_node("RandomNormalLike", ["a"], ["y"]),
    helper.make_node("RandomUniform", [], ["y"], shape=[2]),
    helper.make_node("Bernoulli", ["a"], ["y"]),
    helper.make_node("Dropout", ["a", "ratio", "train"], ["y"]),
])
def test_random_ops_are_never_folded(node):
    inits = {"a": np.float32([0.5, 0.5]), "ratio": np.float32(0.5), "train": np.array(True)}
    inits = {k: v for k, v in inits.items() if k in node.input}
    model = make_model([node], [], [("y", F, [2])], inits)
    out, n = fold(model)
    assert n == 0 and op_counts(out) == {node.op_type: 1}


def test_inference_dropout_folds():
    node = helper.make_node("Dropout", ["a", "ratio", "train"], ["d"])
    model = make_model([node, helper.make_node("Add", ["x", "d"], ["y"])], [("x", F, [2])], [("y", F, [2])],
                       {"a": np.float32([0.5, 0.5]), "ratio": np.float32(0.5), "train": np.array(False)})
    out, _ = fold(model)
    assert op_counts(out) == {"Add": 1}
    assert_equivalent(model, out)


def test_node_that_fails_to_evaluate_is_left_alone():
    nodes = [helper.make_node("Reshape", ["a", "bad"], ["r"]), helper.make_node("Add", ["x", "r"], ["y"]),
             helper.make_node("Neg", ["a"], ["na"]), helper.make_node("Add", ["x", "na"], ["z"])]
    model = make_model(nodes, [("x", F, [6])], [("y", F, [6]), ("z", F, [6])],
                       {"a": np.ones(6, np.float32), "bad": np.array([4])}, opset=17)
    out, n = fold(model)
    assert op_counts(out) == {"Reshape": 1, "Add": 2}  # Neg folded, the broken Reshape kept
    assert fold(out)[1] == 0  # and not retried forever


def test_reference_fallback_when_onnxruntime_fails(monkeypatch):
    def no_ort(*args, **kwargs):
        raise EvalError("simulated: onnxruntime lacks the op")

    monkeypatch.setattr(fc, "run_ort", no_ort)
    nodes = [helper.make_node("Softmax", ["a"], ["s"], axis=-1), helper.make_node("Mul", ["x", "s"], ["y"])]
    model = make_model(nodes, [("x", F, [3])], [("y", F, [3])], {"a": np.float32([1, 2, 3])})
    out, _ = fold(model)
    assert op_counts(out) == {"Mul": 1}
    assert_equivalent(model, out)


def test_reference_fallback_for_an_op_onnxruntime_lacks():
    node = helper.make_node("BitCast", ["a"], ["b"], to=T.INT32)
    model = make_model([node, helper.make_node("Add", ["x", "b"], ["y"])], [("x", T.INT32, [2])],
                       [("y", T.INT32, [2])], {"a": np.float32([1.0, -2.0])}, opset=26)
    out, _ = fold(model)
    assert op_counts(out) == {"Add": 1}
    folded = numpy_helper.to_array(out.graph.initializer[0])
    assert folded.tolist() == np.float32([1.0, -2.0]).view(np.int32).tolist()


@pytest.mark.parametrize("to,np_type", [(T.BFLOAT16, ml_dtypes.bfloat16), (T.FLOAT16, np.float16),
                                        (T.FLOAT8E4M3FN, ml_dtypes.float8_e4m3fn)])
def test_dtypes_are_exact(to, np_type):
    a = np.float32([1.1, -2.7, 330, 0.3])
    nodes = [helper.make_node("Cast", ["a"], ["c"], to=to), helper.make_node("Cast", ["c"], ["w"], to=F),
             helper.make_node("Identity", ["c"], ["y"]), helper.make_node("Mul", ["x", "w"], ["z"])]
    model = make_model(nodes, [("x", F, [4])], [("y", to, [4]), ("z", F, [4])], {"a": a}, opset=21)
    out, _ = fold(model)
    assert op_counts(out) == {"Constant": 1, "Mul": 1}
    const = next(n for n in out.graph.node if n.op_type == "Constant")
    y = numpy_helper.to_array(const.attribute[0].t)
    assert y.dtype == np.dtype(np_type) and y.tobytes() == a.astype(np_type).tobytes()
    assert_equivalent(_only_output(model, "z"), _only_output(out, "z"))


def _only_output(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """``model`` with just the output ``name`` (onnxruntime cannot hand bfloat16/float8 outputs to numpy)."""
    m = onnx.ModelProto.FromString(model.SerializeToString())
    keep = [o for o in m.graph.output if o.name == name]
    del m.graph.output[:]
    m.graph.output.extend(keep)
    return m


def test_if_body_reading_folded_outer_tensor_still_works():
    then_g = helper.make_graph([helper.make_node("Add", ["x", "c"], ["t"])], "then", [],
                               [helper.make_tensor_value_info("t", F, [2])])
    else_g = helper.make_graph([helper.make_node("Sub", ["x", "c"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", F, [2])])
    nodes = [helper.make_node("Neg", ["a"], ["c"]),
             helper.make_node("If", ["cond"], ["y"], then_branch=then_g, else_branch=else_g)]
    model = make_model(nodes, [("x", F, [2]), ("cond", T.BOOL, [])], [("y", F, [2])], {"a": np.float32([1, 2])})
    out, _ = fold(model)
    assert op_counts(out) == {"If": 1}
    for cond in (True, False):
        feeds = {"x": np.float32([3, 4]), "cond": np.array(cond)}
        assert_equivalent(model, out, feeds=feeds)


def test_loop_with_constant_inputs_and_body_folds_but_not_with_outer_input():
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Add", ["acc", "step"], ["acc2"])],
        "body",
        [helper.make_tensor_value_info("i", T.INT64, []), helper.make_tensor_value_info("cond_in", T.BOOL, []),
         helper.make_tensor_value_info("acc", F, [2])],
        [helper.make_tensor_value_info("cond_out", T.BOOL, []), helper.make_tensor_value_info("acc2", F, [2])],
    )
    loop = helper.make_node("Loop", ["n", "", "init"], ["r"], body=body)
    mul = helper.make_node("Mul", ["x", "r"], ["y"])
    inits = {"n": np.array(3), "init": np.float32([0, 1])}
    with_const = make_model([loop, mul], [("x", F, [2])], [("y", F, [2])], {**inits, "step": np.float32([1, 1])})
    out, _ = fold(with_const)
    assert op_counts(out) == {"Mul": 1}
    assert_equivalent(with_const, out)
    with_input = make_model([loop, mul], [("x", F, [2]), ("step", F, [2])], [("y", F, [2])], inits)
    out, n = fold(with_input)
    assert n == 0 and "Loop" in op_counts(out)


def test_overridable_initializer_is_not_folded():
    """A graph input with a default value (gs keeps it as a Constant listed in inputs) may be fed: not constant."""
    model = make_model([helper.make_node("Neg", ["a"], ["y"])], [], [("y", F, [2])], {"a": np.float32([1, 2])})
    graph = gs.import_onnx(model)
    graph.inputs.append(graph.nodes[0].inputs[0])
    rewrites = PassManager([FoldConstants()]).run(graph, PassContext(opset=17))
    assert rewrites == 0 and [n.op for n in graph.nodes] == ["Neg"]


def test_only_weights_feeding_foldable_nodes_are_read(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    nodes = [helper.make_node("Neg", ["b"], ["nb"]), helper.make_node("MatMul", ["x", "w"], ["m"]),
             helper.make_node("Add", ["m", "nb"], ["y"])]
    model = make_model(nodes, [("x", F, [1, 64])], [("y", F, [1, 64])], {"w": w, "b": np.ones(64, np.float32)})
    path = tmp_path / "m.onnx"
    onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location="w.bin",
              size_threshold=0)
    lazy = onnx.load(path, load_external_data=False)
    loaded: list[str] = []
    original_load = ExternalValues.load  # what the production import makes of external weights

    def spy(self):
        loaded.append(self.tensor.name)
        return original_load(self)

    monkeypatch.setattr(ExternalValues, "load", spy)
    monkeypatch.chdir(tmp_path)
    out, _ = fold(lazy)
    assert loaded == ["b"]
    assert op_counts(out) == {"MatMul": 1, "Add": 1}


def test_external_weights_feeding_foldable_nodes_fold_through_optimize(tmp_path):
    """A transposed weight in external data folds (read through k3opt.modelio's lazy loader) and stays exact."""
    w = np.random.default_rng(1).standard_normal((16, 32)).astype(np.float32)
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]), helper.make_node("MatMul", ["x", "wt"], ["y"])]
    model = make_model(nodes, [("x", F, [2, 32])], [("y", F, [2, 16])], {"w": w})
    path = tmp_path / "ext.onnx"
    onnx.save(onnx.ModelProto.FromString(model.SerializeToString()), path, save_as_external_data=True,
              location="ext.bin", size_threshold=0)
    out = k3opt.optimize(str(path), passes=["fold-constants", "remove-dead-nodes"])
    assert op_counts(out) == {"MatMul": 1}
    assert_equivalent(model, out)


def test_constant_node_read_inside_a_branch_becomes_an_initializer():
    then_g = helper.make_graph([helper.make_node("Add", ["x", "k"], ["t"])], "then", [],
                               [helper.make_tensor_value_info("t", F, [2])])
    else_g = helper.make_graph([helper.make_node("Sub", ["x", "k"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", F, [2])])
    nodes = [helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.float32([1, 2]), "kv")),
             helper.make_node("If", ["cond"], ["y"], then_branch=then_g, else_branch=else_g)]
    model = make_model(nodes, [("x", F, [2]), ("cond", T.BOOL, [])], [("y", F, [2])])
    out, n = fold(model)
    assert n == 1 and op_counts(out) == {"If": 1}
    for cond in (True, False):
        assert_equivalent(model, out, feeds={"x": np.float32([3, 4]), "cond": np.array(cond)})


def test_long_constant_chain_folds_without_recursion_limits():
    nodes = [helper.make_node("Neg", [f"c{i}"], [f"c{i + 1}"]) for i in range(3000)]
    nodes.append(helper.make_node("Add", ["x", "c3000"], ["y"]))
    model = make_model(nodes, [("x", F, [2])], [("y", F, [2])], {"c0": np.float32([1, 2])})
    out, _ = fold(model)
    assert op_counts(out) == {"Add": 1}
    assert_equivalent(model, out)


def test_constant_nodes_leave_no_links():
    """Constant nodes become initializers: every reader (two of one, one of another, none of an unread one)
    reads the initializer, which has no producer, and the removed nodes are linked to nothing."""
    nodes = [
        helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.ones(2, np.float32))),
        helper.make_node("Constant", [], ["d"], value_float=2.0),
        helper.make_node("Constant", [], ["unread"], value_int=3),
        helper.make_node("Add", ["x", "c"], ["s"]), helper.make_node("Mul", ["s", "c"], ["m"]),
        helper.make_node("Mul", ["m", "d"], ["y"]),
    ]
    graph = gs.import_onnx(make_model(nodes, [("x", F, [2])], [("y", F, [2])], {}, opset=17))
    consts = [n for n in graph.nodes if n.op == "Constant"]
    ctx = PassContext(opset=17)
    assert FoldConstants()._constant_nodes(graph, ctx) == 2
    assert [n.op for n in graph.nodes] == ["Constant", "Add", "Mul", "Mul"]  # the unread one stays
    for node in consts[:2]:
        assert not node.inputs and not node.outputs
    readers = {n.outputs[0].name: n for n in graph.nodes[1:]}
    c, d = readers["s"].inputs[1], readers["y"].inputs[1]
    assert isinstance(c, gs.Constant) and isinstance(d, gs.Constant) and readers["m"].inputs[1] is c
    assert (c.name, d.name) == ("c", "d") and not c.inputs and not d.inputs
    assert [id(n) for n in c.outputs] == [id(readers["s"]), id(readers["m"])] and d.outputs == [readers["y"]]


@pytest.mark.parametrize("op,bound,expected", [
    ("ConstantOfShape", [2**32, 2**32], (2**64, 1)),
    ("ConstantOfShape", [2**40, 2**30, 2**20], (2**90, 1)),
    ("ConstantOfShape", [4, -1], None),
    ("Range", np.inf, None),
])
def test_size_guard_counts_huge_sizes_exactly(op, bound, expected):
    """2**32 x 2**32 elements wrap to 0 in int64 (which let the fold allocate them); an infinite Range bound
    made math.ceil raise. Python ints count them; an unbounded or negative size refuses."""
    from k3opt import graph as gs
    from k3opt.graph.ir import as_constant, new_variable
    from k3opt.passes.fold._guard import predicted_elements, too_big

    if op == "Range":
        inputs = [as_constant("s", np.float32(0)), as_constant("l", np.float32(bound)), as_constant("d", np.float32(1))]
    else:
        inputs = [as_constant("shape", np.array(bound, np.int64))]
    node = gs.Node(op, inputs=inputs, outputs=[new_variable("y")])

    def value(t):
        return t.values if isinstance(t, gs.Constant) else None

    assert predicted_elements(node, value) == expected
    assert too_big(node, value, {})


H = T.FLOAT16
_FP16_EDGES = {  # constant float16 subgraphs that overflow or leave the function's domain: (nodes, a, folds)
    "Exp overflows": ([helper.make_node("Exp", ["a"], ["c"])], [11.5, 1.0, -20.0], False),
    "Sqrt of a negative": ([helper.make_node("Sqrt", ["a"], ["c"])], [-4.0, 4.0, 0.0], True),
    "Log of one, zero and a negative": ([helper.make_node("Log", ["a"], ["c"])], [1.0, 0.0, -1.0], True),
    "Log rounded": ([helper.make_node("Log", ["a"], ["c"])], [0.0, -1.0, 2.0], False),
    "Mul overflows midway": ([helper.make_node("Mul", ["a", "a"], ["m"]), helper.make_node("Div", ["m", "a"], ["c"])],
                             [300.0, 2.0, -300.0], False),
    "Mul in range": ([helper.make_node("Mul", ["a", "a"], ["m"]), helper.make_node("Div", ["m", "a"], ["c"])],
                     [3.0, 2.0, -4.0], True),
    "ReduceSum overflows": ([helper.make_node("ReduceSum", ["a"], ["c"], keepdims=1)], [60000.0, 60000.0, -1.0], False),
    "Softmax of large values": ([helper.make_node("Softmax", ["a"], ["c"])], [60000.0, 1.0, -60000.0], True),
    "Pow to infinity": ([helper.make_node("Pow", ["a", "a"], ["c"])], [10.0, 0.5, -2.0], False),
    "Exp underflows": ([helper.make_node("Exp", ["a"], ["c"])], [-12.0, 1.0, 0.0], False),
}


@pytest.mark.parametrize("case", sorted(_FP16_EDGES))
def test_float16_folding_computes_what_onnxruntime_computes(case):
    """Issue #26 item 8: onnxruntime computes float16 arithmetic in float32 (no float16 kernels on CPU), so
    a folded float16 constant must hold what the unfolded model gives, bit for bit, next to any input:
    where the value would be rounded once more than there (ln 2, an overflow to inf, an underflow), the fold
    declines; exact values (2, 0, -inf, NaN) fold."""
    nodes, values, folds = _FP16_EDGES[case]
    shape = [1] if "ReduceSum" in case else [3]
    model = make_model([*nodes, helper.make_node("Add", ["x", "c"], ["y"])], [("x", H, shape)],
                       [("y", H, [3])], {"a": np.array(values, np.float16)})
    out, _ = fold(model)
    assert (op_counts(out) == {"Add": 1}) == folds, op_counts(out)
    for x in (0.0, -65504.0, 1e-3):
        feeds = {"x": np.full(shape, x, np.float16)}
        expected, actual = run_ort(model, feeds)[0], run_ort(out, feeds)[0]
        assert expected.dtype == actual.dtype == np.float16
        assert np.array_equal(expected, actual, equal_nan=True), (x, expected, actual)
