"""The k3opt command line on the example model: table, report, quiet, passes list, exit codes."""
from __future__ import annotations

import io as stdio
import json
import shutil
import subprocess
import sys
import time

import onnx
import pytest
from click.testing import CliRunner

import k3opt.modelio

from k3opt.cli import main
from k3opt.pipeline.progress import Progress
from tests.conftest import Crash, ReluToSigmoid
from tests.helpers import assert_equivalent, make_model


def invoke(args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def test_optimize_tiny_transformer_prints_table_and_writes_default_output(tiny_transformer, tmp_path):
    src = tmp_path / "tiny.onnx"
    shutil.copy(tiny_transformer, src)
    code, out, err = invoke(["optimize", src, "--report", tmp_path / "r.json"])
    assert code == 0, err
    assert (tmp_path / "tiny.k3opt.onnx").exists()
    assert "nodes" in out and "verification: passed" in out and "wrote" in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["verification"]["status"] == "passed" and report["output"].endswith("tiny.k3opt.onnx")
    assert_equivalent(onnx.load(src), onnx.load(tmp_path / "tiny.k3opt.onnx"))


@pytest.mark.parametrize("flag", [[], ["--fsync"]])
def test_fsync_option_reaches_save(tiny_transformer, tmp_path, monkeypatch, flag):
    seen = []
    real = k3opt.modelio.save
    monkeypatch.setattr(k3opt.modelio, "save", lambda *a, **kw: (seen.append(kw["fsync"]), real(*a, **kw))[1])
    code, _, err = invoke(["optimize", tiny_transformer, "-o", tmp_path / "o.onnx", "-q", "--no-verify", *flag])
    assert code == 0, err
    assert seen == [bool(flag)]


def test_quiet_prints_nothing_and_options_reach_the_pipeline(tiny_transformer, tmp_path):
    code, out, err = invoke(["optimize", tiny_transformer, "-o", tmp_path / "o.onnx", "-q", "--no-verify",
                             "--input-shape", "input_ids:1,16", "--input-shape", "attention_mask:1,16",
                             "--skip", "fold-constants", "--external-data"])
    assert (code, out, err) == (0, "", "")
    saved = onnx.load(tmp_path / "o.onnx", load_external_data=False)
    assert [d.dim_value for d in saved.graph.input[0].type.tensor_type.shape.dim] == [1, 16]
    assert (tmp_path / "o.onnx.data").exists()


def test_passes_lists_every_pass_with_description(register):
    register(Crash)
    code, out, _ = invoke(["passes"])
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert "test-crash" in lines and "test: raises" in lines["test-crash"] and "not default" in lines["test-crash"]
    assert all(len(line.split()) > 1 for line in out.splitlines())  # every pass has a description


def test_verification_failure_exits_1_and_writes_no_model(register, tmp_path):
    from onnx import TensorProto, helper

    register(ReluToSigmoid)
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [("x", TensorProto.FLOAT, [4])],
                       [("y", TensorProto.FLOAT, [4])])
    onnx.save(model, tmp_path / "m.onnx")
    code, out, err = invoke(["optimize", tmp_path / "m.onnx", "--passes", "test-relu-to-sigmoid",
                             "--report", tmp_path / "r.json"])
    assert code == 1
    assert err.strip().splitlines()[-1].startswith("k3opt: error: optimized model differs")
    assert "first diverging pass: test-relu-to-sigmoid" in err
    assert not (tmp_path / "m.k3opt.onnx").exists()
    assert json.loads((tmp_path / "r.json").read_text())["verification"]["status"] == "failed"


def test_internal_error_is_one_line_naming_the_step(register, tiny_transformer, tmp_path):
    register(Crash)
    code, out, err = invoke(["optimize", tiny_transformer, "-o", tmp_path / "o.onnx", "--passes", "test-crash"])
    assert code == 2
    assert err.strip() == ("k3opt: error: internal error while running pass test-crash (round 1) "
                           "(ValueError: boom); rerun with --debug")
    assert not (tmp_path / "o.onnx").exists()


