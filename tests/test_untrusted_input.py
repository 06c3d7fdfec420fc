"""A model from an untrusted place: external data only from regular files inside its folder, sizes within
the bytes present, bounded nesting. Each refusal is exit 2, one line, nothing written, and no byte of a file
outside the folder in any output."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import k3opt
from k3opt import modelio
from k3opt.errors import InputError
from tests.helpers import run_ort
from tests.test_bad_input import assert_one_line_error, invoke, snapshot

SECRET = b"SECRET-" * 40  # 280 bytes: as many as the weight's 70 floats


def model_with_weight(sub: bool = False) -> onnx.ModelProto:
    """y = x + w (w: 70 floats); with ``sub`` the Add and ``w`` are in the then-branch of an If."""
    w = numpy_helper.from_array(np.arange(70, dtype=np.float32), "w")
    vi = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [70])]
    out = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [70])]
    if not sub:
        graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g", vi, out, [w])
    else:
        then = helper.make_graph([helper.make_node("Add", ["x", "w"], ["t"])], "then", [],
                                 [helper.make_tensor_value_info("t", TensorProto.FLOAT, [70])], [w])
        other = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [],
                                  [helper.make_tensor_value_info("e", TensorProto.FLOAT, [70])])
        cond = helper.make_tensor_value_info("c", TensorProto.BOOL, [])
        graph = helper.make_graph([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
                                  "g", vi + [cond], out)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def external_weight(model: onnx.ModelProto) -> TensorProto:
    return next(t for t in modelio.all_tensors(model) if t.name == "w")


def save_with_external(folder: Path, sub: bool = False, location: str = "w.bin",
                       entries: dict[str, str] | None = None) -> Path:
    """The model in ``folder/m.onnx`` with ``w`` as external data at ``location`` (the file itself is
    written by the caller); ``entries`` replace external-data entries (offset, length)."""
    model = model_with_weight(sub)
    t = external_weight(model)
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    for key, value in {"location": location, "offset": "0", "length": "280", **(entries or {})}.items():
        t.external_data.add(key=key, value=value)
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, folder / "m.onnx")
    return folder / "m.onnx"


def secret_file(tmp_path: Path) -> Path:
    secret = tmp_path / "elsewhere" / "secret.txt"
    secret.parent.mkdir()
    secret.write_bytes(SECRET)
    return secret


def assert_refused(tmp_path: Path, model: Path, fragment: str) -> None:
    """``k3opt optimize`` refuses ``model`` (exit 2, one line naming ``fragment``) and writes nothing."""
    before = snapshot(tmp_path)
    code, out, err = invoke(["optimize", str(model), "-o", str(model.parent / "out.onnx"), "-q"])
    assert_one_line_error(code, out, err, 2, fragment)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("sub", [False, True], ids=["graph", "subgraph"])
def test_symlink_to_a_secret_is_refused(tmp_path, sub):
    folder = tmp_path / "model"
    model = save_with_external(folder, sub)
    os.symlink(secret_file(tmp_path), folder / "w.bin")
    assert_refused(tmp_path, model, "external data of tensor 'w' is a symbolic link (w.bin)")


def test_linked_parent_folder_is_refused(tmp_path):
    folder = tmp_path / "model"
    model = save_with_external(folder, location="weights/w.bin")
    secret = secret_file(tmp_path)
    os.rename(secret, secret.parent / "w.bin")
    os.symlink(secret.parent, folder / "weights")
    assert_refused(tmp_path, model, "external data of tensor 'w' lies in a symbolic link (weights)")


def test_symlink_to_a_device_is_refused(tmp_path):
    folder = tmp_path / "model"
    model = save_with_external(folder)
    os.symlink("/dev/zero", folder / "w.bin")
    assert_refused(tmp_path, model, "is a symbolic link")


def test_a_device_itself_is_refused():
    """The model's folder is /dev (a device needs no link to be refused); an in-memory model, read relative
    to the folder it names."""
    model = model_with_weight()
    t = external_weight(model)
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    t.external_data.add(key="location", value="zero")
    with pytest.raises(InputError, match=r"external data of tensor 'w' is a character device \(zero\)"):
        modelio.validate(model, "/dev")


def test_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    folder = tmp_path / "model"
    model = save_with_external(folder)
    os.mkfifo(folder / "w.bin")
    assert_refused(tmp_path, model, "external data of tensor 'w' is a FIFO (w.bin)")


def test_hard_link_is_refused(tmp_path):
    folder = tmp_path / "model"
    model = save_with_external(folder)
    os.link(secret_file(tmp_path), folder / "w.bin")
    assert_refused(tmp_path, model, "has 2 hard links (w.bin)")


def test_directory_is_refused(tmp_path):
    folder = tmp_path / "model"
    model = save_with_external(folder)
    (folder / "w.bin").mkdir()
    assert_refused(tmp_path, model, "is a directory (w.bin)")


def test_absolute_spill_name_in_a_file_is_refused(tmp_path):
    """k3opt's own spill files may be named absolutely in a proto built in this process, never in a file."""
    spill = Path(tempfile.gettempdir()) / f"{modelio.SPILL_PREFIX}planted.data"
    model = save_with_external(tmp_path / "model", location=str(spill))
    try:
        spill.write_bytes(SECRET)
        assert_refused(tmp_path, model, "absolute external-data path")
    finally:
        spill.unlink(missing_ok=True)


