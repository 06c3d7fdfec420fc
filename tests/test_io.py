"""Graph I/O: external data (lazy, streamed, named after the output), atomic saves, refusals."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.external_data_helper import uses_external_data

import k3opt
from k3opt import modelio
from k3opt.errors import InputError, OutputError
from k3opt.pipeline.shapes import ShapeRefresher
from tests.helpers import assert_equivalent, make_model, random_feeds, run_ort


def weighted_model(n: int = 64, extra_identity: bool = True) -> onnx.ModelProto:
    """x[2,n] @ w[n,n] + b -> Identity -> y, weights big enough to go external."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"], name="mm"),
             helper.make_node("Add", ["mm", "b"], ["add"], name="add"),
             helper.make_node("Identity" if extra_identity else "Relu", ["add"], ["y"], name="out")]
    return make_model(nodes, [("x", TensorProto.FLOAT, [2, n])], [("y", TensorProto.FLOAT, [2, n])],
                      {"w": rng.standard_normal((n, n)).astype(np.float32),
                       "b": rng.standard_normal(n).astype(np.float32)})


def save_external(model: onnx.ModelProto, path: Path, data_name: str = "weights.bin") -> None:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    onnx.save(copy, path, save_as_external_data=True, all_tensors_to_one_file=True, location=data_name,
              size_threshold=0)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_load_keeps_external_data_on_disk_with_absolute_locations(tmp_path):
    save_external(weighted_model(), tmp_path / "m.onnx")
    model = modelio.load(tmp_path / "m.onnx")
    externals = [t for t in model.graph.initializer if uses_external_data(t)]
    assert len(externals) == 2
    for t in externals:
        assert not t.HasField("raw_data")
        assert modelio.external_info(t)["location"] == str(tmp_path / "weights.bin")
    graph = modelio.import_graph(model)
    w = graph.tensors()["w"]
    assert isinstance(w._values, modelio.ExternalValues)
    np.testing.assert_array_equal(w.values, onnx.numpy_helper.to_array(weighted_model().graph.initializer[0]))


@pytest.mark.parametrize("skip", [(), ("fold-constants",)], ids=["folded", "kept"])
@pytest.mark.parametrize("external_data", [True, False])
def test_a_constant_nodes_external_value_is_read_from_its_file(tmp_path, skip, external_data):
    """A Constant node may keep its value outside the proto (onnx.save's convert_attribute): the import reads it
    through k3opt's own reader like an initializer's (onnx's refuses the absolute locations k3opt keeps), for
    the passes that look at it and for the save, whether fold-constants lifts it or leaves the node."""
    rng = np.random.default_rng(0)
    w, c = (rng.standard_normal((4, 256)).astype(np.float32) for _ in range(2))
    nodes = [helper.make_node("Constant", [], ["c"], value=onnx.numpy_helper.from_array(c)),
             helper.make_node("Add", ["x", "w"], ["b"]), helper.make_node("Add", ["b", "c"], ["y"])]
    src = tmp_path / "model.onnx"
    onnx.save(make_model(nodes, [("x", TensorProto.FLOAT, [4, 256])], [("y", TensorProto.FLOAT, [4, 256])],
                         {"w": w}), str(src), save_as_external_data=True, location="model.bin", size_threshold=1024,
              convert_attribute=True)
    constant = [n for n in onnx.load(str(src), load_external_data=False).graph.node if n.op_type == "Constant"]
    assert uses_external_data(constant[0].attribute[0].t)
    out = tmp_path / "out.onnx"
    k3opt.optimize_file(src, out, skip=skip, external_data=external_data)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    np.testing.assert_allclose(run_ort(onnx.load(str(out)), {"x": x})[0], x + w + c, rtol=1e-6)
    assert ("Constant" in [n.op_type for n in onnx.load(str(out), load_external_data=False).graph.node]) == bool(skip)


