"""eliminate-common-subexpressions: merges and refusals, with numerics."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto as T, helper, numpy_helper
from onnx_graphsurgeon.ir.tensor import LazyValues

from k3opt.graph.ir import peek

from k3opt.pipeline.pass_base import PassContext
from k3opt.passes.cleanup.eliminate_common_subexpressions import EliminateCommonSubexpressions
from k3opt.passes.cleanup.remove_dead_nodes import RemoveDeadNodes
from k3opt.pipeline.manager import PassManager
from tests.helpers import assert_equivalent, body_op_counts, export_graph, import_graph, make_model, op_counts
from tests.test_cleanup_ops import apply

F = T.FLOAT


def test_duplicate_chains_collapse():
    nodes = [helper.make_node("Relu", ["x"], ["a1"]), helper.make_node("Relu", ["x"], ["a2"]),
             helper.make_node("Softmax", ["a1"], ["b1"], axis=1), helper.make_node("Softmax", ["a2"], ["b2"], axis=1),
             helper.make_node("Add", ["b1", "b2"], ["y"])]
    model = make_model(nodes, [("x", F, [2, 3])], [("y", F, [2, 3])])
    out, n = apply(model, EliminateCommonSubexpressions())
    assert op_counts(out) == {"Relu": 1, "Softmax": 1, "Add": 1}
    assert_equivalent(model, out)
    assert apply(out, EliminateCommonSubexpressions())[1] == 0


def test_equal_constants_merge_and_make_nodes_equal():
    nodes = [helper.make_node("Mul", ["x", "c1"], ["a"]), helper.make_node("Mul", ["x", "c2"], ["b"]),
             helper.make_node("Sub", ["a", "b"], ["y"])]
    model = make_model(nodes, [("x", F, [3])], [("y", F, [3])], {"c1": np.float32([1, 2, 3]), "c2": np.float32([1, 2, 3])})
    out, _ = apply(model, EliminateCommonSubexpressions())
    assert op_counts(out) == {"Mul": 1, "Sub": 1} and len(out.graph.initializer) == 1
    assert_equivalent(model, out)


def test_different_attributes_constants_or_types_are_not_merged():
    nodes = [helper.make_node("Softmax", ["x"], ["a"], axis=0), helper.make_node("Softmax", ["x"], ["b"], axis=1),
             helper.make_node("Mul", ["x", "c1"], ["c"]), helper.make_node("Mul", ["x", "c2"], ["d"]),
             helper.make_node("Sum", ["a", "b", "c", "d"], ["y"])]
    inits = {"c1": np.float32([[1, 2, 3]]), "c2": np.float32([[1, 2, 4]])}
    model = make_model(nodes, [("x", F, [3, 3])], [("y", F, [3, 3])], inits)
    out, n = apply(model, EliminateCommonSubexpressions())
    assert n == 0 and out.graph.node == model.graph.node


def test_negative_zero_constant_is_not_zero():
    nodes = [helper.make_node("Mul", ["x", "c1"], ["a"]), helper.make_node("Mul", ["x", "c2"], ["b"]),
             helper.make_node("Div", ["a", "b"], ["y"])]
    model = make_model(nodes, [("x", F, [1])], [("y", F, [1])], {"c1": np.float32([0.0]), "c2": np.float32([-0.0])})
    out, n = apply(model, EliminateCommonSubexpressions())
    assert n == 0


def test_random_ops_are_not_merged():
    nodes = [helper.make_node("RandomNormalLike", ["x"], ["a"], seed=1.0),
             helper.make_node("RandomNormalLike", ["x"], ["b"], seed=1.0), helper.make_node("Sub", ["a", "b"], ["y"])]
    model = make_model(nodes, [("x", F, [3])], [("y", F, [3])])
    out, n = apply(model, EliminateCommonSubexpressions())
    assert n == 0 and op_counts(out)["RandomNormalLike"] == 2


def test_two_graph_outputs_are_not_merged_but_one_is():
    nodes = [helper.make_node("Relu", ["x"], ["y1"]), helper.make_node("Relu", ["x"], ["y2"]),
             helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Neg", ["r"], ["z"])]
    model = make_model(nodes, [("x", F, [3])], [("y1", F, [3]), ("y2", F, [3]), ("z", F, [3])])
    out, n = apply(model, EliminateCommonSubexpressions())
    assert op_counts(out) == {"Relu": 1, "Identity": 1, "Neg": 1}  # y2 = Identity(y1): one Relu computed
    assert [o.name for o in out.graph.output] == ["y1", "y2", "z"]
    assert_equivalent(model, out)


def test_big_or_external_constants_are_not_read():
    big = np.zeros(300_000, np.float32)
    nodes = [helper.make_node("Add", ["x", "c1"], ["a"]), helper.make_node("Add", ["x", "c2"], ["b"]),
             helper.make_node("Sub", ["a", "b"], ["y"])]
    model = make_model(nodes, [("x", F, [300_000])], [("y", F, [300_000])], {"c1": big, "c2": big})
    graph = gs.import_onnx(model)
    ctx = PassContext(opset=17)
    assert PassManager([EliminateCommonSubexpressions()]).run(graph, ctx) == 0
    ctx = PassContext(opset=17, options={"cse_max_const_bytes": 2 << 20})
    assert PassManager([EliminateCommonSubexpressions()]).run(graph, ctx) == 2


def test_merging_never_compares_nodes_structurally(monkeypatch):
    """gs unlinks a reader with ``Node.__eq__`` (names, attributes, inputs): quadratic over a
    tensor's many readers (9.7 s on a 64-layer Llama). Links must be updated by identity."""
    n = 200
    nodes = [helper.make_node("Relu", ["x"], [f"r{i}"]) for i in range(n)]
    nodes += [helper.make_node("Cast", [f"r{i}"], [f"c{i}"], to=F) for i in range(n)]
    nodes.append(helper.make_node("Sum", [f"c{i}" for i in range(n)], ["y"]))
    model = make_model(nodes, [("x", F, [3])], [("y", F, [3])])

    def no_eq(self, other):
        raise AssertionError("structural Node comparison")

    graph = import_graph(model)
    monkeypatch.setattr(gs.Node, "__eq__", no_eq)
    assert PassManager([EliminateCommonSubexpressions(), RemoveDeadNodes()]).run(graph, PassContext(opset=17)) > 0
    monkeypatch.undo()
    assert len(graph.nodes) == 3 and len(graph.inputs[0].outputs) == 1
    assert_equivalent(model, export_graph(graph, model))


