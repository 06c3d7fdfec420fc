"""`k3opt check --target cann` and `k3opt compile` end to end with the stand-in ATC."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

from k3opt.cann_bridge import AtcOptions, compile_model
from k3opt.cli import main
from k3opt.errors import CompileError, UsageError
from tests.cann_models import rms_model
from tests.fake_atc import recorded_argv, write_fake_atc
from tests.helpers import make_model

F = TensorProto.FLOAT


@pytest.fixture
def runner():
    return CliRunner()


@pytest.fixture
def atc(tmp_path, monkeypatch):
    """The stand-in ATC on PATH (and nothing else: no CANN variables, HOME in tmp)."""
    path = write_fake_atc(tmp_path / "cann" / "bin")
    monkeypatch.setenv("PATH", f"{path.parent}{os.pathsep}{os.environ['PATH']}")
    for var in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH", "FAKE_ATC_MODE", "FAKE_ATC_UNSUPPORTED", "FAKE_ATC_FUSION"):
        monkeypatch.delenv(var, raising=False)
    return path


def save(model, path: Path) -> str:
    onnx.save(model, str(path))
    return str(path)


def test_check_and_compile_are_k3opt_commands():
    import click

    assert all(main.get_command(click.Context(main), n).name == n for n in ("check", "compile"))


def test_check_clean_exits_0(runner, tmp_path):
    path = save(rms_model(), tmp_path / "m.onnx")
    res = runner.invoke(main, ["check", "--target", "cann", path])
    assert res.exit_code == 0, res.output
    assert "ATC can parse every node" in res.output


def test_check_lists_unsupported_and_dynamic_exits_1(runner, tmp_path):
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Gelu", ["r"], ["y"], name="gelu", approximate="tanh")]
    model = make_model(nodes, [("x", F, ["batch", 8])], [("y", F, ["batch", 8])], opset=20)
    path = save(model, tmp_path / "m.onnx")
    res = runner.invoke(main, ["check", "--target", "cann", path])
    assert res.exit_code == 1
    lines = res.stdout.splitlines()
    assert "op: ai.onnx::20::Gelu x1 (gelu): not in k3opt's table of ATC parsers" in lines
    assert any(l.startswith("dynamic: input 'x' [batch, 8]") for l in lines)
    assert any(l.startswith("opset: default-domain opset 20") for l in lines)
    res = runner.invoke(main, ["check", path, "--input-shape", "x:1,8"])
    assert "dynamic:" not in res.stdout


def test_check_bad_file_is_one_line_exit_2(runner, tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00not a model")
    res = runner.invoke(main, ["check", str(bad)])
    assert res.exit_code == 2 and "not a readable ONNX model" in res.stderr


def test_compile_success(runner, tmp_path, atc, monkeypatch):
    monkeypatch.setenv("FAKE_ATC_FUSION", "1")
    src = save(rms_model(shape=("batch", 3, 16)), tmp_path / "m.onnx")
    out = tmp_path / "build" / "m"
    res = runner.invoke(main, ["compile", src, "--soc-version", "Ascend910B3", "-o", str(out), "--input-shape", "x:2,3,16"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "build" / "m.om").is_file() and (tmp_path / "build" / "m.onnx").is_file()
    assert "ATC run success" in res.stdout and f"wrote {out}.om" in res.stdout
    assert "ATC fusions: 2 of 3 passes took effect" in res.stdout
    assert "lowering: NPURmsNorm: 1 of 1 RMSNorm(s) lowered" in res.stdout
    assert "lowering verification (reference evaluator): passed" in res.stdout
    argv = recorded_argv(atc)[-1]
    assert argv == ["--framework=5", f"--model={out}.onnx", f"--output={out}", "--soc_version=Ascend910B3",
                    "--input_shape=x:2,3,16", "--input_format=ND", "--log=error"]
    lowered = onnx.load(f"{out}.onnx")
    assert [(o.domain, o.version) for o in lowered.opset_import] == [("", 17)]
    assert lowered.graph.input[0].type.tensor_type.shape.dim[0].dim_value == 2  # static shape given to optimize


def test_compile_extra_flags_after_double_dash(runner, tmp_path, atc):
    src = save(rms_model(), tmp_path / "m.onnx")
    res = runner.invoke(main, ["compile", src, "--soc-version", "Ascend310P3", "-o", str(tmp_path / "o"),
                                      "--precision-mode", "allow_mix_precision", "--", "--op_select_implmode=high_precision"])
    assert res.exit_code == 0, res.output
    assert recorded_argv(atc)[-1][-3:] == ["--precision_mode=allow_mix_precision", "--log=error",
                                           "--op_select_implmode=high_precision"]


def test_compile_dry_run_needs_no_atc(runner, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    src = save(rms_model(), tmp_path / "m.onnx")
    res = runner.invoke(main, ["compile", src, "--soc-version", "Ascend910B3", "-o", str(tmp_path / "o"), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert f"atc --framework=5 --model={tmp_path / 'o'}.onnx" in res.stdout
    assert not (tmp_path / "o.om").exists() and (tmp_path / "o.onnx").exists()


def test_compile_atc_not_found(runner, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr("k3opt.cann_bridge.atc_locate.default_roots", lambda home: [tmp_path / "none"])
    src = save(rms_model(), tmp_path / "m.onnx")
    res = runner.invoke(main, ["compile", src, "--soc-version", "Ascend910B3", "-o", str(tmp_path / "o")])
    assert res.exit_code == 2  # an environment problem, not a failed compile
    assert res.stderr.count("\n") == 1 and "set_env.sh" in res.stderr


def test_compile_e19010_exit_1_with_hint(runner, tmp_path, atc, monkeypatch):
    monkeypatch.setenv("FAKE_ATC_UNSUPPORTED", "MatMul")
    src = save(rms_model(), tmp_path / "m.onnx")
    res = runner.invoke(main, ["compile", src, "--soc-version", "Ascend910B3", "-o", str(tmp_path / "o")])
    assert res.exit_code == 1
    assert "E19010" in res.stderr and "k3opt check --target cann" in res.stderr
    assert not (tmp_path / "o.om").exists()


@pytest.mark.parametrize("args, message", [
    (["--soc-version", "ascend910b3"], "did you mean Ascend910B3"),
    (["--dynamic-dims", "8;16", "--input-shape", "x:2,3,16"], "needs -1 dims"),
    (["--dynamic-dims", "8;16", "--dynamic-batch-size", "1,2", "--input-shape", "x:-1,3,16"], "mutually exclusive"),
    (["--precision-mode", "force_fp16", "--precision-mode-v2", "fp16"], "mutually exclusive"),
])
def test_compile_refuses_before_any_work(runner, tmp_path, atc, args, message):
    src = save(rms_model(), tmp_path / "m.onnx")
    base = ["--soc-version", "Ascend910B3"] if "--soc-version" not in args else []
    res = runner.invoke(main, ["compile", src, "-o", str(tmp_path / "o"), *base, *args])
    assert res.exit_code == 2 and message in res.stderr
    assert recorded_argv(atc) == [] and not (tmp_path / "o.onnx").exists()


def test_compile_preflight_refuses_dynamic_input(tmp_path, atc):
    src = save(rms_model(shape=("batch", 3, 16)), tmp_path / "m.onnx")
    with pytest.raises(CompileError) as err:
        compile_model(src, tmp_path / "o", AtcOptions(soc_version="Ascend910B3"))
    assert "dynamic: input 'x'" in str(err.value) and recorded_argv(atc) == []


def test_compile_dynamic_dims_pass_through(tmp_path, atc):
    src = save(rms_model(shape=(1, "seq", 16)), tmp_path / "m.onnx")
    opts = AtcOptions(soc_version="Ascend910B3", input_shapes=("x:1,-1,16",), dynamic_dims="32;64;128")
    res = compile_model(src, tmp_path / "o", opts)
    assert res.om_path == tmp_path / "o.om"
    assert "--dynamic_dims=32;64;128" in recorded_argv(atc)[-1]


def test_library_call_on_a_model_proto(tmp_path, atc):
    lines = []
    res = compile_model(rms_model(), tmp_path / "lib" / "m", AtcOptions(soc_version="Ascend910B3"), echo=lines.append)
    assert res.om_path.is_file() and res.onnx_path == tmp_path / "lib" / "m.onnx"
    assert lines[0].startswith("lowering: NPURmsNorm") and any("ATC run success" in l for l in lines)
    assert res.report.lowering[0].startswith("NPURmsNorm: 1 of 1")


def test_om_output_prefix_refused(tmp_path, atc):
    with pytest.raises(UsageError, match="must not end in .om"):
        compile_model(rms_model(), tmp_path / "m.om", AtcOptions(soc_version="Ascend910B3"))


def test_compile_quiet_prints_nothing(runner, tmp_path, atc):
    src = save(rms_model(), tmp_path / "m.onnx")
    res = runner.invoke(main, ["compile", src, "--soc-version", "Ascend910B3", "-o", str(tmp_path / "o"), "-q",
                               "--no-verify"])
    assert res.exit_code == 0 and res.stdout == "" and (tmp_path / "o.om").is_file()


def test_output_prefix_that_would_overwrite_the_input_is_refused(tmp_path, atc):
    src = save(rms_model(), tmp_path / "m.onnx")
    before = (tmp_path / "m.onnx").read_bytes()
    with pytest.raises(UsageError, match="over the input"):
        compile_model(src, tmp_path / "m", AtcOptions(soc_version="Ascend910B3"))
    assert (tmp_path / "m.onnx").read_bytes() == before


def test_recompiling_to_the_same_prefix_replaces_the_outputs(tmp_path, atc):
    src = save(rms_model(), tmp_path / "m.onnx")
    for _ in range(2):
        res = compile_model(src, tmp_path / "out" / "m", AtcOptions(soc_version="Ascend910B3"), verify=False)
        assert res.om_path.is_file()
