"""The fast graph edges (ir.toposort, ir.cleanup, the fast importer, the export) give exactly gs's results.

Each helper replaces a gs routine that was slow on a 16k-node model; the
claim is "same result", so every test compares with gs itself: the same
node order, the same nodes kept, the same exported bytes.
"""
from __future__ import annotations

import random

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto as T, helper
from onnx_graphsurgeon.util.exception import OnnxGraphSurgeonException

from k3opt import modelio
from k3opt.graph import gs_roundtrip, ir

F = T.FLOAT


def _vi(name: str, shape=(2,)) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, F, list(shape))


def _model(nodes, inputs, outputs, inits=(), opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [_vi(n) for n in inputs], [_vi(n) for n in outputs], list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _branch(name: str, op: str, outer: str, out: str) -> onnx.GraphProto:
    """A body reading ``outer`` from the enclosing graph (plus one dead node)."""
    return helper.make_graph([helper.make_node(op, [outer, outer], [out], name=f"{name}_op"),
                              helper.make_node("Neg", [outer], [f"{name}_dead"], name=f"{name}_dead")],
                             name, [], [_vi(out)])


def _if_model() -> onnx.ModelProto:
    """Outer-scope reads from If branches, a dead node, a duplicate consumer, an unused input,
    an optional empty input, and graph outputs that are an input and a constant."""
    c = helper.make_tensor("c", F, [2], [1.0, 2.0])
    nodes = [
        helper.make_node("ReduceSum", ["x", "c"], ["cond_f"], keepdims=0, name="sum"),
        helper.make_node("Cast", ["cond_f"], ["cond"], to=T.BOOL, name="cast"),
        helper.make_node("If", ["cond"], ["r"], name="if",
                         then_branch=_branch("then", "Add", "a", "t_out"),
                         else_branch=_branch("else", "Mul", "b", "e_out")),
        helper.make_node("Relu", ["x"], ["a"], name="relu"),
        helper.make_node("Sigmoid", ["x"], ["b"], name="sig"),
        helper.make_node("Add", ["r", "r"], ["rr"], name="twice"),
        helper.make_node("Clip", ["rr", "", "c"], ["y"], name="clip"),
        helper.make_node("Exp", ["x"], ["dead"], name="dead"),
    ]
    return _model(nodes, ["x", "unused"], ["y", "x", "c"], [c])


def _loop_model() -> onnx.ModelProto:
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"], name="keep_going"),
         helper.make_node("Add", ["acc", "w"], ["acc_out"], name="step")],
        "body", [helper.make_tensor_value_info("i", T.INT64, []), helper.make_tensor_value_info("cond_in", T.BOOL, []),
                 _vi("acc")], [helper.make_tensor_value_info("cond_out", T.BOOL, []), _vi("acc_out")])
    n = helper.make_tensor("n", T.INT64, [], [3])
    nodes = [helper.make_node("Loop", ["n", "", "x"], ["y"], body=body, name="loop"),
             helper.make_node("Neg", ["x"], ["w"], name="w")]
    return _model(nodes, ["x"], ["y"], [n], opset=17)


def _exported(graph: gs.Graph) -> bytes:
    return gs_roundtrip.export_onnx(graph).SerializeToString()


def _order(graph: gs.Graph) -> list[list[str]]:
    return [[n.name for n in g.nodes] for g in ir.all_graphs(graph)]


MODELS = {"if": _if_model, "loop": _loop_model}


@pytest.mark.parametrize("make", MODELS.values(), ids=list(MODELS))
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_toposort_matches_gs_on_shuffled_graphs(make, seed):
    """The tie order among same-level nodes is gs's too (the export must stay byte-identical)."""
    ours, theirs = gs.import_onnx(make()), gs.import_onnx(make())
    for g1, g2 in zip(ir.all_graphs(ours), ir.all_graphs(theirs)):
        perm = list(range(len(g1.nodes)))
        random.Random(seed).shuffle(perm)
        g1.nodes, g2.nodes = [g1.nodes[i] for i in perm], [g2.nodes[i] for i in perm]
    ir.toposort(ours)
    theirs.toposort()
    assert _order(ours) == _order(theirs)
    assert _exported(ours) == _exported(theirs)


@pytest.mark.parametrize("make", MODELS.values(), ids=list(MODELS))
def test_cleanup_matches_gs(make):
    ours, theirs = gs.import_onnx(make()), gs.import_onnx(make())
    ir.cleanup(ours)
    theirs.cleanup()
    assert _order(ours) == _order(theirs)
    assert [t.name for t in ours.inputs] == [t.name for t in theirs.inputs]
    assert _exported(ours) == _exported(theirs)