def test_external_round_trip_streams_into_data_file_named_after_output(tmp_path):
    src, out_dir = tmp_path / "src", tmp_path / "out"
    src.mkdir(), out_dir.mkdir()
    original = weighted_model()
    save_external(original, src / "m.onnx")
    before = {p.name: digest(p) for p in src.iterdir()}
    report = k3opt.optimize_file(src / "m.onnx", out_dir / "opt.onnx", verify=True)
    assert sorted(p.name for p in out_dir.iterdir()) == ["opt.onnx", "opt.onnx.data"]
    assert report.files == [str(out_dir / "opt.onnx"), str(out_dir / "opt.onnx.data")]
    assert {p.name: digest(p) for p in src.iterdir()} == before  # input and its data untouched
    saved = onnx.load(out_dir / "opt.onnx", load_external_data=False)
    locations = {modelio.external_info(t)["location"] for t in saved.graph.initializer if uses_external_data(t)}
    assert locations == {"opt.onnx.data"}
    assert_equivalent(original, onnx.load(out_dir / "opt.onnx"))


def test_inline_model_stays_inline_unless_asked(tmp_path):
    onnx.save(weighted_model(), tmp_path / "m.onnx")
    k3opt.optimize_file(tmp_path / "m.onnx", tmp_path / "a.onnx")
    assert not (tmp_path / "a.onnx.data").exists()
    k3opt.optimize_file(tmp_path / "m.onnx", tmp_path / "b.onnx", external_data=True)
    saved = onnx.load(tmp_path / "b.onnx", load_external_data=False)
    big = {t.name for t in saved.graph.initializer if uses_external_data(t)}
    assert big == {"w"}  # b (256 bytes) stays under the 1 KB threshold
    assert_equivalent(weighted_model(), onnx.load(tmp_path / "b.onnx"))


def test_external_input_can_be_inlined_on_request(tmp_path):
    save_external(weighted_model(), tmp_path / "m.onnx")
    k3opt.optimize_file(tmp_path / "m.onnx", tmp_path / "o.onnx", external_data=False)
    saved = onnx.load(tmp_path / "o.onnx", load_external_data=False)
    assert not any(uses_external_data(t) for t in saved.graph.initializer)
    assert_equivalent(weighted_model(), saved)


