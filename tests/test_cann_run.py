"""Running the stand-in ATC: success needs status 0 and the success line; failures surface codes and hints."""
from __future__ import annotations

import json

import pytest
from onnx import TensorProto, helper, save

from k3opt.cann_bridge.atc_command import AtcOptions, build_command
from k3opt.cann_bridge.atc_run import AtcResult, raise_for_result, run_atc, summarize_fusion_result
from k3opt.errors import CompileError
from tests.fake_atc import recorded_argv, write_fake_atc
from tests.helpers import make_model


@pytest.fixture
def setup(tmp_path):
    atc = write_fake_atc(tmp_path / "bin")
    model = make_model([helper.make_node("Relu", ["x"], ["y"], name="relu")],
                       [("x", TensorProto.FLOAT, [1, 4])], [("y", TensorProto.FLOAT, [1, 4])])
    path = tmp_path / "m.onnx"
    save(model, path)
    return atc, path, tmp_path


def run(atc, model, out, **kw):
    cmd = build_command(str(atc), str(model), str(out), AtcOptions(soc_version="Ascend910B3", **kw))
    lines = []
    return run_atc(cmd, cwd=out.parent, echo=lines.append), lines


def test_success_streams_and_writes_om(setup):
    atc, model, tmp = setup
    result, echoed = run(atc, model, tmp / "out")
    assert result.succeeded and echoed == result.lines
    assert echoed[0].startswith("ATC start working now")
    assert (tmp / "out.om").is_file()
    raise_for_result(result)
    assert recorded_argv(atc)[0][:2] == ["--framework=5", f"--model={model}"]


def test_space_separated_flags_accepted(setup):
    atc, model, tmp = setup
    result = run_atc([str(atc), "--framework", "5", "--model", str(model), "--output", str(tmp / "o"),
                 "--soc_version", "Ascend310P3"])
    assert result.succeeded


@pytest.mark.parametrize("args, code", [
    (["--model=M", "--output=O", "--soc_version=Ascend910B3"], "E10007"),
    (["--framework=5", "--output=O", "--soc_version=Ascend910B3"], "E10054"),
    (["--framework=5", "--model=M", "--output=O", "--soc_version=Ascend910"], "E10001"),
    (["--framework=3", "--model=M", "--output=O", "--soc_version=Ascend910B3"], "E10001"),
    (["--framework=5", "--model=M", "--output=O", "--soc_version=Ascend910B3", "--input_shape=x:1,-1"], "E10001"),
    (["--framework=5", "--model=M", "--output=O", "--soc_version=Ascend910B3", "--bogus=1"], "E10001"),
])
def test_stand_in_is_strict(setup, args, code):
    atc, model, tmp = setup
    args = [a.replace("=M", f"={model}").replace("=O", f"={tmp / 'o'}") for a in args]
    result = run_atc([str(atc), *args])
    assert not result.succeeded and result.returncode == 255
    assert [c for c, _ in result.errors()] == [code]
    with pytest.raises(CompileError) as err:
        raise_for_result(result)
    assert code in str(err.value) and err.value.exit_code == 1


def test_unsupported_op_gives_e19010_with_check_hint(setup, monkeypatch):
    atc, model, tmp = setup
    monkeypatch.setenv("FAKE_ATC_UNSUPPORTED", "Relu")
    result, _ = run(atc, model, tmp / "out")
    with pytest.raises(CompileError) as err:
        raise_for_result(result)
    text = str(err.value)
    assert "optype [ai.onnx::17::Relu]" in text and "k3opt check --target cann" in text
    assert not (tmp / "out.om").exists()


@pytest.mark.parametrize("mode, why", [
    ("silent", "exited 0 but never printed its success line"),
    ("success-but-exit-1", "printed its success line but exited with status 1"),
    ("E19999", "ATC failed (exit status 255)"),
    ("libhal", "libascend_hal.so"),
])
def test_failure_modes(setup, monkeypatch, mode, why):
    atc, model, tmp = setup
    (atc.parent / "FAKE_ATC_MODE").write_text(mode)  # the flag-file way of choosing a mode
    result, _ = run(atc, model, tmp / "out")
    assert not result.succeeded
    with pytest.raises(CompileError) as err:
        raise_for_result(result)
    assert why in str(err.value)


def test_error_lines_deduplicated_and_hinted():
    result = AtcResult(255, ["ATC run failed", "E10001: Value [x] bad", "E10001: Value [x] bad", "E19999: Inner"])
    assert result.errors() == [("E10001", "E10001: Value [x] bad"), ("E19999", "E19999: Inner")]
    with pytest.raises(CompileError) as err:
        raise_for_result(result)
    assert str(err.value).count("hint E10001") == 1 and "hint E19999" in str(err.value)


def test_fusion_result_summary(setup, monkeypatch):
    atc, model, tmp = setup
    monkeypatch.setenv("FAKE_ATC_FUSION", "1")
    run(atc, model, tmp / "out")
    lines = summarize_fusion_result(tmp / "fusion_result.json")
    assert lines[0] == "ATC fusions: 2 of 3 passes took effect"
    assert any("MatMulBiasAddFusionPass: matched 3, applied 2" in l for l in lines)
    assert not any("SoftmaxFusionPass" in l for l in lines)


def test_fusion_result_unreadable(tmp_path):
    (tmp_path / "f.json").write_text("{not json")
    assert summarize_fusion_result(tmp_path / "f.json")[0].startswith("fusion_result.json unreadable")
    (tmp_path / "g.json").write_text(json.dumps({"g": {"graph_fusion": {"P": {"match_times": 1, "effect_times": 1}}}}))
    assert summarize_fusion_result(tmp_path / "g.json")[0] == "ATC fusions: 1 of 1 passes took effect"


def test_missing_executable_is_compile_error(tmp_path):
    with pytest.raises(CompileError, match="cannot run"):
        run_atc([str(tmp_path / "nope")])