@pytest.mark.parametrize("entries, fragment", [
    ({"length": "4000"}, "has 4000 bytes of external data, but its type and shape [70] take 280"),
    ({"offset": "-8"}, "negative external-data offset/length"),
    ({"offset": "8"}, "is too short for tensor 'w'"),
    ({"offset": "zero"}, "malformed external-data offset/length"),
])
def test_external_span_must_match_dims_and_lie_in_the_file(tmp_path, entries, fragment):
    folder = tmp_path / "model"
    model = save_with_external(folder, entries=entries)
    (folder / "w.bin").write_bytes(np.arange(70, dtype=np.float32).tobytes())
    assert_refused(tmp_path, model, fragment)


def test_dims_too_big_for_int64_are_not_wrapped_around(tmp_path):
    """2**32 x 2**32 floats: np.prod in int64 would make that 0 bytes, which every file holds."""
    folder = tmp_path / "model"
    model_path = save_with_external(folder)
    (folder / "w.bin").write_bytes(b"\0" * 280)
    model = onnx.load(model_path, load_external_data=False)
    t = model.graph.initializer[0]
    t.dims[:] = [2**32, 2**32]
    del t.external_data[2:]  # no length entry: the size comes from the dims
    onnx.save(model, model_path)
    assert_refused(tmp_path, model_path, "is too short for tensor 'w'")


@pytest.mark.parametrize("sub", [False, True], ids=["graph", "subgraph"])
def test_regular_external_file_still_works(tmp_path, sub):
    folder = tmp_path / "model"
    model_path = save_with_external(folder, sub)
    (folder / "w.bin").write_bytes(np.arange(70, dtype=np.float32).tobytes())
    out = tmp_path / "out" / "o.onnx"
    out.parent.mkdir()
    k3opt.optimize_file(model_path, out)
    feeds = {"x": np.ones(70, np.float32), **({"c": np.array(True)} if sub else {})}
    np.testing.assert_array_equal(run_ort(onnx.load(out), feeds)[0], 1 + np.arange(70, dtype=np.float32))