def test_overwrite_in_place_with_external_data(tmp_path):
    save_external(weighted_model(), tmp_path / "m.onnx", data_name="m.onnx.data")
    with pytest.raises(OutputError, match="output is the input"):
        k3opt.optimize_file(tmp_path / "m.onnx", tmp_path / "m.onnx")
    k3opt.optimize_file(tmp_path / "m.onnx", tmp_path / "m.onnx", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data"]
    assert_equivalent(weighted_model(), onnx.load(tmp_path / "m.onnx"))


class Boom(BaseException):
    pass


@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()])
def test_failed_save_leaves_nothing_behind(tmp_path, monkeypatch, error):
    save_external(weighted_model(), tmp_path / "m.onnx")
    before = sorted(p.name for p in tmp_path.iterdir())
    model = modelio.load(tmp_path / "m.onnx")

    def fail(*args):
        raise error

    monkeypatch.setattr(modelio.saving.os, "replace", fail)
    with pytest.raises((OutputError, KeyboardInterrupt)):
        modelio.save(model, tmp_path / "out.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def _fsynced(monkeypatch) -> list[str]:
    """Record what os.fsync is called on for the rest of the test: "folder", or the file a temporary file becomes
    (written under its final name in a temporary folder)."""
    calls: list[str] = []
    real = modelio.saving.os.fsync

    def spy(fd):
        target = os.readlink(f"/proc/self/fd/{fd}")
        calls.append("folder" if os.path.isdir(target) else Path(target).name)
        real(fd)

    monkeypatch.setattr(modelio.saving.os, "fsync", spy)
    return calls


@pytest.mark.parametrize("external", [False, True])
def test_save_syncs_only_when_asked(tmp_path, monkeypatch, external):
    calls = _fsynced(monkeypatch)
    modelio.save(weighted_model(), tmp_path / "a.onnx", external_data=external)
    assert calls == []
    written = modelio.save(weighted_model(), tmp_path / "b.onnx", external_data=external, fsync=True)
    # each temporary file before its rename, then the folder holding the renames
    assert calls == ["b.onnx.data"] * external + ["b.onnx", "folder"]
    assert [p.name for p in written] == ["b.onnx", "b.onnx.data"][: 1 + external]
    assert_equivalent(weighted_model(), onnx.load(tmp_path / "b.onnx"))


def test_output_location_refusals(tmp_path):
    onnx.save(weighted_model(), tmp_path / "m.onnx")
    with pytest.raises(OutputError, match="does not exist"):
        modelio.check_output_path(tmp_path / "nope" / "o.onnx")
    with pytest.raises(OutputError, match="is a directory"):
        modelio.check_output_path(tmp_path)
    os.symlink(tmp_path / "m.onnx", tmp_path / "link.onnx")
    with pytest.raises(OutputError, match="output is the input"):
        modelio.check_output_path(tmp_path / "link.onnx", tmp_path / "m.onnx")


@pytest.mark.parametrize("location", ["../outside.bin", "/etc/hostname"])
def test_external_locations_must_stay_in_the_model_folder(tmp_path, location):
    save_external(weighted_model(), tmp_path / "m.onnx")
    model = onnx.load(tmp_path / "m.onnx", load_external_data=False)
    for t in model.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = location
    onnx.save(model, tmp_path / "bad.onnx")
    with pytest.raises(InputError, match="outside the model folder|absolute external-data path"):
        modelio.load(tmp_path / "bad.onnx")


def test_short_external_file_is_an_input_error(tmp_path):
    save_external(weighted_model(), tmp_path / "m.onnx")
    data = tmp_path / "weights.bin"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(InputError, match="too short"):
        modelio.load(tmp_path / "m.onnx")


def test_spill_constant_is_lazy_and_saved_into_the_output(tmp_path):
    import onnx_graphsurgeon as gs

    values = np.arange(600, dtype=np.float32).reshape(20, 30)
    const = modelio.spill_constant("spilled", values)
    assert Path(modelio.external_info(const._values.tensor)["location"]).name.startswith(modelio.SPILL_PREFIX)
    np.testing.assert_array_equal(const.values, values)
    x = gs.Variable("x", np.float32, [2, 20])
    y = gs.Variable("y", np.float32, [2, 30])
    graph = gs.Graph(nodes=[gs.Node("MatMul", inputs=[x, const], outputs=[y])], inputs=[x], outputs=[y], opset=17)
    model = gs.export_onnx(graph)
    modelio.validate(model, tmp_path)  # an absolute spill location is accepted
    modelio.save(model, tmp_path / "s.onnx")
    saved = onnx.load(tmp_path / "s.onnx")
    feeds = random_feeds(saved)
    np.testing.assert_allclose(run_ort(saved, feeds)[0], feeds["x"] @ values, rtol=1e-5)


def test_save_refuses_inline_over_the_proto_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(modelio.saving, "PROTO_LIMIT", 1000)
    model = weighted_model()
    with pytest.raises(OutputError, match="external data"):
        modelio.save(model, tmp_path / "o.onnx", external_data=False)
    modelio.save(model, tmp_path / "o.onnx")  # automatic: over the limit -> external
    assert (tmp_path / "o.onnx.data").exists()


# The peak is this process's VmHWM: ru_maxrss would carry over the forking pytest worker's own peak across exec
# (Linux), failing the test whenever it runs after a memory-hungry one in the same worker.
_BIG_SCRIPT = r"""
import sys
import k3opt
report = k3opt.optimize_file(sys.argv[1], sys.argv[2], verify=True)
print(next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM")) // 1024)
print(report.verification["status"])
"""


@pytest.mark.slow
def test_over_2gb_model_is_optimized_without_loading_its_weights(tmp_path):
    """Three 800 MB weights in a sparse external file: load, optimize, skip verification, save in little memory."""
    n = 200 * 2**20  # float32 elements per weight (800 MB)
    data = tmp_path / "big.onnx.data"
    with open(data, "wb") as f:
        f.truncate(3 * 4 * n)  # sparse zeros: cheap to create
    inits = []
    for i in range(3):
        inits.append(modelio.external_tensor(f"w{i}", TensorProto.FLOAT, [n], data.name, i * 4 * n, 4 * n))
    # Embedding-style lookups: no pass needs the weights' values.
    nodes = [helper.make_node("Identity", ["ids"], ["ids1"])]
    nodes += [helper.make_node("Gather", [f"w{i}", "ids1"], [f"g{i}"]) for i in range(3)]
    nodes += [helper.make_node("Add", ["g0", "g1"], ["a"]), helper.make_node("Add", ["a", "g2"], ["y"])]
    graph = helper.make_graph(nodes, "big", [helper.make_tensor_value_info("ids", TensorProto.INT64, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, tmp_path / "big.onnx")
    out = tmp_path / "out" / "big.k3opt.onnx"
    out.parent.mkdir()
    proc = subprocess.run([sys.executable, "-c", _BIG_SCRIPT, str(tmp_path / "big.onnx"), str(out)],
                          capture_output=True, text=True, check=True)
    peak_mb, status = proc.stdout.split()
    assert status == "skipped"
    assert int(peak_mb) < 1000, f"peak RSS {peak_mb} MB: weights were loaded"
    assert (out.parent / "big.k3opt.onnx.data").stat().st_size >= 3 * 4 * n
    saved = onnx.load(out, load_external_data=False)
    assert [modelio.external_info(t)["location"] for t in saved.graph.initializer] == ["big.k3opt.onnx.data"] * 3


def test_shape_refresh_reads_no_weights(tmp_path, monkeypatch):
    save_external(weighted_model(), tmp_path / "m.onnx")
    graph = modelio.import_graph(modelio.load(tmp_path / "m.onnx"))

    def refuse(self):
        raise AssertionError("weights were read")

    monkeypatch.setattr(modelio.ExternalValues, "load", refuse)
    assert ShapeRefresher()(graph) is True
    assert graph.tensors()["mm"].shape == [2, 64]
    assert isinstance(graph.tensors()["w"]._values, modelio.ExternalValues)


def test_output_never_clobbers_the_inputs_data_file(tmp_path):
    save_external(weighted_model(), tmp_path / "a.onnx", data_name="b.onnx.data")
    before = digest(tmp_path / "b.onnx.data")
    with pytest.raises(OutputError, match="external-data file of the input"):
        k3opt.optimize_file(tmp_path / "a.onnx", tmp_path / "b.onnx")
    assert digest(tmp_path / "b.onnx.data") == before
    assert not (tmp_path / "b.onnx").exists()


def test_all_external_model_optimizes_like_the_inline_one(tiny_transformer, tmp_path):
    """Even shape constants in the data file: inference still sees them, the result is the same graph."""
    save_external(onnx.load(tiny_transformer), tmp_path / "t.onnx", data_name="t.onnx.data")
    ext = k3opt.optimize_file(tmp_path / "t.onnx", tmp_path / "o.onnx", verify=True)
    inline = k3opt.optimize_file(tiny_transformer, tmp_path / "i.onnx")
    assert not [n for n in ext.notes if "shape inference failed" in n]
    assert ext.after.ops == inline.after.ops
    assert ext.verification["status"] == "passed"


def test_outputs_get_ordinary_file_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        onnx.save(weighted_model(), tmp_path / "m.onnx")
        k3opt.optimize_file(tmp_path / "m.onnx", tmp_path / "o.onnx", external_data=True)
    finally:
        os.umask(old)
    assert (tmp_path / "o.onnx").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "o.onnx.data").stat().st_mode & 0o777 == 0o644


def test_spill_file_is_removed_when_the_process_exits():
    script = ("import numpy as np; from k3opt import modelio; "
              "c = modelio.spill_constant('w', np.ones(4096, np.float32)); "
              "print(modelio.external_info(c._values.tensor)['location'])")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    spill = Path(proc.stdout.strip())
    assert spill.name.startswith(modelio.SPILL_PREFIX) and not spill.exists()


def test_nodes_out_of_order_load_and_a_cycle_behind_an_ordered_prefix_is_found():
    """The order check is a fast path only: an unsorted acyclic graph still loads, a late cycle still fails."""
    unsorted = helper.make_graph([helper.make_node("Relu", ["a"], ["y"], name="late"),
                                  helper.make_node("Neg", ["x"], ["a"], name="early")], "g",
                                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    modelio.check_graph(unsorted)
    cyclic = helper.make_graph([helper.make_node("Neg", ["x"], ["a"], name="ok"),
                                helper.make_node("Add", ["a", "c"], ["b"], name="n1"),
                                helper.make_node("Relu", ["b"], ["c"], name="n2")], "g",
                               [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                               [helper.make_tensor_value_info("c", TensorProto.FLOAT, [2])])
    with pytest.raises(InputError, match="has a cycle"):
        modelio.check_graph(cyclic)


def test_report_size_before_is_the_file_size(tmp_path):
    onnx.save(weighted_model(), tmp_path / "m.onnx")
    report = k3opt.optimize_file(tmp_path / "m.onnx", tmp_path / "o.onnx")
    assert report.before.size_bytes == (tmp_path / "m.onnx").stat().st_size
    assert report.after.size_bytes == (tmp_path / "o.onnx").stat().st_size


def _deferred_concat(tmp_path):
    """A ConcatValues over two external weights, exported (its spill region reserved, not written)."""
    from k3opt.modelio.concat_values import ConcatValues

    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((40, 24)).astype(np.float32), rng.standard_normal((40, 8)).astype(np.float32)
    with open(tmp_path / "src.data", "wb") as f:
        f.write(a.tobytes())
        f.write(b.tobytes())
    sources = [modelio.ExternalValues(modelio.external_tensor(n, TensorProto.FLOAT, arr.shape, str(tmp_path / "src.data"),
                                                    off, arr.nbytes))
               for n, arr, off in (("a", a, 0), ("b", b, a.nbytes))]
    merged = ConcatValues(sources)
    proto = onnx.TensorProto()
    proto.CopyFrom(merged.tensor)
    proto.name = "w"
    return proto, np.concatenate([a, b], axis=1)


def test_merged_weight_is_written_straight_into_the_output_not_the_spill_file(tmp_path, monkeypatch):
    import k3opt.modelio.concat_values as concat_values

    monkeypatch.setattr(concat_values, "_BLOCK", 24 * 4 * 7)  # several row blocks, the last one short
    proto, expected = _deferred_concat(tmp_path)
    location, offset, _ = modelio.external.external_span(proto)
    assert (location, offset) in modelio.deferred_regions()
    model = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [helper.make_tensor_value_info("x", 1, [2, 40])],
        [helper.make_tensor_value_info("y", 1, [2, 32])], [proto]), opset_imports=[helper.make_opsetid("", 17)])
    modelio.save(model, tmp_path / "o.onnx")
    with open(location, "rb") as f:  # the spill region is still a hole: nothing was written there
        f.seek(offset)
        assert not any(f.read(expected.nbytes))
    saved = onnx.load(tmp_path / "o.onnx")
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(saved.graph.initializer[0]), expected)


def test_reading_a_deferred_region_writes_it_into_the_spill_file_first(tmp_path):
    proto, expected = _deferred_concat(tmp_path)
    location, offset, _ = modelio.external.external_span(proto)
    got = np.frombuffer(modelio.read_external_bytes(proto), np.float32).reshape(expected.shape)
    np.testing.assert_array_equal(got, expected)
    assert (location, offset) not in modelio.deferred_regions()
    np.testing.assert_array_equal(modelio.ExternalValues(proto).load(), expected)


def test_read_external_bytes_reads_a_slice(tmp_path):
    proto, expected = _deferred_concat(tmp_path)
    flat = expected.tobytes()
    assert modelio.read_external_bytes(proto, 100, 40) == flat[100:140]


def test_save_copies_external_bytes_without_copy_file_range(tmp_path, monkeypatch):
    monkeypatch.delattr(os, "copy_file_range")  # the plain chunked copy is the fallback
    model = weighted_model()
    save_external(model, tmp_path / "m.onnx")
    modelio.save(modelio.load(tmp_path / "m.onnx"), tmp_path / "o.onnx")
    assert_equivalent(model, onnx.load(tmp_path / "o.onnx"))


def _random_graph(rng: np.random.Generator, depth: int = 0) -> onnx.GraphProto:
    """A small graph that may be unsorted, read an undefined name, define a name twice, hold If bodies
    reading outer names, and keep external-data tensors in initializers and attributes."""
    def tensor(name: str, external: bool) -> TensorProto:
        t = helper.make_tensor(name, TensorProto.FLOAT, [1], [1.0])
        if external:
            t.data_location = TensorProto.EXTERNAL
        return t

    names = ["x", "w"]
    nodes = []
    for i in range(int(rng.integers(3, 9))):
        inputs = [str(rng.choice(names)) for _ in range(int(rng.integers(1, 3)))]
        if rng.random() < 0.05:
            inputs.append("ghost")
        if rng.random() < 0.1:
            inputs.append("")
        out = str(rng.choice(names)) if rng.random() < 0.05 else f"d{depth}_{i}"
        roll = rng.random()
        if roll < 0.2 and depth < 2:
            body = _random_graph(rng, depth + 1)
            nodes.append(helper.make_node("If", inputs[:1], [out], then_branch=body, else_branch=body, name=out))
        elif roll < 0.4:
            nodes.append(helper.make_node("Constant", [], [out], value=tensor(f"k{out}", rng.random() < 0.5)))
        else:
            nodes.append(helper.make_node("Add", inputs, [out], name=out))
        names.append(out)
    if rng.random() < 0.3:
        rng.shuffle(nodes)
    if rng.random() < 0.05:  # a cycle
        nodes.append(helper.make_node("Neg", [names[-1]], ["x2"], name="back"))
        nodes[0].input.append("x2")
    outputs = [str(rng.choice(names[2:] or names))] + (["ghost_out"] if rng.random() < 0.05 else [])
    return helper.make_graph(nodes, f"g{depth}", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                             [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]) for n in outputs],
                             [tensor("w", rng.random() < 0.5)])


