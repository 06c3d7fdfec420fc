"""The library API: k3opt.optimize / optimize_file, opsets, input shapes, targets, plugins, shapes."""
from __future__ import annotations

import gc
import json
import weakref
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import k3opt
from k3opt.modelio import opset as opsets, opset_nodes
from k3opt.errors import UsageError, VerificationError
from k3opt.pipeline.pass_base import Pass
from k3opt.report import Report
from k3opt.pipeline.verify import runnable_bytes
from tests.helpers import assert_equivalent, assert_value_info_holds, make_model, op_counts


def small_model(opset: int = 17, n: int = 8) -> onnx.ModelProto:
    w = np.random.default_rng(1).standard_normal((n, n)).astype(np.float32)
    nodes = [helper.make_node("Identity", ["x"], ["a"]), helper.make_node("MatMul", ["a", "w"], ["b"]),
             helper.make_node("Relu", ["b"], ["y"])]
    return make_model(nodes, [("x", TensorProto.FLOAT, ["batch", n])], [("y", TensorProto.FLOAT, ["batch", n])],
                      {"w": w}, opset=opset)


def test_optimize_never_mutates_the_callers_proto():
    model = small_model()
    before = model.SerializeToString()
    out = k3opt.optimize(model, verify=True)
    assert model.SerializeToString() == before
    assert isinstance(out, onnx.ModelProto)
    assert_equivalent(model, out)


def test_tiny_transformer_end_to_end(tiny_transformer, tmp_path):
    report = k3opt.optimize_file(tiny_transformer, tmp_path / "t.onnx", verify=True)
    assert report.verification["status"] == "passed"
    assert report.after.nodes < report.before.nodes
    out = onnx.load(tmp_path / "t.onnx")
    onnx.checker.check_model(out)
    assert_equivalent(onnx.load(tiny_transformer), out)
    # deterministic: same bytes twice; idempotent: a second pass changes nothing
    k3opt.optimize_file(tiny_transformer, tmp_path / "t2.onnx")
    assert (tmp_path / "t.onnx").read_bytes() == (tmp_path / "t2.onnx").read_bytes()
    again = k3opt.optimize_file(tmp_path / "t.onnx", tmp_path / "t3.onnx")
    assert sum(p["rewrites"] for p in again.passes) == 0
    assert (tmp_path / "t3.onnx").read_bytes() == (tmp_path / "t.onnx").read_bytes()