def test_cleanup_drops_dead_nodes_in_bodies_and_keeps_unused_inputs():
    graph = ir.cleanup(gs.import_onnx(_if_model()))
    names = sum(_order(graph), [])
    assert "dead" not in names and "then_dead" not in names and "then_op" in names
    assert [t.name for t in graph.inputs] == ["x", "unused"]


def test_cleanup_unlinks_what_it_drops_and_graph_input_producers():
    graph = gs.import_onnx(_if_model())
    x = graph.tensors()["x"]
    dead = next(n for n in graph.nodes if n.name == "dead")
    fake = gs.Node("Identity", name="feeds_x", inputs=[graph.tensors()["a"]], outputs=[x])
    graph.nodes.append(fake)
    ir.cleanup(graph)
    assert not x.inputs and not fake.outputs
    assert not dead.inputs and not dead.outputs and all(n is not dead for n in x.outputs)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_toposort_matches_gs_when_a_produced_tensor_is_unnamed(seed):
    """gs orders by local names only: an unnamed tensor's producer does not count, so the fast path (a named
    output of a node of the graph is local) must not take it, and the full walk for the names decides."""
    def graph() -> gs.Graph:
        x, hidden, y, z = gs.Variable("x"), gs.Variable(""), gs.Variable("y"), gs.Variable("z")
        nodes = [gs.Node("Relu", name="make", inputs=[x], outputs=[hidden]),
                 gs.Node("Neg", name="read", inputs=[hidden], outputs=[y]),
                 gs.Node("Exp", name="after", inputs=[y], outputs=[z])]
        random.Random(seed).shuffle(nodes)
        return gs.Graph(nodes=nodes, inputs=[x], outputs=[z])

    ours, theirs = graph(), graph()
    ir.toposort(ours)
    theirs.toposort()
    assert _order(ours) == _order(theirs)


def test_toposort_refuses_a_cycle_like_gs():
    graph = gs.import_onnx(_model([helper.make_node("Neg", ["z"], ["w"]), helper.make_node("Neg", ["w"], ["z"]),
                                   helper.make_node("Add", ["x", "z"], ["y"])], ["x"], ["y"]))
    with pytest.raises(OnnxGraphSurgeonException, match="Cycle"):
        ir.toposort(graph)


@pytest.mark.parametrize("helper_, method", [(ir.toposort, "toposort"), (ir.cleanup, "cleanup")])
def test_a_producer_outside_the_graph_is_refused_like_gs(helper_, method):
    def graph_with_stray_producer() -> gs.Graph:
        graph = gs.import_onnx(_model([helper.make_node("Neg", ["x"], ["y"]), helper.make_node("Exp", ["y"], ["z"])],
                                      ["x"], ["z"]))
        gs.Node("Exp", name="stray", inputs=[graph.inputs[0]], outputs=[graph.nodes[0].outputs[0]])
        return graph

    with pytest.raises(OnnxGraphSurgeonException, match="not in the graph"):
        getattr(graph_with_stray_producer(), method)()
    with pytest.raises(OnnxGraphSurgeonException, match="not in the graph"):
        helper_(graph_with_stray_producer())


def _function_model() -> onnx.ModelProto:
    """Local functions: F (called by the graph) calls G; H is called by nobody and listed first."""
    neg = [helper.make_node("Neg", ["a"], ["b"])]
    g = helper.make_function("local", "G", ["a"], ["b"], neg, [helper.make_opsetid("", 17)])
    h = helper.make_function("local", "H", ["a"], ["b"], neg, [helper.make_opsetid("", 17)])
    f = helper.make_function("local", "F", ["a"], ["c"],
                             [helper.make_node("Exp", ["a"], ["dead"]), helper.make_node("G", ["a"], ["b"], domain="local"),
                              helper.make_node("Neg", ["b"], ["c"])],
                             [helper.make_opsetid("", 17), helper.make_opsetid("local", 1)])
    model = _model([helper.make_node("F", ["x"], ["y"], domain="local"), helper.make_node("Exp", ["x"], ["d"])],
                   ["x"], ["y"])
    model.functions.extend([h, f, g])
    model.opset_import.append(helper.make_opsetid("local", 1))
    return model