def test_later_rounds_do_not_rehash_constants(monkeypatch):
    """A fixed-point round that changes nothing must be cheap: each constant is read once per run."""
    import k3opt.passes.cleanup.eliminate_common_subexpressions as cse

    reads = []
    for name in ("_head", "_const_digest"):
        read = getattr(cse, name)
        monkeypatch.setattr(cse, name, lambda c, read=read, name=name: reads.append((name, c.name)) or read(c))
    long = np.arange(100, dtype=np.float32)  # 400 bytes: hashed, as the first 64 are the same
    nodes = [helper.make_node("Mul", ["x", "c1"], ["a"]), helper.make_node("Mul", ["x", "c2"], ["b"]),
             helper.make_node("Sub", ["a", "b"], ["y"]), helper.make_node("Mul", ["y", "l1"], ["z1"]),
             helper.make_node("Mul", ["y", "l2"], ["z2"]), helper.make_node("Sub", ["z1", "z2"], ["w"])]
    weights = {"c1": np.float32([1, 2, 3]), "c2": np.float32([1, 2, 4]), "l1": long, "l2": long + (long == 99)}
    model = make_model(nodes, [("x", F, [3])], [("w", F, [100])], weights)
    graph, p = gs.import_onnx(model), EliminateCommonSubexpressions()
    for _ in range(3):
        assert p.run(graph, PassContext(opset=17)) == 0
    assert sorted(reads) == [("_const_digest", "l1"), ("_const_digest", "l2"),
                             ("_head", "c1"), ("_head", "c2"), ("_head", "l1"), ("_head", "l2")]