def _checked(graph: onnx.GraphProto):
    found = modelio.validation.Validated()
    try:
        modelio.validation._check_graph(graph, "m", frozenset(), found)
    except InputError as exc:
        return "error", str(exc)
    return "ok", [t.SerializeToString() for t in found.external], found.bodies


def test_ordered_walk_checks_exactly_like_the_general_check(monkeypatch):
    """The one-walk fast path finds the same first error (or none) and the same external tensors, in
    all_tensors order, as the general check that handles any node order."""
    outcomes = set()
    for seed in range(300):
        graph = _random_graph(np.random.default_rng(seed))
        fast = _checked(graph)
        with monkeypatch.context() as m:
            m.setattr(modelio.validation, "_walk_in_order", lambda graph, known: None)
            general = _checked(graph)
        assert fast == general, seed
        if fast[0] == "ok":
            model = helper.make_model(graph)
            assert fast[1] == [t.SerializeToString() for t in modelio.all_tensors(model) if uses_external_data(t)]
            in_order = modelio.validation._walk_in_order(graph, {"x", "w"}) is not None
            outcomes.add("ok, in order" if in_order else "ok, unsorted")
        else:
            outcomes.add(next(kind for kind in ("defined twice", "input '", "graph output", "cycle")
                              if kind in fast[1]))
    assert len(outcomes) == 6, outcomes  # the seeds reach both paths and every kind of error