def test_graphs_with_functions_are_sorted_and_cleaned_as_gs_does():
    """k3opt owns toposort and cleanup outright: local functions too (their nodes, then their order)."""
    model = _function_model()
    ours, theirs = gs.import_onnx(model), gs.import_onnx(model)
    for g in (ours, theirs):
        g.functions[1].nodes.reverse()  # F's nodes out of order
    ir.toposort(ir.cleanup(ours))
    theirs.cleanup().toposort()
    assert _exported(ours) == _exported(theirs) and len(ours.nodes) == 1
    assert [f.name for f in ours.functions] == [f.name for f in theirs.functions] == ["H", "G", "F"]
    assert [n.op for n in ours.functions[2].nodes] == ["G", "Neg"]  # F's dead Exp is gone


def test_toposort_and_cleanup_match_gs_on_a_zoo_model():
    from tests.zoo import zoo_model

    model = modelio.load(zoo_model("llama", "torchscript"))
    ours, theirs = modelio.import_graph(model), modelio.import_graph(modelio.load(zoo_model("llama", "torchscript")))
    perm = list(range(len(ours.nodes)))
    random.Random(0).shuffle(perm)
    ours.nodes, theirs.nodes = [ours.nodes[i] for i in perm], [theirs.nodes[i] for i in perm]
    ir.toposort(ir.cleanup(ours))
    theirs.cleanup().toposort()
    assert _order(ours) == _order(theirs)
    assert _exported(ours) == _exported(theirs)


# --------------------------------------------------------------------------- the importer


def _canonical(graph: gs.Graph) -> list:
    """Everything gs keeps for ``graph``: every reachable node/tensor/graph's attributes, in order,
    with objects numbered by first appearance (so two imports compare equal only when their
    objects, values and use-def links are the same)."""
    from google.protobuf.message import Message
    from onnx_graphsurgeon.ir.tensor import LazyValues
    from onnx_graphsurgeon.util.misc import SynchronizedList

    objects = (gs.Node, gs.Tensor, gs.Graph, LazyValues, gs.Node.AttributeRef)
    ids: dict[int, int] = {}
    queue: list = []

    def ref(o):
        if isinstance(o, objects):
            if id(o) not in ids:
                ids[id(o)] = len(ids)
                queue.append(o)
            return "ref", ids[id(o)]
        if isinstance(o, SynchronizedList):
            return "links", ref(o.parent_obj), o.field_name, [ref(x) for x in o]
        if isinstance(o, (list, tuple)):
            return type(o).__name__, [ref(x) for x in o]
        if isinstance(o, dict):
            return type(o).__name__, [(k, ref(v)) for k, v in o.items()]
        if isinstance(o, Message):
            return "proto", type(o).__name__, o.SerializeToString(deterministic=True)
        if type(o).__name__.startswith("Repeated"):
            return type(o).__name__, [ref(x) for x in o]
        return type(o).__name__, repr(o)

    ref(graph)
    out = []
    for o in queue:  # grows while walking
        out.append((type(o).__name__, [(k, ref(v)) for k, v in vars(o).items()]))
    return out


