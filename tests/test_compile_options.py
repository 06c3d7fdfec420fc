"""`k3opt compile` takes the options that shape the graph (--skip, --passes, --pass-option, --plugin, --opset),
and --soc-version keeps NPU ops without a kernel on that chip out of the lowering."""
from __future__ import annotations

from collections import Counter

import onnx
import pytest
from click.testing import CliRunner

from k3opt import api
from k3opt.targets.cann.soc_support import family, missing_kernel
from k3opt.cli import main
from k3opt.report import Report
from tests.test_composition import opset23_model

ROPE = "NPURotaryPositionEmbedding"


@pytest.fixture
def src(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(opset23_model(None, past=False), path)
    return str(path)


def _compile(tmp_path, src, *args):
    out = tmp_path / "o"
    res = CliRunner().invoke(main, ["compile", src, "-o", str(out), "--dry-run", *args])
    ops = Counter(n.op_type for n in onnx.load(f"{out}.onnx").graph.node) if res.exit_code == 0 else None
    return res, ops


def test_rotary_lowered_where_the_chip_has_a_kernel(tmp_path, src):
    res, ops = _compile(tmp_path, src, "--soc-version", "Ascend910B3")
    assert res.exit_code == 0, res.output
    assert ops[ROPE] == 2 and ops["NPURmsNorm"] == 1


@pytest.mark.parametrize("soc", ["Ascend310P3", "Ascend310B1", "Ascend910A"])
def test_rotary_kept_decomposed_on_a_chip_without_its_kernel(tmp_path, src, soc):
    res, ops = _compile(tmp_path, src, "--soc-version", soc)
    assert res.exit_code == 0, res.output
    assert ops[ROPE] == 0 and ops["NPURmsNorm"] == 1
    assert "no kernel on " + soc in res.output


def test_skip_and_passes_and_pass_option(tmp_path, src):
    res, ops = _compile(tmp_path, src, "--soc-version", "Ascend910B3", "--skip", "lower-rotary-npu")
    assert res.exit_code == 0, res.output
    assert ops[ROPE] == 0 and ops["NPURmsNorm"] == 1
    res, ops = _compile(tmp_path, src, "--soc-version", "Ascend910B3", "--pass-option", "npu_attention_form=npu")
    assert res.exit_code == 0, res.output
    assert any(n.domain == "npu" for n in onnx.load(str(tmp_path / "o.onnx")).graph.node)
    res, _ = _compile(tmp_path, src, "--soc-version", "Ascend910B3", "--skip", "no-such-pass")
    assert res.exit_code == 2 and "unknown pass" in res.output


def test_opset_other_than_17_refused_and_soc_contradiction(tmp_path, src):
    res, _ = _compile(tmp_path, src, "--soc-version", "Ascend910B3", "--opset", "16")
    assert res.exit_code == 2 and "needs opset 17" in res.output
    res, _ = _compile(tmp_path, src, "--soc-version", "Ascend910B3", "--pass-option", "soc_version=Ascend310P3")
    assert res.exit_code == 2 and "contradicts" in res.output


def test_plugin_option(tmp_path, src):
    plugin = tmp_path / "myrules.py"
    plugin.write_text("RULES = []\n")
    res, ops = _compile(tmp_path, src, "--soc-version", "Ascend910B3", "--plugin", str(plugin))
    assert res.exit_code == 0, res.output


def test_optimize_takes_the_soc_as_a_pass_option():
    model = opset23_model(None, past=False)
    report = Report()
    out = api.optimize(model, target="cann", soc_version="Ascend310P1", report=report)
    assert ROPE not in {n.op_type for n in out.graph.node}
    assert any("no kernel" in line for line in report.lowering + report.notes)


def test_families():
    assert family("Ascend910B3") == "Atlas A2 (Ascend910B)" and family("Ascend910_9391") == "Atlas A3 (Ascend910_93)"
    assert missing_kernel(ROPE, "Ascend910B4") is None and missing_kernel(ROPE, None) is None
    assert missing_kernel("NPURmsNorm", "Ascend310P3") is None


def test_optimize_cli_soc_version(tmp_path, src):
    out = tmp_path / "o.onnx"
    res = CliRunner().invoke(main, ["optimize", src, "-o", str(out), "--target", "cann", "--soc-version", "Ascend310P3"])
    assert res.exit_code == 0, res.output
    assert ROPE not in {n.op_type for n in onnx.load(str(out)).graph.node}
    res = CliRunner().invoke(main, ["optimize", src, "-o", str(tmp_path / "p.onnx"), "--soc-version", "Ascend310P3"])
    assert res.exit_code == 2 and "--target cann" in res.output
