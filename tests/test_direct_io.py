"""DirectWriter (k3opt/modelio/direct_io.py): the same bytes as an ordinary file, by every route, with its fallbacks."""
from __future__ import annotations

import errno
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import k3opt
from k3opt import modelio
from k3opt.modelio import direct_io
from k3opt.errors import InputError
from tests.helpers import assert_equivalent, make_model

SMALL = 3 * direct_io.ALIGN  # a tiny buffer makes every write cross block and buffer boundaries


@pytest.fixture
def small_buffer(monkeypatch):
    monkeypatch.setattr(direct_io, "BUFFER", SMALL)


def _pieces(rng: np.random.Generator) -> list[bytes]:
    sizes = [1, 4095, 4096, 5000, SMALL, SMALL + 7, 3, 2 * SMALL - 1, 0, 10_000]
    return [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]


def test_writes_copies_and_flushes_give_exactly_the_bytes(tmp_path, small_buffer):
    rng = np.random.default_rng(0)
    source = tmp_path / "src.bin"
    source.write_bytes(rng.integers(0, 256, 50_000, dtype=np.uint8).tobytes())
    want = bytearray()
    with direct_io.DirectWriter(tmp_path / "out.bin") as w, open(source, "rb") as src:
        assert w.direct  # this file system takes O_DIRECT: the path under test is the real one
        for i, piece in enumerate(_pieces(rng)):
            assert w.write(piece) == len(piece)
            want += piece
            assert w.copy_from(src, 123 * i, 777 * i) == 777 * i
            want += source.read_bytes()[123 * i : 123 * i + 777 * i]
            if i % 3 == 0:  # a flush in the middle leaves a file of exactly tell() bytes, then goes on
                w.flush()
                assert (tmp_path / "out.bin").read_bytes() == want
            assert w.tell() == len(want)
        w.write(np.arange(12, dtype=np.float32).reshape(3, 4).data)  # a 2-D buffer, as merged weights write
        want += np.arange(12, dtype=np.float32).tobytes()
        assert w.copy_from(src, 49_990, 100) == 10  # the source ends: the caller sees the shortfall
        want += source.read_bytes()[49_990:]
    assert (tmp_path / "out.bin").read_bytes() == want


def test_refused_o_direct_falls_back_to_ordinary_writes(tmp_path, monkeypatch, small_buffer):
    real_open, real_pwrite = os.open, os.pwrite

    def no_direct_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct_open)
    with direct_io.DirectWriter(tmp_path / "a.bin") as w:
        w.write(b"x" * 10_000)
    assert not w.direct and (tmp_path / "a.bin").read_bytes() == b"x" * 10_000
    monkeypatch.setattr(os, "open", real_open)

    def refusing_pwrite(fd, data, offset):  # accepted at open, refused at the first write (some FUSE mounts)
        if w2.direct:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", refusing_pwrite)
    with direct_io.DirectWriter(tmp_path / "b.bin") as w2:
        w2.write(b"y" * 20_000)
    assert not w2.direct and (tmp_path / "b.bin").read_bytes() == b"y" * 20_000


def test_other_write_errors_are_not_swallowed(tmp_path, monkeypatch, small_buffer):
    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    w = direct_io.DirectWriter(tmp_path / "c.bin")
    with pytest.raises(OSError, match="No space"):
        w.write(b"z" * (2 * SMALL))
    with pytest.raises(OSError, match="No space"):
        w.close()  # the error surfaces; the descriptor is still released
    assert w.fileno() == -1


def test_an_error_inside_the_block_abandons_the_file_unflushed(tmp_path):
    with pytest.raises(RuntimeError, match="stop"):
        with direct_io.DirectWriter(tmp_path / "d.bin") as w:
            w.write(b"abc")
            raise RuntimeError("stop")
    assert w.fileno() == -1 and (tmp_path / "d.bin").read_bytes() == b""  # modelio.save deletes it


def sibling_model(n: int = 600) -> onnx.ModelProto:
    """Three projections of one input (merged into one MatMul), weights of 1.4 MB: page-aligned in the data file."""
    rng = np.random.default_rng(1)
    nodes = [helper.make_node("MatMul", ["x", w], [y], name=y) for w, y in (("wq", "q"), ("wk", "k"), ("wv", "v"))]
    weights = {w: rng.standard_normal((n, n)).astype(np.float32) for w in ("wq", "wk", "wv")}
    return make_model(nodes, [("x", TensorProto.FLOAT, [2, n])],
                      [(y, TensorProto.FLOAT, [2, n]) for y in "qkv"], weights)


@pytest.mark.parametrize("fsync", [False, True])
def test_direct_save_writes_what_the_buffered_save_writes(tmp_path, monkeypatch, small_buffer, fsync):
    src = tmp_path / "m.onnx"
    onnx.save(sibling_model(), src, save_as_external_data=True, location="m.data", size_threshold=0)
    monkeypatch.setattr(modelio.saving, "DIRECT_THRESHOLD", 2**62)
    k3opt.optimize_file(src, tmp_path / "buffered.onnx", fsync=fsync)
    monkeypatch.setattr(modelio.saving, "DIRECT_THRESHOLD", 0)
    report = k3opt.optimize_file(src, tmp_path / "direct.onnx", fsync=fsync)
    assert report.after.ops["MatMul"] == 1  # the merged weight was streamed through the writer
    assert (tmp_path / "direct.onnx.data").read_bytes() == (tmp_path / "buffered.onnx.data").read_bytes()
    assert_equivalent(sibling_model(), onnx.load(tmp_path / "direct.onnx"))


def test_direct_save_of_a_short_source_is_an_input_error(tmp_path, monkeypatch):
    src = tmp_path / "m.onnx"
    onnx.save(sibling_model(), src, save_as_external_data=True, location="m.data", size_threshold=0)
    model = modelio.load(src)
    with open(tmp_path / "m.data", "r+b") as f:  # cut after loading: the copy finds it short
        f.truncate(1000)
    monkeypatch.setattr(modelio.saving, "DIRECT_THRESHOLD", 0)
    with pytest.raises(InputError, match="ended early"):
        modelio.save(model, tmp_path / "out.onnx", external_data=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.data", "m.onnx"]