def _kitchen_sink(optional: bool = True) -> onnx.ModelProto:
    """One graph with every edge case the fast importer must get right (gs cannot export optional types)."""
    bf16 = helper.make_tensor("bf", T.BFLOAT16, [2], [1.0, 2.0])
    ext = helper.make_tensor("ext", F, [2], [0.0, 0.0])
    ext.data_location = T.EXTERNAL
    ext.ClearField("float_data")
    for key, value in (("location", "w.bin"), ("offset", "0"), ("length", "8")):
        entry = ext.external_data.add()
        entry.key, entry.value = key, value
    opt_type = helper.make_optional_type_proto(helper.make_tensor_type_proto(F, [2]))
    nodes = [
        helper.make_node("Add", ["later", "x"], ["early"], name="reads_before_produced"),
        helper.make_node("Neg", ["x"], ["later"]),  # no name
        helper.make_node("Add", ["x", "x"], ["twice"], name="dup_consumer"),
        helper.make_node("Clip", ["twice", "", "c"], ["clipped"], name="empty_input"),
        helper.make_node("Dropout", ["clipped"], ["dropped", ""], name="empty_output"),
        helper.make_node("Constant", [], ["k_t"], value=helper.make_tensor("v", F, [2], [1.0, 2.0])),
        helper.make_node("Constant", [], ["k_bf"], value=helper.make_tensor("vb", T.BFLOAT16, [1], [1.0])),
        helper.make_node("Constant", [], ["k_f"], value_float=1.5, name="k_f"),
        helper.make_node("Constant", [], ["k_fs"], value_floats=[1.5, 2.5]),
        helper.make_node("Constant", [], ["k_i"], value_int=3),
        helper.make_node("Constant", [], ["k_is"], value_ints=[3, 4]),
        helper.make_node("Constant", [], ["k_s"], value_string="abc"),
        helper.make_node("Constant", [], ["k_ss"], value_strings=["a", "é"]),
        helper.make_node("Optional", [], ["none"], type=opt_type, name="skipped_kind"),
        helper.make_node("Custom", ["x", "ext", "bf"], ["custom"], domain="my.domain", alpha=0.5),
        helper.make_node("If", ["cond"], ["branch"], name="if", then_branch=_branch("then", "Add", "twice", "t"),
                         else_branch=_branch("else", "Mul", "x", "e")),
        helper.make_node("Identity", ["x"], ["x_again"], domain=""),
    ]
    graph = helper.make_graph(nodes, "sink", [_vi("x"), _vi("unused"), _vi("c"), _vi("cond", ())],
                              [_vi("early"), _vi("x"), _vi("bf"), _vi("dropped")], [bf16, ext],
                              doc_string="doc")
    graph.initializer.append(helper.make_tensor("c", F, [], [1.0]))  # an input with a default
    graph.value_info.extend([
        helper.make_tensor_value_info("twice", F, None),  # dtype only ...
        helper.make_tensor_value_info("twice", 0, [2]),  # ... then the shape
        helper.make_tensor_value_info("bf", F, [3]),  # an initializer's entry: ignored
        helper.make_tensor_value_info("later", F, ["n"]),
        helper.make_tensor_sequence_value_info("seq", F, [2]),
    ] + ([helper.make_value_info("none", opt_type)] if optional else []))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("my.domain", 1)],
                              producer_name="p", producer_version="1")
    return model


def _sparse_model() -> onnx.ModelProto:
    model = _model([helper.make_node("Add", ["x", "s"], ["y"])], ["x"], ["y"])
    model.graph.sparse_initializer.append(helper.make_sparse_tensor(
        helper.make_tensor("s", F, [1], [1.0]), helper.make_tensor("i", T.INT64, [1], [0]), [2]))
    return model


IMPORT_CASES = {"kitchen_sink": _kitchen_sink, "if": _if_model, "loop": _loop_model}


@pytest.mark.parametrize("make", IMPORT_CASES.values(), ids=list(IMPORT_CASES))
def test_fast_import_builds_gs_graph_exactly(make):
    from k3opt.graph import gs_import

    model = make()
    assert _canonical(gs_import.import_onnx(model)) == _canonical(gs.import_onnx(model))


def test_roundtrip_import_restores_skipped_attributes_only_where_gs_imported():
    """Walking only the nodes whose attributes gs imported restores what the full walk restores,
    a skipped kind inside a body included."""
    from k3opt.graph import gs_import

    opt_type = helper.make_optional_type_proto(helper.make_tensor_type_proto(F, [2]))
    body = helper.make_graph([helper.make_node("Optional", [], ["o"], type=opt_type, name="in_body"),
                              helper.make_node("OptionalHasElement", ["o"], ["has"])], "b", [],
                             [helper.make_tensor_value_info("has", T.BOOL, [])])
    model = _kitchen_sink()
    model.graph.node.append(helper.make_node("If", ["cond"], ["has_out"], then_branch=body, else_branch=body))

    def full_walk(m: onnx.ModelProto) -> gs.Graph:
        graph = gs_import.import_onnx(m)
        gs_roundtrip.restore_default_inputs(m, graph)
        gs_roundtrip.restore_skipped_attributes(m.graph, graph)
        return graph

    for make in (lambda: model, _if_model, _loop_model):
        assert _canonical(gs_roundtrip.import_onnx(make())) == _canonical(full_walk(make()))
    graph = gs_roundtrip.import_onnx(model)
    inner = [n for n in graph.nodes if n.op == "If"][-1].attrs["then_branch"].nodes[0]
    assert "type" in inner.attrs and "type" in next(n for n in graph.nodes if n.name == "skipped_kind").attrs


def test_fast_import_builds_functions_and_sparse_initializers_as_gs_does():
    from k3opt.graph import gs_import

    for model in (_function_model(), _sparse_model()):
        assert _canonical(gs_import.import_onnx(model)) == _canonical(gs.import_onnx(model))
    ours = gs_import.import_onnx(_function_model())
    assert [f.name for f in ours.functions] == ["H", "F", "G"]
    assert all(f._functions is ours._functions for f in ours.functions)  # one list shared, as gs shares it


