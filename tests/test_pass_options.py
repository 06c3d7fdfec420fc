"""Pass options: declared by passes, listed by `k3opt passes`, set with --pass-option, typos refused."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

import k3opt
from k3opt.cli import main
from tests.helpers import op_counts

EXAMPLE = "examples/tiny_transformer.onnx"


def test_passes_lists_the_options_each_pass_reads():
    out = CliRunner().invoke(main, ["passes"]).output
    for key in ("fold_max_bytes", "fold_max_elements", "cse_max_const_bytes", "matmul_add_nd"):
        assert f"--pass-option {key}=" in out


def test_pass_option_reaches_the_pass(tmp_path):
    keep = k3opt.optimize(EXAMPLE, matmul_add_nd="keep")
    flat = k3opt.optimize(EXAMPLE, matmul_add_nd="flatten", verify=True)
    assert op_counts(keep).get("Gemm", 0) == 0 < op_counts(flat)["Gemm"]
    out = tmp_path / "o.onnx"
    result = CliRunner().invoke(main, ["optimize", EXAMPLE, "-o", str(out), "-q", "--pass-option", "matmul_add_nd=flatten"])
    assert result.exit_code == 0, result.output
    assert out.is_file()


@pytest.mark.parametrize("args, message", [
    (["--pass-option", "matmul_add_n=flatten"], "unknown pass option(s) matmul_add_n"),
    (["--pass-option", "matmul_add_nd=sideways"], "matmul_add_nd=sideways: expected one of auto, flatten, keep"),
    (["--pass-option", "novalue"], "expected KEY=VALUE"),
])
def test_bad_pass_options_are_one_line_usage_errors(tmp_path, args, message):
    out = tmp_path / "o.onnx"
    result = CliRunner().invoke(main, ["optimize", EXAMPLE, "-o", str(out), *args])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output
    assert not out.exists()


def test_unknown_option_refused_by_the_api_too():
    with pytest.raises(k3opt.UsageError, match="known: .*matmul_add_nd"):
        k3opt.optimize(EXAMPLE, fold_max_byte=10)