def test_report_json_and_default_output(tmp_path):
    onnx.save(small_model(), tmp_path / "m.onnx")
    report = k3opt.optimize_file(tmp_path / "m.onnx", verify=True)
    assert report.output == str(tmp_path / "m.k3opt.onnx")
    report.write_json(tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["before"]["nodes"] == 3 and data["verification"]["status"] == "passed"
    assert {"load", "passes", "save", "verify"} <= set(data["timings"])
    assert "nodes" in report.table()


def test_below_17_is_raised_and_17_plus_kept():
    report = Report()
    out = k3opt.optimize(small_model(13), report=report)
    assert opsets.model_opset(out) == 17 and "opset converted from 13 to 17" in report.notes
    assert_equivalent(small_model(13), out)
    assert opsets.model_opset(k3opt.optimize(small_model(18))) == 18
    assert opsets.model_opset(k3opt.optimize(small_model(17), opset=18)) == 18


def _to_the_converter(monkeypatch) -> None:
    """Send every changed node through onnx's converter: small_model's Identity and Relu cross only steps
    the converter gives them back unchanged from, which opset_nodes otherwise keeps without calling it."""
    monkeypatch.setattr(opset_nodes, "kept_as_they_are", lambda *args: False)


def test_failed_default_conversion_keeps_the_opset_and_says_so(monkeypatch):
    def refuse(model, version):
        raise RuntimeError("No Adapter For Foo")

    _to_the_converter(monkeypatch)
    monkeypatch.setattr(opsets.version_converter, "convert_version", refuse)
    report = Report()
    out = k3opt.optimize(small_model(13), report=report)
    assert opsets.model_opset(out) == 13
    assert any(n.startswith("opset kept at 13") for n in report.notes)
    with pytest.raises(UsageError, match="cannot convert opset 13 to 15"):
        k3opt.optimize(small_model(13), opset=15)


def test_passes_needing_a_newer_opset_are_skipped_with_a_note(register):
    class NeedsNew(Pass):
        name = "test-needs-18"
        min_opset = 18
        default = False

        def run(self, graph, ctx):
            raise AssertionError("must not run")

    register(NeedsNew)
    report = Report()
    k3opt.optimize(small_model(17), passes=["test-needs-18"], report=report)
    assert report.passes[0]["skipped"] == "needs opset 18, model has 17"
    assert any("test-needs-18 skipped" in n for n in report.notes)


def test_target_cann_is_exactly_17_and_lowered():
    from k3opt.pipeline.pass_base import register_pass, unregister_pass

    seen = []

    class SeeLowering(Pass):
        """A lowering pass: runs after the other passes, on the opset-17 graph; its notes are the lowering lines."""

        name, lowering, targets = "test-see-lowering", True, ("cann",)

        def run(self, graph, ctx):
            seen.append((ctx.opset, sorted({n.op for n in graph.nodes})))
            ctx.note("lowered 0 ops")
            return 0

    register_pass(SeeLowering)
    try:
        model = small_model(18)
        model.opset_import.append(helper.make_opsetid("ai.onnx", 18))
        report = Report()
        out = k3opt.optimize(model, target="cann", passes=["remove-identity", "test-see-lowering"], report=report)
    finally:
        unregister_pass("test-see-lowering")
    assert seen == [(17, sorted({n.op_type for n in out.graph.node}))]
    assert [(o.domain, o.version) for o in out.opset_import] == [("", 17)]
    assert report.lowering == ["lowered 0 ops"]
    # the cleanups of the pipeline run again after the lowering (a second run then finds nothing to do)
    assert [p["name"] for p in report.passes] == ["remove-identity", "test-see-lowering", "remove-identity"]
    gelu = make_model([helper.make_node("Gelu", ["x"], ["y"], name="g")], [("x", TensorProto.FLOAT, [2])],
                      [("y", TensorProto.FLOAT, [2])], opset=20)
    with pytest.raises(UsageError, match="op Gelu .*does not exist at opset 17"):
        k3opt.optimize(gelu, target="cann")
    with pytest.raises(UsageError, match="needs opset 17"):
        k3opt.optimize(small_model(), target="cann", opset=18)


def test_input_shapes_fix_dims_and_refuse_bad_specs():
    out = k3opt.optimize(small_model(), input_shapes={"x": [4, 8]})
    assert [d.dim_value for d in out.graph.input[0].type.tensor_type.shape.dim] == [4, 8]
    out = k3opt.optimize(small_model(), input_shapes=["x:3,8"])
    assert [d.dim_value for d in out.graph.input[0].type.tensor_type.shape.dim] == [3, 8]
    for spec, msg in [(["w:8,8"], "not a graph input"), (["x:1,2,8"], "rank 2"), (["x:4,9"], "fixed dimension 8"),
                      (["x"], "expected NAME:D1,D2"), (["x:a,b"], "integers"), (["x:0,8"], "positive")]:
        with pytest.raises(UsageError, match=msg):
            k3opt.optimize(small_model(), input_shapes=spec)


def test_bad_arguments_are_usage_errors():
    with pytest.raises(UsageError, match="unknown target 'tpu'"):
        k3opt.optimize(small_model(), target="tpu")
    with pytest.raises(UsageError, match="unknown pass 'nope'"):
        k3opt.optimize(small_model(), passes=["nope"])
    with pytest.raises(UsageError, match="not int"):
        k3opt.optimize(3)


def test_plugins_are_loaded_lazily(monkeypatch):
    import k3opt.plugins

    calls = []
    monkeypatch.setattr(k3opt.plugins, "load_plugins", lambda specs: calls.append(list(specs)))
    k3opt.optimize(small_model(), plugins=["acme_rules"])
    assert calls == [["acme_rules"]]


def test_strict_shape_inference_failure_is_a_note_and_inference_goes_on(register):
    seen = []

    class NeedsShapes(Pass):
        name = "test-needs-shapes"
        needs_shapes = True
        default = False

        def run(self, graph, ctx):
            seen.append(ctx.shapes_available)
            return 0

    register(NeedsShapes)
    # [2, 3] + [4] does not broadcast: onnx shape inference raises (nothing runs the model here).
    model = make_model([helper.make_node("Add", ["x", "s"], ["y"])], [("x", TensorProto.FLOAT, [2, 3])],
                       [("y", TensorProto.FLOAT, [2, 3])], {"s": np.zeros(4, dtype=np.float32)})
    report = Report()
    k3opt.optimize(model, passes=["test-needs-shapes"], report=report)
    assert seen == [True]  # inferred without strict mode: passes decline per node, not for the whole model
    assert any(n.startswith("strict shape inference failed") for n in report.notes)


def test_shapes_are_refreshed_for_passes_that_need_them(register):
    seen = {}

    class NeedsShapes(Pass):
        name = "test-reads-shapes"
        needs_shapes = True
        default = False

        def run(self, graph, ctx):
            seen.update({n: t.shape for n, t in graph.tensors().items() if n in ("a", "b")})
            return 0

    register(NeedsShapes)
    k3opt.optimize(small_model(), passes=["test-reads-shapes"], input_shapes={"x": [5, 8]})
    assert seen == {"a": [5, 8], "b": [5, 8]}
    assert op_counts(k3opt.optimize(small_model(), passes=[])) == op_counts(small_model())


def _break_converter(monkeypatch, op_type: str, into: str) -> None:
    """Make onnx's version converter turn every ``op_type`` node into ``into`` (a wrong conversion)."""
    real = opsets.version_converter.convert_version

    def wrong_converter(model, version):
        out = real(model, version)
        for node in out.graph.node:
            if node.op_type == op_type:
                node.op_type = into
        return out

    _to_the_converter(monkeypatch)
    monkeypatch.setattr(opsets.version_converter, "convert_version", wrong_converter)


def test_verification_compares_with_the_model_before_opset_conversion(monkeypatch):
    _break_converter(monkeypatch, "Relu", "Sigmoid")
    with pytest.raises(VerificationError, match="the opset conversion to 17 already diverges"):
        k3opt.optimize(small_model(13), verify=True)


def test_opset_conversion_keeps_external_weights_on_disk(tmp_path):
    model = small_model(13, n=16)  # a 1 KB weight: smaller ones are written inline
    onnx.save(small_model(13, n=16), tmp_path / "m.onnx", save_as_external_data=True, location="m.data",
              size_threshold=0)
    report = k3opt.optimize_file(tmp_path / "m.onnx", tmp_path / "o.onnx", verify=True)
    assert report.after.opset == 17 and report.verification["status"] == "passed"
    saved = onnx.load(tmp_path / "o.onnx", load_external_data=False)
    assert saved.graph.initializer[0].data_location == TensorProto.EXTERNAL
    assert_equivalent(model, onnx.load(tmp_path / "o.onnx"))


def _reduce_mean_18(axes_from_input: bool) -> onnx.ModelProto:
    """Opset 18 ReduceMean whose axes come from a Reshape: of constants (foldable) or of a graph input."""
    nodes = [helper.make_node("Reshape", ["axes_src", "one"], ["axes"], name="axes_reshape"),
             helper.make_node("ReduceMean", ["x", "axes"], ["y"], name="mean")]
    inputs = [("x", TensorProto.FLOAT, [2, 3, 4])]
    inits = {"one": np.array([1], dtype=np.int64)}
    if axes_from_input:
        inputs.append(("axes_src", TensorProto.INT64, [1]))
    else:
        inits["axes_src"] = np.array([-1], dtype=np.int64)
    return make_model(nodes, inputs, [("y", TensorProto.FLOAT, [2, 3, 1])], inits, opset=18)


def test_converting_down_happens_after_the_passes_fold_the_axes():
    model = _reduce_mean_18(axes_from_input=False)
    report = Report()
    out = k3opt.optimize(model, opset=17, verify=True, report=report)
    assert opsets.model_opset(out) == 17 and "opset converted from 18 to 17" in report.notes
    assert report.verification["status"] == "passed"
    onnx.checker.check_model(out)
    assert_equivalent(model, out)
    assert [(o.domain, o.version) for o in k3opt.optimize(model, target="cann").opset_import] == [("", 17)]


def test_converting_down_names_a_reduce_whose_axes_stay_computed():
    with pytest.raises(UsageError, match="cannot convert opset 18 to 17: op ReduceMean \\(node 'mean'\\): "
                                         "its 'axes' input is computed"):
        k3opt.optimize(_reduce_mean_18(axes_from_input=True), opset=17)


def test_a_wrong_down_conversion_is_blamed_on_the_conversion(monkeypatch):
    _break_converter(monkeypatch, "ReduceMean", "ReduceMax")
    with pytest.raises(VerificationError, match="the opset conversion to 17 after the passes diverges"):
        k3opt.optimize(_reduce_mean_18(axes_from_input=False), opset=17, verify=True)


def test_converting_down_keeps_nodes_already_valid_at_the_lower_opset():
    """onnx has no Split 18 -> 17 adapter, and its ReduceMean one trips on noop_with_empty_axes=0."""
    nodes = [helper.make_node("Split", ["x", "sizes"], ["a", "b"], axis=-1),
             helper.make_node("ReduceMean", ["a", "axes"], ["m"], noop_with_empty_axes=0),
             helper.make_node("Add", ["m", "b"], ["y"])]
    model = make_model(nodes, [("x", TensorProto.FLOAT, [2, 4])], [("y", TensorProto.FLOAT, [2, 2])],
                       {"sizes": np.array([2, 2], dtype=np.int64), "axes": np.array([-1], dtype=np.int64)}, opset=18)
    out = k3opt.optimize(model, opset=17, passes=[])
    assert opsets.model_opset(out) == 17 and [o.domain for o in out.opset_import] == [""]
    onnx.checker.check_model(out)
    assert_equivalent(model, out)
    def split(dims: list) -> onnx.ModelProto:
        return make_model([helper.make_node("Split", ["x"], ["a", "b"], axis=-1, num_outputs=2)],
                          [("x", TensorProto.FLOAT, dims)], [("a", TensorProto.FLOAT, [2, None]),
                                                             ("b", TensorProto.FLOAT, [2, None])], opset=18)

    assert_equivalent(split([2, 4]), k3opt.optimize(split([2, 4]), opset=17, passes=[]))  # sizes [2, 2] given
    with pytest.raises(UsageError, match="op Split"):  # num_outputs over a dynamic axis: no opset-17 form
        k3opt.optimize(split([2, "n"]), opset=17, passes=[])


def test_shapes_written_to_the_output_hold():
    """onnx gives both SequenceAt outputs of an uneven split one made-up symbol for the split axis."""
    nodes = [helper.make_node("SplitToSequence", ["x", "sizes"], ["seq"], axis=1),
             helper.make_node("SequenceAt", ["seq", "i0"], ["a"]), helper.make_node("SequenceAt", ["seq", "i1"], ["b"]),
             helper.make_node("Relu", ["a"], ["y1"]), helper.make_node("Relu", ["b"], ["y2"])]
    model = make_model(nodes, [("x", TensorProto.FLOAT, ["B", 12])],
                       [("y1", TensorProto.FLOAT, ["B", 4]), ("y2", TensorProto.FLOAT, ["B", 8])],
                       {"sizes": np.array([4, 8], np.int64), "i0": np.array(0, np.int64),
                        "i1": np.array(1, np.int64)})
    out = k3opt.optimize(model, passes=["fuse-matmul-add"])  # a pass that needs shapes
    assert_value_info_holds(out, {"x": np.ones((3, 12), np.float32)})


def test_pass_counters_reach_the_report(tmp_path):
    """fuse-rmsnorm counts an RMSNorm it leaves decomposed (opset < 23): per pass, in total, JSON and table."""
    nodes = [helper.make_node("Mul", ["x", "x"], ["sq"]), helper.make_node("ReduceMean", ["sq", "axes"], ["ms"]),
             helper.make_node("Add", ["ms", "eps"], ["mse"]), helper.make_node("Sqrt", ["mse"], ["rms"]),
             helper.make_node("Div", ["x", "rms"], ["n"]), helper.make_node("Mul", ["n", "w"], ["y"])]
    model = make_model(nodes, [("x", TensorProto.FLOAT, [2, 8])], [("y", TensorProto.FLOAT, [2, 8])],
                       {"axes": np.array([-1], np.int64), "eps": np.array(1e-6, np.float32),
                        "w": np.ones(8, np.float32)}, opset=18)
    onnx.save(model, tmp_path / "m.onnx")
    report = k3opt.optimize_file(tmp_path / "m.onnx", tmp_path / "o.onnx")
    assert report.counters == {"rmsnorm_found": 1}
    assert {p["name"]: p["counters"] for p in report.passes}["fuse-rmsnorm"] == {"rmsnorm_found": 1}
    report.write_json(tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["counters"] == {"rmsnorm_found": 1}
    assert next(p for p in data["passes"] if p["name"] == "fuse-rmsnorm")["counters"] == {"rmsnorm_found": 1}
    table = report.table().splitlines()
    assert table[table.index(next(l for l in table if l.startswith("fuse-rmsnorm"))) + 1].split() == \
        ["rmsnorm_found", "1"]


def _sibling_projections_on_disk(folder) -> tuple[onnx.ModelProto, str]:
    """x @ Wq, x @ Wk, x @ Wv (mergeable siblings) with the weights in external data."""
    rng = np.random.default_rng(2)
    ws = {f"w{i}": rng.standard_normal((64, n)).astype(np.float32) for i, n in enumerate((64, 32, 32))}
    nodes = [helper.make_node("MatMul", ["x", name], [f"y{i}"]) for i, name in enumerate(ws)]
    model = make_model(nodes, [("x", TensorProto.FLOAT, [2, 64])],
                       [(f"y{i}", TensorProto.FLOAT, [2, w.shape[1]]) for i, w in enumerate(ws.values())], ws)
    path = str(folder / "m.onnx")
    onnx.save(onnx.ModelProto.FromString(model.SerializeToString()), path, save_as_external_data=True,
              location="m.onnx.data", size_threshold=0)
    return model, path


def test_optimize_returns_merged_weights_written_and_optimize_file_leaves_nothing_deferred(tmp_path):
    from k3opt import modelio

    model, path = _sibling_projections_on_disk(tmp_path)
    before = modelio.deferred_regions()
    out = k3opt.optimize(path)
    assert op_counts(out)["MatMul"] == 1 and modelio.deferred_regions() == before  # spilled before returning
    assert_equivalent(model, onnx.load_from_string(runnable_bytes(out)))
    k3opt.optimize_file(path, tmp_path / "o.onnx")
    assert modelio.deferred_regions() == before
    assert_equivalent(model, onnx.load(tmp_path / "o.onnx"))


def test_optimize_restores_the_callers_gc_thresholds(monkeypatch):
    """The run collects garbage less often (k3opt.graph.lifetime.graph_scope) but leaves the caller's settings."""
    old = gc.get_threshold()
    try:
        gc.set_threshold(123, 7, 9)
        seen = []
        real = k3opt.api.modelio.import_graph

        def spy(model, *args):
            seen.append(gc.get_threshold())
            return real(model, *args)

        monkeypatch.setattr(k3opt.api.modelio, "import_graph", spy)
        k3opt.optimize(small_model())
        assert seen == [(k3opt.graph.lifetime.GC_YOUNG_THRESHOLD, 7, 9)]
        assert gc.get_threshold() == (123, 7, 9)
    finally:
        gc.set_threshold(*old)


def test_overlapping_runs_in_threads_leave_the_callers_gc_thresholds():
    """gc's thresholds are the process's: runs in threads whose scopes overlap (the first to start ends first)
    leave the caller's settings, not one run's raised value."""
    import threading

    from k3opt.graph.lifetime import graph_scope

    old = gc.get_threshold()
    opened, first_left = threading.Barrier(2, timeout=30), threading.Event()

    def scope(first: bool) -> None:
        with graph_scope():
            opened.wait()
            if not first:
                first_left.wait(30)
        if first:
            first_left.set()

    try:
        gc.set_threshold(123, 7, 9)
        threads = [threading.Thread(target=scope, args=(first,)) for first in (True, False)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert gc.get_threshold() == (123, 7, 9)
    finally:
        gc.set_threshold(*old)


@pytest.mark.parametrize("model", ["small", "tiny_transformer"])
def test_the_runs_graph_is_freed_without_the_cycle_collector(monkeypatch, request, model):
    """graph_scope breaks the gs cycles of the run's graph: with the collector off, every imported node and
    tensor is gone when optimize returns (fused ones included), not left for a full collection at exit."""
    refs = []
    real = k3opt.api.modelio.import_graph

    def spy(proto, *args):
        graph = real(proto, *args)
        refs.extend(weakref.ref(x) for x in [*graph.nodes, *graph.tensors().values()])
        return graph

    monkeypatch.setattr(k3opt.api.modelio, "import_graph", spy)
    proto = small_model() if model == "small" else onnx.load(request.getfixturevalue("tiny_transformer"))
    gc.collect()
    gc.disable()
    try:
        k3opt.optimize(proto)
        alive = [r() for r in refs if r() is not None]
    finally:
        gc.enable()
    assert len(refs) > 5 and alive == []


@pytest.mark.parametrize("model_opset, output_opset, kept, fused", [
    (23, 18, "RMSNormalization", "LayerNormalization"),  # RMSNormalization is opset 23: left decomposed
    (18, 16, "LayerNormalization", None),  # LayerNormalization is opset 17: left decomposed too
])
def test_converting_down_fuses_only_into_ops_the_output_opset_has(model_opset, output_opset, kept, fused):
    from tests.test_layer_norm import H, Net, layer_norm
    from tests.test_rms_norm import rms

    net = Net(model_opset)
    model = net.model(rms(net, layer_norm(net, "x")), [("x", TensorProto.FLOAT, [2, 3, H])])
    report = Report()
    out = k3opt.optimize(model, opset=output_opset, verify=True, report=report)
    assert opsets.model_opset(out) == output_opset and report.verification["status"] == "passed"
    ops = op_counts(out)
    assert kept not in ops and (fused is None or ops[fused] == 1)
    onnx.checker.check_model(out, full_check=True)
    assert_equivalent(model, out)


def test_concurrent_optimize_file_calls_keep_their_deferred_weights_apart(tmp_path, monkeypatch):
    """Two runs in threads, both holding deferred merged weights when the first saves and forgets its own:
    the second's are still written (a run forgetting every region registered meanwhile zeroed them)."""
    import threading

    from k3opt import modelio
    from k3opt.pipeline.run import Run

    folders = [tmp_path / "a", tmp_path / "b"]
    models = []
    for folder in folders:
        folder.mkdir()
        models.append(_sibling_projections_on_disk(folder))
    both_optimized, first_done = threading.Barrier(2, timeout=60), threading.Event()
    write = Run.write

    def write_in_turn(run, *args, **kwargs):
        both_optimized.wait()  # both runs' merged weights are deferred now
        if threading.current_thread().name == "second":
            first_done.wait(60)
        return write(run, *args, **kwargs)

    monkeypatch.setattr(Run, "write", write_in_turn)
    errors: list[BaseException] = []

    def optimize(i: int) -> None:
        try:
            k3opt.optimize_file(models[i][1], folders[i] / "o.onnx")
            assert modelio.deferred_regions() == set()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
        finally:
            if i == 0:
                first_done.set()

    threads = [threading.Thread(target=optimize, args=(i,), name=name) for i, name in enumerate(("first", "second"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for (model, _), folder in zip(models, folders):
        out = onnx.load(folder / "o.onnx")
        assert op_counts(out)["MatMul"] == 1
        assert_equivalent(model, out)
