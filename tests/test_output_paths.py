"""Output paths are checked before any work (issue #26, items 1, 2 and 7): a device, FIFO, socket or
folder is refused and never replaced; no output is the input, another output or the ``.data`` of one.

Each case asserts: exit 2, one line on stderr naming the problem, no traceback, the folder unchanged
(input untouched, no output, no temporary file) and the special file still what it was.
"""
from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import onnx
import pytest

from k3opt.errors import OutputError
from k3opt.modelio import check_outputs
from tests.test_bad_input import assert_one_line_error, good_model, invoke, snapshot


def special_files(folder: Path) -> dict[str, Path]:
    """A FIFO, a socket, a folder and (as root) a character device, all in ``folder`` (never /dev)."""
    made = {"fifo": folder / "fifo", "socket": folder / "sock", "directory": folder / "dir"}
    os.mkfifo(made["fifo"])
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(made["socket"]))
    sock.close()
    made["directory"].mkdir()
    if os.geteuid() == 0:
        made["device"] = folder / "null"
        os.mknod(made["device"], 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a /dev/null of our own
    return made


KINDS = {"fifo": stat.S_ISFIFO, "socket": stat.S_ISSOCK, "directory": stat.S_ISDIR, "device": stat.S_ISCHR}
WORDS = {"fifo": "is a FIFO", "socket": "is a socket", "directory": "is a directory", "device": "is a character device"}


def kind_of(path: Path) -> str:
    mode = os.lstat(path).st_mode
    return next(k for k, test in KINDS.items() if test(mode))


@pytest.fixture
def model_folder(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    onnx.save(good_model(), tmp_path / "m.onnx")
    return tmp_path


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("how", ["OUT", "-o", "--report", "OUT.data"])
def test_a_special_file_is_refused_and_left_alone(model_folder, kind, how):
    special = special_files(model_folder)
    if kind not in special:
        pytest.skip("creating a device node needs root")
    target = special[kind]
    if how == "OUT.data":  # the output's data file would land on it
        args = ["optimize", "m.onnx", "x.onnx", "--external-data"]
        os.rename(target, model_folder / "x.onnx.data")
        target = model_folder / "x.onnx.data"
    else:
        args = {"OUT": ["optimize", "m.onnx", str(target)], "-o": ["optimize", "m.onnx", "-o", str(target)],
                "--report": ["optimize", "m.onnx", "o.onnx", "--report", str(target)]}[how]
    before = snapshot(model_folder) if kind != "fifo" else None
    code, out, err = invoke(args + ["-q"])
    assert_one_line_error(code, out, err, 2, WORDS[kind])
    assert kind_of(target) == kind
    assert not (model_folder / "o.onnx").exists() and not (model_folder / "x.onnx").exists()
    assert not [p for p in model_folder.iterdir() if p.name.endswith(".tmp")]
    if before is not None:
        assert snapshot(model_folder) == before


@pytest.mark.parametrize("args, fragment", [
    (["o.onnx", "--report", "m.onnx"], "m.onnx: is the input"),
    (["o.onnx", "--report", "m.onnx", "--overwrite"], "m.onnx: is the input"),
    (["o.onnx", "--report", "o.onnx"], "is also the output model"),
    (["o.onnx", "--report", "o.onnx.data"], "is also the output's data file"),
    (["o.onnx", "--report", "./o.onnx"], "is also the output model"),
    (["m.onnx"], "pass --overwrite"),
    (["o.onnx", "--report", "missing/r.json"], "folder missing does not exist"),
    (["out/x.onnx/"], "names a folder"),
    (["-o", "out/"], "names a folder"),
    (["."], "names a folder"),
])
def test_outputs_colliding_or_unwritable_are_refused_before_any_work(model_folder, args, fragment):
    (model_folder / "out").mkdir()
    before = snapshot(model_folder)
    code, out, err = invoke(["optimize", "m.onnx", *args, "-q"])
    assert_one_line_error(code, out, err, 2, fragment)
    assert snapshot(model_folder) == before


def test_report_beside_a_good_output_is_written(model_folder):
    code, out, err = invoke(["optimize", "m.onnx", "o.onnx", "--report", "r.json", "-q"])
    assert code == 0, err
    assert (model_folder / "r.json").read_text().startswith("{")
    assert oct((model_folder / "r.json").stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    assert not [p for p in model_folder.iterdir() if p.name.endswith(".tmp")]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_symlink_to_a_fifo_is_refused(model_folder):
    os.mkfifo(model_folder / "fifo")
    os.symlink(model_folder / "fifo", model_folder / "link.onnx")
    code, out, err = invoke(["optimize", "m.onnx", "link.onnx", "-q"])
    assert_one_line_error(code, out, err, 2, "is a FIFO")
    assert stat.S_ISFIFO(os.stat(model_folder / "link.onnx").st_mode)


def test_the_saver_refuses_a_path_that_became_special_during_the_run(tmp_path, monkeypatch):
    """Checked first, then again just before the rename: a FIFO made meanwhile is not replaced."""
    from k3opt import modelio

    out = tmp_path / "o.onnx"

    def make_fifo(path: Path) -> None:  # runs after the files are written, before the renames
        os.mkfifo(out)

    with pytest.raises(OutputError, match="is a FIFO"):
        modelio.save(good_model(), out, check=make_fifo)
    assert stat.S_ISFIFO(os.lstat(out).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.onnx"]


def test_check_outputs_is_one_function_for_every_command(tmp_path):
    """The library function the commands share: None entries ignored, make_folders for compile."""
    check_outputs([tmp_path / "a.onnx", None], [None, tmp_path / "r.json"], [tmp_path / "in.onnx"])
    check_outputs([tmp_path / "new" / "deeper" / "a.onnx"], make_folders=True)
    with pytest.raises(OutputError, match="does not exist"):
        check_outputs([tmp_path / "new" / "a.onnx"])
    with pytest.raises(OutputError, match="is also another output"):
        check_outputs(others=[tmp_path / "r.json", tmp_path / "r.json"])