def test_constants_whose_first_bytes_differ_are_not_hashed(monkeypatch):
    """Distinct weights (a 64-layer model's q/k/v/o projections, 40 MB) differ in their first bytes: comparing
    those decides, without hashing all their bytes; equal ones are still found and merged."""
    import k3opt.passes.cleanup.eliminate_common_subexpressions as cse

    hashed = []
    digest = cse._const_digest
    monkeypatch.setattr(cse, "_const_digest", lambda c: hashed.append(c.name) or digest(c))
    rng = np.random.default_rng(0)
    w = {f"w{i}": rng.standard_normal((8, 8)).astype(np.float32) for i in range(4)}
    w["w4"] = w["w2"].copy()
    nodes = [helper.make_node("MatMul", ["x", name], [f"m{name}"]) for name in w]
    nodes.append(helper.make_node("Sum", [f"m{name}" for name in w], ["y"]))
    model = make_model(nodes, [("x", F, [2, 8])], [("y", F, [2, 8])], w)
    out, n = apply(model, EliminateCommonSubexpressions())
    assert sorted(hashed) == ["w2", "w4"] and n == 2  # the constant, then the MatMul reading it
    assert len(out.graph.initializer) == 4
    assert_equivalent(model, out)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int8, np.int32, np.int64, np.uint16, np.bool_,
                                   ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.int4, str])
@pytest.mark.parametrize("raw", [True, False])
@pytest.mark.parametrize("long", [True, False])
def test_constant_digest_is_the_arrays_whatever_the_storage(dtype, raw, long):
    """Hashing ``raw_data`` directly gives the digest of the array onnx reads (packed, typed-field and string
    storage take the array path), and so do the first bytes compared before it, so constants merge exactly
    as when every one was loaded.
    """
    import k3opt.passes.cleanup.eliminate_common_subexpressions as cse

    value = np.array([[0, 1, 2], [3, 1, 0]] * (20 if long else 1)).astype(dtype)
    proto = numpy_helper.from_array(value, "c")
    if not raw and proto.HasField("raw_data"):  # the same values in the typed field (int32_data, float_data, ...)
        proto = helper.make_tensor("c", proto.data_type, value.shape, value.reshape(-1).tolist()) \
            if dtype not in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.int4) \
            else helper.make_tensor("c", proto.data_type, value.shape, value.reshape(-1).astype(np.float32).tolist())
    c = gs.Constant("c", LazyValues(proto))
    assert cse._const_digest(c) == cse._digest(np.asarray(peek(c)))
    assert cse._const_digest(gs.Constant("d", peek(c))) == cse._const_digest(c)
    assert cse._head(gs.Constant("d", peek(c))) == cse._head(c)