def test_fast_import_matches_gs_on_zoo_models():
    from k3opt.graph import gs_import
    from tests.zoo import EXPORTERS, zoo_model

    for exporter in EXPORTERS:
        model = modelio.load(zoo_model("deepseek_v3", exporter))
        assert _canonical(gs_import.import_onnx(model)) == _canonical(gs.import_onnx(model))


def test_fast_import_leaves_the_graph_in_the_oldest_generation():
    """The young collections must not traverse a freshly imported graph (they did, ~0.5 s per run)."""
    import gc

    from k3opt.graph import gs_import

    graph = gs_import.import_onnx(_kitchen_sink())
    oldest = {id(o) for o in gc.get_objects(generation=2)}
    assert id(graph) in oldest and all(id(n) in oldest for n in graph.nodes)


def test_fast_import_restores_the_collector():
    import gc

    from k3opt.graph import gs_import

    assert gc.isenabled()
    gs_import.import_onnx(_kitchen_sink())
    assert gc.isenabled()
    gc.disable()
    try:
        gs_import.import_onnx(_kitchen_sink())
        assert not gc.isenabled()
    finally:
        gc.enable()


# --------------------------------------------------------------------------- the exporter


def _odd_tensors(graph: gs.Graph) -> None:
    """What passes leave for the exporter: numpy constants, a constant sharing another's lazy
    proto, ONNX-typed and sequence-typed variables, unknown and symbolic dims."""
    import numpy as np

    x = graph.inputs[0]
    folded = gs.Constant("folded", np.array([1, 2], dtype=np.int64))
    lazy = next(t for t in graph.tensors().values() if isinstance(t, gs.Constant))
    twin = gs.Constant("twin", lazy._values)
    bf = gs.Variable("bf_var", dtype=T.BFLOAT16, shape=[None, "n", 3])
    seq = gs.Variable("seq_var", dtype=np.float32, shape=[2], type="sequence_type")
    scalar = gs.Variable("scalar", dtype=np.float32, shape=[])
    graph.nodes += [gs.Node("Custom", name="odd", inputs=[x, folded, twin], outputs=[bf, seq, scalar], domain="my.domain",
                            attrs={"f": 1.0, "ints": [1, 2], "s": "text", "t": gs.Constant("attr_t", np.zeros(2, np.float32))})]


EXPORT_CASES = {"kitchen_sink": lambda: _kitchen_sink(optional=False), "if": _if_model, "loop": _loop_model,
                "sparse": _sparse_model}


@pytest.mark.parametrize("make", EXPORT_CASES.values(), ids=list(EXPORT_CASES))
@pytest.mark.parametrize("odd", [False, True], ids=["as_imported", "odd_tensors"])
def test_fast_export_writes_gs_bytes(make, odd):
    from k3opt.graph import gs_export

    graph = gs.import_onnx(make())
    if odd:
        _odd_tensors(graph)
    ours = gs_export.export_onnx(graph).SerializeToString()
    assert ours == gs.export_onnx(graph, do_type_check=False).SerializeToString()


@pytest.mark.parametrize("where", ["top", "body"])
def test_fast_export_imports_a_new_domain_like_gs(where):
    """The domains the export collects while writing the nodes (or, with bodies, gs's walk) give gs's imports."""
    from k3opt.graph import gs_export

    graph = gs.import_onnx(_if_model())
    node = graph.nodes[-1] if where == "top" else next(n for n in graph.nodes if n.op == "If").attrs["then_branch"].nodes[0]
    node.domain = "new.domain"
    ours = gs_export.export_onnx(graph)
    assert ours.SerializeToString() == gs.export_onnx(graph, do_type_check=False).SerializeToString()
    assert "new.domain" in {o.domain for o in ours.opset_import}


def _value_info_graph(*variables: gs.Variable) -> gs.Graph:
    x = gs.Variable("x", dtype=np.float32, shape=[2])
    return gs.Graph(nodes=[gs.Node("Custom", inputs=[x], outputs=list(variables))], inputs=[x], outputs=[],
                    opset=17)