def test_read_model_returns_the_external_tensors_validate_resolved(tmp_path):
    save_external(weighted_model(), tmp_path / "m.onnx")
    loaded = modelio.read_model(tmp_path / "m.onnx")
    assert [t.name for t in loaded.external] == ["w", "b"]
    assert all(modelio.external_info(t)["location"] == str(tmp_path / "weights.bin") for t in loaded.external)
    assert modelio.proto_size(loaded.model, 5, loaded.external) == modelio.proto_size(loaded.model, 5)


@pytest.mark.parametrize("name, fmt", [("m.onnx", None), ("m.bin", None), ("m.textproto", "textproto")])
def test_read_model_parses_the_file_as_onnx_load_does(tmp_path, name, fmt):
    """Binary models are parsed from the mapped file, text formats by onnx: the same proto either way."""
    onnx.save(weighted_model(), tmp_path / name, format=fmt)
    assert modelio.read_model(tmp_path / name).model == onnx.load(tmp_path / name, load_external_data=False)


def test_read_model_of_an_unmappable_file_reads_it(tmp_path, monkeypatch):
    onnx.save(weighted_model(), tmp_path / "m.onnx")

    def refuse(*args, **kwargs):
        raise OSError("no mmap here")

    monkeypatch.setattr(modelio.loading.mmap, "mmap", refuse)
    assert modelio.read_model(tmp_path / "m.onnx").model == onnx.load(tmp_path / "m.onnx")


def test_trailing_bytes_after_a_model_are_not_a_model(tmp_path):
    data = weighted_model().SerializeToString()
    (tmp_path / "m.onnx").write_bytes(data + b"\x00" * 8)  # a zero tag: protobuf stops or refuses, as in onnx.load
    with pytest.raises(InputError, match="not a readable ONNX model"):
        modelio.read_model(tmp_path / "m.onnx")


def test_import_graph_told_of_no_external_tensors_skips_the_search_only(tmp_path):
    save_external(weighted_model(), tmp_path / "m.onnx")
    loaded = modelio.read_model(tmp_path / "m.onnx")
    for external in (loaded.external, None):
        assert type(modelio.import_graph(loaded.model, external).nodes[0].inputs[1]._values) is modelio.ExternalValues
    inline = weighted_model()
    told, searched = modelio.import_graph(inline, []), modelio.import_graph(inline)
    assert modelio.export_graph(told, inline) == modelio.export_graph(searched, inline)