def test_string_constants_compare_by_value_not_by_address():
    """An object array's ``tobytes()`` is its items' addresses, which the next load may reuse: two different
    strings, each loaded and dropped in turn, once compared equal (and merged). Equal ones merge."""
    import k3opt.passes.cleanup.eliminate_common_subexpressions as cse

    def const(name: str, text: str) -> gs.Constant:
        return gs.Constant(name, LazyValues(numpy_helper.from_array(np.array([text], dtype=object), name)))

    a, b, c = const("a", "hello world, a long string"), const("b", "goodbye world, another one"), \
        const("c", "hello world, a long string")
    for read in (cse._head, cse._const_digest):
        assert read(a) != read(b) and read(a) == read(c)
    nodes = [helper.make_node("Identity", [name], [f"y{name}"]) for name in "abc"]
    graph = helper.make_graph(nodes, "g", [], [helper.make_tensor_value_info(f"y{name}", T.STRING, [1]) for name in "abc"],
                              [numpy_helper.from_array(np.array([text], dtype=object), name)
                               for name, text in zip("abc", ["x" * 40, "z" * 40, "x" * 40])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    out, _ = apply(model, EliminateCommonSubexpressions())
    assert sorted(i.name for i in out.graph.initializer) == ["a", "b"]


def _links(graph: gs.Graph) -> list:
    """Every tensor's producer and reader lists, by node name, in order."""
    tensors = {id(t): t for n in graph.nodes for t in list(n.inputs) + list(n.outputs)}
    return sorted((t.name, [p.name for p in t.inputs], [c.name for c in t.outputs]) for t in tensors.values())


def test_detach_all_links_like_detaching_one_by_one():
    """Batch unlinking (each reader list filtered once) leaves exactly the links node-by-node detach leaves:
    shared constants, a node reading one tensor twice, chains of detached nodes, and a body's outer reads.
    """
    from k3opt.passes._rewire import detach, detach_all

    body = helper.make_graph([helper.make_node("Mul", ["x", "k"], ["by"])], "body", [],
                             [helper.make_tensor_value_info("by", F, [3])])
    nodes = [helper.make_node("Mul", ["x", "k"], [f"m{i}"], name=f"m{i}") for i in range(6)]
    nodes += [helper.make_node("Add", ["m1", "m1"], ["a"], name="twice"), helper.make_node("Relu", ["a"], ["r"], name="r"),
              helper.make_node("If", ["c"], ["f"], name="if", then_branch=body, else_branch=body),
              helper.make_node("Sum", ["m0", "m2", "m3", "m4", "m5", "f"], ["y"], name="sum")]
    model = make_model(nodes, [("x", F, [3]), ("c", T.BOOL, [])], [("y", F, [3]), ("r", F, [3])],
                       {"k": np.float32([1, 2, 3])})
    graphs = [gs.import_onnx(model) for _ in range(2)]
    picked = [[n for n in g.nodes if n.name in ("m1", "m3", "twice", "r", "if")] for g in graphs]
    one_by_one: list = []
    for n in picked[0]:
        detach(n, one_by_one)
    batch: list = []
    detach_all(picked[1], batch)
    assert _links(graphs[0]) == _links(graphs[1]) and [n.name for n in one_by_one] == [n.name for n in batch]
    assert not any(n.inputs or n.outputs for n in batch)
    assert [c.name for c in graphs[1].tensors()["x"].outputs] == ["m0", "m2", "m4", "m5"]  # the body's Muls unlinked


def _random_graph(seed: int) -> gs.Graph:
    """Nodes sharing inputs and ops in many ways, some with attributes CSE cannot compare, in random order
    (not topological: merges then rewire nodes already visited)."""
    import random

    rng = random.Random(seed)
    tensors = [gs.Variable("x", dtype=np.float32, shape=[2]), gs.Variable("y", dtype=np.float32, shape=[2])]
    nodes = []
    for i in range(60):
        op = rng.choice(["Relu", "Add", "Add"])
        inputs = [rng.choice(tensors[:2 + i // 8] + tensors[-2:]) for _ in range(1 if op == "Relu" else 2)]
        attrs = rng.choice([{}, {"a": 1}, {"a": 2}, {"a": 1, "odd": {}}])  # a dict: not comparable
        out = gs.Variable(f"t{i}", dtype=np.float32, shape=[2])
        nodes.append(gs.Node(op, name=f"n{i}", attrs=dict(attrs), inputs=inputs, outputs=[out]))
        tensors.append(out)
    rng.shuffle(nodes)
    return gs.Graph(nodes=nodes, inputs=tensors[:2], outputs=tensors[-3:], opset=17)


@pytest.mark.parametrize("seed", range(10))
def test_node_merges_match_keying_every_node(seed):
    """Keying attributes only for nodes whose head another shares merges exactly what keying all did."""
    from k3opt.passes.cleanup import eliminate_common_subexpressions as cse
    from k3opt.passes._rewire import detach_all, remove

    def keyed_all(graph: gs.Graph) -> int:
        seen, merged = {}, []
        for node in list(graph.nodes):
            head = cse._node_head(node)
            attrs = None if head is None else cse._attrs_key(node)
            if attrs is None:
                continue
            keep = seen.setdefault((head, attrs), node)
            if keep is not node and EliminateCommonSubexpressions._merge(graph, node, keep):
                merged.append(node)
        dead = []
        detach_all(merged, dead)
        remove(graph, dead)
        return len(dead)

    def state(graph: gs.Graph) -> list:
        return [(n.name, [t.name for t in n.inputs]) for n in graph.nodes] + [[t.name for t in graph.outputs]]

    ours, theirs = _random_graph(seed), _random_graph(seed)
    n = EliminateCommonSubexpressions()._nodes(ours)
    assert n == keyed_all(theirs) and n > 0
    assert state(ours) == state(theirs)


# -- If/Loop/Scan bodies --------------------------------------------------------------------------------------

def _twice_branch(name: str, out_twice: bool = False) -> onnx.GraphProto:
    """A body computing Relu(x) twice from the outer x (``out_twice``: both are the body's outputs)."""
    nodes = [helper.make_node("Relu", ["x"], [f"{name}_r1"]), helper.make_node("Relu", ["x"], [f"{name}_r2"])]
    if out_twice:
        outs = [f"{name}_r1", f"{name}_r2"]
    else:
        nodes.append(helper.make_node("Add", [f"{name}_r1", f"{name}_r2"], [f"{name}_y"]))
        outs = [f"{name}_y"]
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(o, F, [2, 3]) for o in outs])


def _if_twice(out_twice: bool = False, outer_relu: bool = False) -> onnx.ModelProto:
    n_out = 2 if out_twice else 1
    nodes = [helper.make_node("If", ["c"], [f"y{k}" for k in range(n_out)],
                              then_branch=_twice_branch("then", out_twice),
                              else_branch=_twice_branch("else", out_twice))]
    outputs = [(f"y{k}", F, [2, 3]) for k in range(n_out)]
    if outer_relu:
        nodes.append(helper.make_node("Relu", ["x"], ["outer"]))
        outputs.append(("outer", F, [2, 3]))
    return make_model(nodes, [("x", F, [2, 3]), ("c", T.BOOL, [])], outputs)


_IF_FEEDS = [{"x": np.arange(-3, 3, dtype=np.float32).reshape(2, 3), "c": np.array(c)} for c in (True, False)]


def test_equal_nodes_merge_inside_each_if_branch():
    model = _if_twice()
    out, n = apply(model, EliminateCommonSubexpressions(), RemoveDeadNodes())
    assert body_op_counts(out, "then_branch") == {"Relu": 1, "Add": 1} == body_op_counts(out, "else_branch")
    for feeds in _IF_FEEDS:
        assert_equivalent(model, out, feeds=feeds)


def test_a_body_node_is_not_merged_into_the_outer_graphs():
    """The outer Relu(x) equals each branch's: the branches keep their own (and merge their two into one)."""
    model = _if_twice(outer_relu=True)
    out, _ = apply(model, EliminateCommonSubexpressions(), RemoveDeadNodes())
    assert op_counts(out) == {"If": 1, "Relu": 1} and body_op_counts(out, "then_branch") == {"Relu": 1, "Add": 1}
    for feeds in _IF_FEEDS:
        assert_equivalent(model, out, feeds=feeds)


def test_two_body_outputs_are_not_merged():
    model = _if_twice(out_twice=True)
    out, _ = apply(model, EliminateCommonSubexpressions(), RemoveDeadNodes())
    assert body_op_counts(out, "then_branch") == {"Relu": 1, "Identity": 1}


def test_equal_nodes_merge_inside_a_loop_body():
    """v += (v_in + one) + (v_in + one) three times: the two Adds of the carried value are one."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Add", ["v_in", "one"], ["a1"]), helper.make_node("Add", ["v_in", "one"], ["a2"]),
         helper.make_node("Add", ["a1", "a2"], ["v_out"])],
        "body", [helper.make_tensor_value_info("iter", T.INT64, []),
                 helper.make_tensor_value_info("cond_in", T.BOOL, []), helper.make_tensor_value_info("v_in", F, [2])],
        [helper.make_tensor_value_info("cond_out", T.BOOL, []), helper.make_tensor_value_info("v_out", F, [2])],
        [numpy_helper.from_array(np.float32(1), "one")])
    model = make_model([helper.make_node("Loop", ["m", "", "v0"], ["v"], body=body)], [("v0", F, [2])],
                       [("v", F, [2])], {"m": np.int64(3)})
    out, _ = apply(model, EliminateCommonSubexpressions(), RemoveDeadNodes())
    assert body_op_counts(out, "body") == {"Identity": 1, "Add": 2}
    assert_equivalent(model, out, feeds={"v0": np.float32([0, 1])})
