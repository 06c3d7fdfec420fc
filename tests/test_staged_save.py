"""A staged save: the model is written beside its destination, checked (maybe in a background thread while
the caller goes on) and renamed into place by commit; whatever fails, nothing is left behind."""
from __future__ import annotations

import threading
from pathlib import Path

import onnx
import pytest

import k3opt
from k3opt import modelio
from k3opt.errors import InvalidOutputError
from k3opt.pipeline import verify
from k3opt.report import Report
from tests.test_io import weighted_model


def test_a_background_check_runs_beside_the_caller_and_commit_waits_for_it(tmp_path):
    started, go_on = threading.Event(), threading.Event()
    seen = []

    def check(path: Path) -> None:
        started.set()
        go_on.wait(10)
        seen.append((threading.current_thread() is not threading.main_thread(), path.name, path.exists()))

    with modelio.staged(weighted_model(), tmp_path / "o.onnx", external_data=True) as files:
        files.check_in_background(check)
        assert started.wait(10)  # the check runs while this block does
        assert not (tmp_path / "o.onnx").exists()
        go_on.set()
        written = files.commit()
    assert seen == [(True, "o.onnx", True)]
    assert written == [tmp_path / "o.onnx", tmp_path / "o.onnx.data"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.onnx", "o.onnx.data"]
    onnx.checker.check_model(str(tmp_path / "o.onnx"))


def test_a_failing_background_check_is_raised_by_commit_and_nothing_is_written(tmp_path):
    def check(path: Path) -> None:
        raise InvalidOutputError("no")

    with pytest.raises(InvalidOutputError, match="no"):
        with modelio.staged(weighted_model(), tmp_path / "o.onnx") as files:
            files.check_in_background(check)
            files.commit()
    assert list(tmp_path.iterdir()) == []


def test_leaving_the_block_early_waits_for_the_check_then_removes_everything(tmp_path):
    ended = []

    def check(path: Path) -> None:
        threading.Event().wait(0.2)
        ended.append(path.exists())

    with pytest.raises(KeyError):
        with modelio.staged(weighted_model(), tmp_path / "o.onnx") as files:
            files.check_in_background(check)
            raise KeyError("the caller failed")
    assert ended == [True]  # the folder stayed until the check ended
    assert list(tmp_path.iterdir()) == []


def test_optimize_file_checks_the_output_beside_the_finishes_and_matches_optimize(tmp_path, tiny_transformer):
    """The default path: the output is written and its check started at the passes' fixed point; the file,
    and the report but for timings and the check's thread, are what optimize() and a plain save give."""
    threads = []
    real = verify.check_loads

    def spy(path, ran=False):
        threads.append(threading.current_thread() is threading.main_thread())
        return real(path, ran)

    src = tmp_path / "m.onnx"
    onnx.save(onnx.load(str(tiny_transformer)), src)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(verify, "check_loads", spy)
        report = k3opt.optimize_file(src, tmp_path / "o.onnx")
    assert threads == [False]
    plain_report = Report()
    plain = k3opt.optimize(onnx.load(str(src)), report=plain_report)
    modelio.save(plain, tmp_path / "p.onnx")
    assert (tmp_path / "o.onnx").read_bytes() == (tmp_path / "p.onnx").read_bytes()
    mine, theirs = report.as_dict(), plain_report.as_dict()
    for d in (mine, theirs):
        for key in ("timings", "input", "output", "files"):
            d.pop(key, None)
        d["after"].pop("size_bytes", None)
        d["before"].pop("size_bytes", None)
        for p in d["passes"]:
            p.pop("time_s", None)
    assert mine == theirs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "o.onnx", "p.onnx"]


def test_a_step_inside_another_is_timed_as_its_own_only():
    from k3opt.api import _Run

    run = _Run(Report())
    with run.step("outer", "outer"):
        threading.Event().wait(0.05)
        with run.step("inner", "inner"):
            threading.Event().wait(0.1)
    timings = run.report.timings
    assert 0.1 <= timings["inner"] < 0.2 and 0.05 <= timings["outer"] < 0.1