def test_a_debug_run_does_not_reach_the_next_run(register, tiny_transformer, tmp_path):
    """--debug and the progress step belong to one command run: the next run in the process starts clean."""
    register(Crash)
    code, _, err = invoke(["optimize", tiny_transformer, "-o", tmp_path / "o.onnx", "--passes", "test-crash",
                           "--debug"])
    assert code == 2 and "Traceback" in err
    code, _, err = invoke(["optimize", tiny_transformer, "-o", tmp_path / "o.onnx", "--passes", "nope"])
    assert code == 2 and err.strip().startswith("k3opt: error: unknown pass 'nope'") and "Traceback" not in err
    assert "while" not in err  # no step of the run before


def test_python_dash_m_and_version(tiny_transformer, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "k3opt", "optimize", tiny_transformer, "-o", tmp_path / "o.onnx"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "verification: passed" in proc.stdout
    assert invoke(["--version"])[1].startswith("k3opt, version")


def test_progress_prints_only_slow_steps():
    stream = stdio.StringIO()
    progress = Progress(delay=0.05, stream=stream)
    progress("fast step")
    progress("slow step")
    time.sleep(0.3)
    progress.close()
    assert stream.getvalue() == "k3opt: slow step...\n"
    quiet = Progress(enabled=False, delay=0.0, stream=stream)
    quiet("anything")
    time.sleep(0.05)
    assert quiet.current == "anything" and stream.getvalue() == "k3opt: slow step...\n"


def test_bare_k3opt_prints_help():
    code, out, err = invoke([])
    assert code == 0 and "optimize" in out and err == ""


def test_user_input_data_and_tolerances_reach_verification(tiny_transformer, tmp_path):
    import numpy as np

    ids = np.array([[5, 17, 99, 0]], dtype=np.int64)
    np.savez(tmp_path / "in.npz", input_ids=ids, attention_mask=np.array([[1, 1, 1, 0]], dtype=np.int64))
    code, out, err = invoke(["optimize", tiny_transformer, "-o", tmp_path / "o.onnx", "--input-data",
                             tmp_path / "in.npz", "--rtol", "0.001", "--atol", "0.0001", "--report", tmp_path / "r.json"])
    assert code == 0, err
    verification = json.loads((tmp_path / "r.json").read_text())["verification"]
    assert verification["status"] == "passed"
    assert (verification["rtol"], verification["atol"]) == (0.001, 0.0001)


@pytest.mark.slow
def test_output_is_byte_identical_across_processes(tiny_transformer, tmp_path):
    """Names and order must not depend on Python's per-process string hashing."""
    import os

    outputs = []
    for seed in ("1", "2"):
        out = tmp_path / f"o{seed}.onnx"
        subprocess.run([sys.executable, "-m", "k3opt", "optimize", tiny_transformer, "-o", out, "-q"],
                       check=True, env={**os.environ, "PYTHONHASHSEED": seed})
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1]


def test_quiet_means_quiet_even_when_graphsurgeon_would_warn(tmp_path, capfd):
    from onnx import TensorProto, helper

    dup = make_model([helper.make_node("Relu", ["x"], ["a"], name="n"), helper.make_node("Relu", ["a"], ["y"], name="n")],
                     [("x", TensorProto.FLOAT, [2])], [("y", TensorProto.FLOAT, [2])])
    onnx.save(dup, tmp_path / "dup.onnx")
    code, out, err = invoke(["optimize", tmp_path / "dup.onnx", "-q"])
    captured = capfd.readouterr()
    assert (code, out, err, captured.out, captured.err) == (0, "", "", "", "")


def test_every_table_command_is_listed_and_resolves_to_its_click_command():
    """cli.COMMANDS: a command is one line (name -> module:attribute), imported when listed or run."""
    import click

    from k3opt import cli

    ctx = click.Context(cli.main)
    assert set(cli.COMMANDS) <= set(cli.main.list_commands(ctx)) and {"optimize", "passes"} <= set(
        cli.main.list_commands(ctx))
    for name in cli.COMMANDS:
        command = cli.main.get_command(ctx, name)
        assert isinstance(command, click.Command) and command.name == name
