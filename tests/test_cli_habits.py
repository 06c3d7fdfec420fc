"""What a new user types: a directory, the output as a second argument (as in onnxsim/onnxslim), compile without
ATC; and every long phase announcing itself through the progress sink."""
from __future__ import annotations

import onnx
import pytest
from click.testing import CliRunner

from k3opt.cann_bridge import AtcOptions, AtcUnavailable, compile_model
from k3opt.cli import main
from k3opt.errors import CompileError
from tests.cann_models import rms_model
from tests.fake_atc import write_fake_atc
from tests.zoo import needs_torch


def invoke(args, **kw):
    result = CliRunner().invoke(main, [str(a) for a in args], **kw)
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize("folder", [".", "sub", "sub/"])
def test_a_directory_is_one_clean_line(tmp_path, monkeypatch, folder):
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    code, _, err = invoke(["optimize", folder])
    assert code == 2 and err == f"k3opt: error: {folder}: is a directory, not an ONNX model file\n"


def test_positional_output_works_like_onnxsim(tiny_transformer, tmp_path):
    code, out, err = invoke(["optimize", tiny_transformer, tmp_path / "out.onnx"])
    assert code == 0, err
    assert (tmp_path / "out.onnx").is_file() and f"wrote {tmp_path / 'out.onnx'}" in out
    code, _, err = invoke(["optimize", tiny_transformer, "-o", tmp_path / "dash.onnx", "-q", "--no-verify"])
    assert code == 0 and (tmp_path / "dash.onnx").is_file()


def test_output_given_twice_is_one_line_and_writes_nothing(tiny_transformer, tmp_path):
    code, _, err = invoke(["optimize", tiny_transformer, tmp_path / "a.onnx", "-o", tmp_path / "b.onnx"])
    assert code == 2 and err.count("\n") == 1 and "give OUT or -o OUT, not both" in err
    assert not list(tmp_path.iterdir())


def _no_atc(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("HOME", str(tmp_path))
    for var in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr("k3opt.cann_bridge.atc_locate.default_roots", lambda home: [tmp_path / "none"])


def test_compile_without_atc_is_an_environment_error_exit_2(tmp_path, monkeypatch):
    _no_atc(tmp_path, monkeypatch)
    onnx.save(rms_model(), tmp_path / "m.onnx")
    code, _, err = invoke(["compile", tmp_path / "m.onnx", "--soc-version", "Ascend910B3", "-o", tmp_path / "o"])
    assert code == 2 and err.count("\n") == 1 and "ATC not found" in err and "set_env.sh" in err
    with pytest.raises(CompileError) as caught:  # library callers catching CompileError still catch it
        compile_model(rms_model(), tmp_path / "p", AtcOptions(soc_version="Ascend910B3"))
    assert isinstance(caught.value, AtcUnavailable) and caught.value.exit_code == 2


def test_atc_that_cannot_start_is_exit_2_and_a_failing_atc_exit_1(tmp_path, monkeypatch):
    onnx.save(rms_model(), tmp_path / "m.onnx")
    broken = tmp_path / "atc"
    broken.write_text("#!/nonexistent/interpreter\n")
    broken.chmod(0o755)
    args = ["compile", tmp_path / "m.onnx", "--soc-version", "Ascend910B3", "-o", tmp_path / "o", "-q"]
    code, _, err = invoke(args + ["--atc", broken])
    assert code == 2 and "cannot run" in err
    fake = write_fake_atc(tmp_path / "cann")
    monkeypatch.setenv("FAKE_ATC_MODE", "E19999")
    code, _, err = invoke(args + ["--atc", fake])
    assert code == 1 and "E19999" in err


class Sink:
    """A progress sink recording every message."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def __call__(self, message: str) -> None:
        self.messages.append(message)


def test_optimize_announces_each_phase(tiny_transformer, tmp_path):
    import k3opt

    sink = Sink()
    k3opt.optimize_file(tiny_transformer, tmp_path / "o.onnx", verify=True, opset=18, progress=sink)
    heads = [m.split(" (")[0] for m in sink.messages]
    for phase in ("loading", "running the original", "converting opset", "verifying", "saving"):
        assert phase in heads, sink.messages
    assert any(m.startswith("running pass fold-constants (round 1)") for m in sink.messages)
    assert heads.index("loading") < heads.index("running the original") < heads.index("converting opset") < heads.index("verifying") < heads.index("saving")


def test_compile_announces_atc(tmp_path, monkeypatch):
    fake = write_fake_atc(tmp_path / "cann")
    monkeypatch.delenv("FAKE_ATC_MODE", raising=False)
    sink = Sink()
    compile_model(rms_model(), tmp_path / "o", AtcOptions(soc_version="Ascend910B3"), atc=str(fake), progress=sink)
    assert sink.messages[-1] == "running ATC" and "lowering for cann" in sink.messages


@needs_torch
def test_export_announces_the_torch_export_before_the_pipeline(tmp_path):
    import torch

    from k3opt.export import from_torch

    sink = Sink()
    from_torch(torch.nn.Linear(4, 4).eval(), (torch.randn(2, 4),), tmp_path / "m.onnx", input_names=["x"],
               output_names=["y"], progress=sink, verify=False)
    assert sink.messages[0] == "exporting with the torchscript exporter" and sink.messages[1] == "loading"



@needs_torch
def test_export_from_transformers_announces_loading_the_model(tmp_path, monkeypatch):
    import sys

    from k3opt.export import from_transformers

    class Loaded(Exception):
        pass

    def load_model(*args):
        raise Loaded

    monkeypatch.setattr(sys.modules["k3opt.export.from_transformers"], "load_model", load_model)
    sink = Sink()
    with pytest.raises(Loaded):
        from_transformers(tmp_path / "config.json", tmp_path / "m.onnx", progress=sink)
    assert sink.messages == ["loading the transformers model"]
