"""The target-cann invariants on every test export, and the pre-flight check / stand-in ATC on a real one."""
from __future__ import annotations

import onnx
import pytest

import k3opt
from k3opt.cann_bridge import AtcOptions, check_model, compile_model, invariant_violations
from k3opt.report import Report
from tests.cann_models import decompose_npu_rmsnorm
from tests.fake_atc import recorded_argv, write_fake_atc
from tests.helpers import op_counts, run_ort
from tests.zoo import EXPORTERS, NAMES, zoo_config, zoo_inputs, zoo_model

#: RMSNorms per decoder layer (input and post-attention; MLA adds the q_a and kv_a norms), plus the final norm.
_RMS_PER_LAYER = {"llama": 2, "qwen2": 2, "deepseek_v3": 4}


def expected_npu_rmsnorms(name: str) -> int:
    """RMSNorms in the model whose eps is the plugin's 1e-6 (read from the transformers config)."""
    if name not in _RMS_PER_LAYER:
        return 0
    config = zoo_config(name)
    if config.rms_norm_eps != 1e-6:
        return 0
    return _RMS_PER_LAYER[name] * config.num_hidden_layers + 1


def _cases():
    fast = {("llama", "torchscript")}
    return [pytest.param(n, e, marks=[pytest.mark.slow] if (n, e) not in fast else [])
            for n in NAMES for e in EXPORTERS]


@pytest.mark.parametrize("name, exporter", _cases())
def test_cann_target_invariants_on_exports(name, exporter):
    path = zoo_model(name, exporter)
    report = Report()
    out = k3opt.optimize(str(path), target="cann", verify=True, report=report)
    assert report.verification["status"] == "passed"
    assert report.lowering_verification["status"] == "passed", report.lowering_verification  # reference NPU ops
    assert [(o.domain or "", o.version) for o in out.opset_import] == [("", 17)]
    assert invariant_violations(out) == []
    assert op_counts(out).get("NPURmsNorm", 0) == expected_npu_rmsnorms(name), report.lowering
    assert [str(f) for f in check_model(out) if f.kind != "dynamic"] == []  # every node has an ATC parser
    # The lowered model computes what the export does (NPURmsNorm replaced by the plugin's formula).
    feeds = zoo_inputs(name)
    original = onnx.load(str(path))
    for a, b in zip(run_ort(original, feeds), run_ort(decompose_npu_rmsnorm(out), feeds)):
        assert a.shape == b.shape
        assert abs(a - b).max() <= 1e-4 * max(1.0, abs(a).max())


def test_llama_export_compiles_with_the_stand_in(tmp_path, monkeypatch):
    atc = write_fake_atc(tmp_path / "bin")
    src = zoo_model("llama", "torchscript")
    opts = AtcOptions(soc_version="Ascend910B3", input_shapes=("input_ids:1,8", "attention_mask:1,8"))
    res = compile_model(str(src), tmp_path / "out" / "llama", opts, atc=str(atc))
    assert res.om_path.is_file()
    assert check_model(onnx.load(str(res.onnx_path), load_external_data=False)) == []
    assert "--input_shape=input_ids:1,8;attention_mask:1,8" in recorded_argv(atc)[-1]
    assert res.report.lowering[0].startswith(f"NPURmsNorm: {expected_npu_rmsnorms('llama')} of")