def nested_ifs(depth: int) -> onnx.ModelProto:
    """``depth`` Ifs nested in then-branches; the innermost body returns x."""
    def vi(name: str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, [2])

    body = helper.make_graph([helper.make_node("Identity", ["x"], [f"o{depth}"])], f"g{depth}", [], [vi(f"o{depth}")])
    for d in range(depth - 1, -1, -1):
        other = helper.make_graph([helper.make_node("Neg", ["x"], [f"e{d}"])], f"e{d}", [], [vi(f"e{d}")])
        body = helper.make_graph([helper.make_node("If", ["c"], [f"o{d}"], then_branch=body, else_branch=other)],
                                 f"g{d}", [], [vi(f"o{d}")])
    graph = helper.make_graph(list(body.node), "main",
                              [vi("x"), helper.make_tensor_value_info("c", TensorProto.BOOL, [])], [vi("o0")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_subgraphs_nested_past_the_bound_are_refused(tmp_path):
    deepest = nested_ifs(modelio.MAX_GRAPH_DEPTH)
    onnx.save(deepest, tmp_path / "ok.onnx")
    code, out, err = invoke(["optimize", str(tmp_path / "ok.onnx"), "-q"])
    assert code == 0, err
    onnx.save(nested_ifs(modelio.MAX_GRAPH_DEPTH + 1), tmp_path / "deep.onnx")
    assert_refused(tmp_path, tmp_path / "deep.onnx", f"subgraphs nested more than {modelio.MAX_GRAPH_DEPTH} deep")
    with pytest.raises(InputError, match="nested more than"):
        k3opt.optimize(nested_ifs(modelio.MAX_GRAPH_DEPTH + 1))


def test_nesting_protobuf_cannot_parse_is_one_line(tmp_path):
    """Past ~30 levels protobuf itself gives up: said so, not as a corrupt file."""
    path = tmp_path / "deeper.onnx"
    path.write_bytes(_nest_bytes(40))
    assert_refused(tmp_path, path, "nests deeper than protobuf can parse")


def _nest_bytes(depth: int) -> bytes:
    """A serialized model with Ifs nested ``depth`` deep, encoded by hand (protobuf refuses to build it)."""
    def field(number: int, payload: bytes) -> bytes:
        return _varint(number << 3 | 2) + _varint(len(payload)) + payload

    def graph(nodes: bytes, name: str, output: str) -> bytes:  # GraphProto: node=1, name=2, output=12
        out = helper.make_tensor_value_info(output, TensorProto.FLOAT, [2]).SerializeToString()
        return nodes + field(2, name.encode()) + field(12, out)

    body = graph(field(1, helper.make_node("Identity", ["x"], [f"o{depth}"]).SerializeToString()), "inner",
                 f"o{depth}")
    for d in range(depth - 1, -1, -1):
        other = graph(field(1, helper.make_node("Neg", ["x"], [f"e{d}"]).SerializeToString()), f"e{d}", f"e{d}")
        node = helper.make_node("If", ["c"], [f"o{d}"]).SerializeToString()
        for name, sub in (("then_branch", body), ("else_branch", other)):  # AttributeProto: name=1, g=6, type=20
            node += field(5, field(1, name.encode()) + field(6, sub) + _varint(20 << 3) + _varint(5))
        body = graph(field(1, node), f"g{d}", f"o{d}")
    main = nested_ifs(0)
    head = onnx.ModelProto(ir_version=main.ir_version, opset_import=main.opset_import).SerializeToString()
    return head + field(7, body)  # ModelProto: graph=7


def _varint(n: int) -> bytes:
    out = b""
    while True:
        out += bytes([n & 0x7F | (0x80 if n > 0x7F else 0)])
        n >>= 7
        if not n:
            return out


def constant_model(value: TensorProto, size: int = 2) -> onnx.ModelProto:
    """y = x + Constant(value), x of shape [size]."""
    graph = helper.make_graph([helper.make_node("Constant", [], ["c"], value=value),
                               helper.make_node("Add", ["x", "c"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("value, fragment", [
    (TensorProto(name="c", data_type=TensorProto.FLOAT, dims=[2**31, 2**31], raw_data=b"\0" * 4),
     "tensor 'c': its data does not fit its type and shape (4 bytes for [2147483648, 2147483648])"),
    (TensorProto(name="c", data_type=TensorProto.FLOAT, dims=[2**32, 2**32], float_data=[1.0]),
     "tensor 'c': its data does not fit its type and shape (1 values for [4294967296, 4294967296])"),
    (TensorProto(name="c", data_type=TensorProto.FLOAT, dims=[-1, 2], raw_data=b"\0" * 8),
     "tensor 'c' has a negative dimension [-1, 2]"),
    (TensorProto(name="c", dims=[2], raw_data=b"\0" * 8), "tensor 'c' has no known data type (0)"),
], ids=["claims-2**62-in-4-bytes", "claims-2**64-in-one-value", "negative-dim", "no-type"])
def test_attribute_tensor_claiming_more_than_it_holds_is_refused(tmp_path, value, fragment):
    onnx.save(constant_model(value), tmp_path / "m.onnx")
    assert_refused(tmp_path, tmp_path / "m.onnx", fragment)


def test_a_big_attribute_tensor_that_holds_its_bytes_is_fine(tmp_path):
    big = np.random.default_rng(0).standard_normal(2**20).astype(np.float32)  # 4 MB in a Constant
    onnx.save(constant_model(numpy_helper.from_array(big, "c"), big.size), tmp_path / "m.onnx")
    k3opt.optimize_file(tmp_path / "m.onnx", tmp_path / "o.onnx")
    x = np.ones(big.size, np.float32)
    np.testing.assert_array_equal(run_ort(onnx.load(tmp_path / "o.onnx"), {"x": x})[0], x + big)


def sparse_model(external: bool) -> onnx.ModelProto:
    values = numpy_helper.from_array(np.array([1.0, 2.0], np.float32), "s")
    if external:
        values.ClearField("raw_data")
        values.data_location = TensorProto.EXTERNAL
        values.external_data.add(key="location", value="s.bin")
    indices = numpy_helper.from_array(np.array([0, 3], np.int64), "s_idx")
    graph = helper.make_graph([helper.make_node("Add", ["x", "s"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
                              sparse_initializer=[helper.make_sparse_tensor(values, indices, [4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_sparse_initializers_are_read_and_their_external_data_refused(tmp_path):
    onnx.save(sparse_model(False), tmp_path / "m.onnx")
    model = k3opt.optimize(str(tmp_path / "m.onnx"))  # was "internal error while loading (AttributeError: name)"
    np.testing.assert_array_equal(run_ort(model, {"x": np.zeros(4, np.float32)})[0], [1, 0, 0, 2])
    folder = tmp_path / "ext"
    folder.mkdir()
    onnx.save(sparse_model(True), folder / "m.onnx")
    (folder / "s.bin").write_bytes(SECRET[:8])
    assert_refused(tmp_path, folder / "m.onnx", "sparse initializer 's' keeps its data in an external file")