#: Variables whose value_info the fast writer makes from bytes, or hands to the proto builder.
_VALUE_INFOS = {
    "plain and shared types": lambda: [gs.Variable(f"v{i}", dtype=np.float32, shape=[1, "seq", None, 4])
                                       for i in range(3)],
    "negative, huge and zero dims": lambda: [gs.Variable("neg", dtype=np.int64, shape=[-1, 2**40, 0])],
    "no shape, scalar, onnx dtype": lambda: [gs.Variable("noshape", dtype=np.float16),
                                             gs.Variable("scalar", dtype=np.float32, shape=[]),
                                             gs.Variable("bf", dtype=T.BFLOAT16, shape=[3])],
    "shape only": lambda: [gs.Variable("shape_only", shape=[2, 3])],
    "unicode names and dims": lambda: [gs.Variable("é€", dtype=np.float32, shape=["n_é", 1])],
    "sequence between plain ones": lambda: [gs.Variable("a", dtype=np.float32, shape=[1]),
                                            gs.Variable("s", dtype=np.float32, shape=[1], type="sequence_type"),
                                            gs.Variable("b", dtype=np.float32, shape=[1])],
    "tuple shape": lambda: [gs.Variable("tup", dtype=np.float32, shape=(5, "k"))],
}
#: Variables gs refuses to export: the fast writer must raise the same error.
_BAD_VALUE_INFOS = {
    "bool dim after an equal int dim": lambda: [gs.Variable("one", dtype=np.float32, shape=[1]),
                                                gs.Variable("true", dtype=np.float32, shape=[True])],
    "float dim after an equal int dim": lambda: [gs.Variable("one", dtype=np.float32, shape=[1]),
                                                 gs.Variable("float", dtype=np.float32, shape=[1.0])],
    "numpy int dim": lambda: [gs.Variable("npdim", dtype=np.float32, shape=[np.int64(3)])],
    "dim past int64": lambda: [gs.Variable("big", dtype=np.float32, shape=[2**63])],
    "lone surrogate": lambda: [gs.Variable("bad\udc80", dtype=np.float32, shape=[1])],
}


@pytest.mark.parametrize("case", list(_VALUE_INFOS))
def test_fast_export_value_infos_are_gs_bytes(case):
    from k3opt.graph import gs_export

    graph = _value_info_graph(*_VALUE_INFOS[case]())
    assert gs_export.export_onnx(graph).SerializeToString() == \
        gs.export_onnx(graph, do_type_check=False).SerializeToString()


@pytest.mark.parametrize("case", list(_BAD_VALUE_INFOS))
def test_fast_export_refuses_value_infos_gs_refuses(case):
    from k3opt.graph import gs_export

    graph = _value_info_graph(*_BAD_VALUE_INFOS[case]())
    with pytest.raises(Exception) as theirs:
        gs.export_onnx(graph, do_type_check=False)
    with pytest.raises(type(theirs.value)):
        gs_export.export_onnx(graph)


def test_fast_export_writes_functions_as_gs_does():
    from k3opt.graph import gs_export

    graph = gs.import_onnx(_function_model())
    ours = gs_export.export_onnx(graph)
    assert len(ours.functions) == 3
    assert ours.SerializeToString() == gs.export_onnx(graph, do_type_check=False).SerializeToString()


def test_tensor_map_is_gs_tensors_without_warnings():
    from k3opt.graph.ir import tensor_map

    graph = gs.import_onnx(_kitchen_sink())
    graph.nodes[0].outputs.append(gs.Variable("x"))  # a distinct tensor reusing a name: the last one wins
    got = tensor_map(graph)
    want = graph.tensors()
    assert list(got) == list(want) and all(got[k] is want[k] for k in want)


def test_optimized_zoo_model_exports_gs_bytes():
    """After the passes (shapes inferred, constants folded), on a real export."""
    import k3opt
    from k3opt import modelio
    from k3opt.graph import gs_export
    from tests.zoo import zoo_model

    captured = {}
    real = modelio.export_graph

    def capture(graph, model):
        out = real(graph, model)
        captured["gs"] = gs.export_onnx(graph, do_type_check=False).SerializeToString()
        captured["ours"] = gs_export.export_onnx(graph).SerializeToString()
        return out

    import unittest.mock

    with unittest.mock.patch.object(modelio, "export_graph", capture):
        k3opt.optimize(str(zoo_model("gpt2", "torchscript")))
    assert captured["ours"] == captured["gs"]


def test_another_gs_release_is_refused_at_import():
    """k3opt builds and writes gs 0.6's objects itself: another release is refused, in one line, not half-served."""
    import subprocess
    import sys

    code = ("import onnx_graphsurgeon as gs; gs.__version__ = '0.7.0'\n"
            "try:\n    import k3opt.graph.ir\nexcept ImportError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert "k3opt needs onnx-graphsurgeon 0.6.x (installed: 0.7.0)" in out
