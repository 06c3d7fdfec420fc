"""ATC argument building and the refusals k3opt makes before ATC runs."""
from __future__ import annotations

import pytest

from k3opt.cann_bridge.atc_command import AtcOptions, build_command, parse_input_shape, render
from k3opt.errors import UsageError

BASE = ["atc", "--framework=5", "--model=m.onnx", "--output=out/m", "--soc_version=Ascend910B3"]


def cmd(**kw):
    return build_command("atc", "m.onnx", "out/m", AtcOptions(soc_version=kw.pop("soc", "Ascend910B3"), **kw))


def test_minimal_command():
    assert cmd() == BASE + ["--input_format=ND", "--log=error"]


@pytest.mark.parametrize("kw, expected", [
    (dict(input_shapes=("input_ids:1,128",)), ["--input_shape=input_ids:1,128"]),
    (dict(input_shapes=("a:1,128", "b:1,128")), ["--input_shape=a:1,128;b:1,128"]),
    (dict(input_shapes=("scalar:",)), ["--input_shape=scalar:"]),
    (dict(input_shapes=("x:0:1,8~64",)), ["--input_shape=x:0:1,8~64"]),
    (dict(precision_mode="allow_mix_precision"), ["--precision_mode=allow_mix_precision"]),
    (dict(precision_mode_v2="mixed_float16"), ["--precision_mode_v2=mixed_float16"]),
    (dict(input_shapes=("a:1,-1", "b:1,-1"), dynamic_dims="32,32;64,64"),
     ["--input_shape=a:1,-1;b:1,-1", "--dynamic_dims=32,32;64,64"]),
    (dict(input_shapes=("a:-1,128",), dynamic_batch_size="1,2,4"),
     ["--input_shape=a:-1,128", "--dynamic_batch_size=1,2,4"]),
    (dict(input_shapes=("img:1,3,-1,-1",), dynamic_image_size="224,224;448,448"),
     ["--input_shape=img:1,3,-1,-1", "--dynamic_image_size=224,224;448,448"]),
])
def test_option_renders(kw, expected):
    out = cmd(**kw)
    assert out[:5] == BASE
    assert [a for a in out[5:] if a not in ("--input_format=ND", "--log=error")] == expected


def test_order_and_everything_together(tmp_path):
    switch = tmp_path / "switch.cfg"
    switch.write_text("MatMulBiasAddFusionPass:off\n")
    out = cmd(input_shapes=("a:-1,128",), dynamic_batch_size="1,8", precision_mode="force_fp32",
              fusion_switch_file=str(switch), log="debug", input_format="NCHW",
              extra_args=("--op_select_implmode=high_precision", "--external_weight=1"))
    assert out == BASE + ["--input_shape=a:-1,128", "--input_format=NCHW", "--dynamic_batch_size=1,8",
                          "--precision_mode=force_fp32", f"--fusion_switch_file={switch}", "--log=debug",
                          "--op_select_implmode=high_precision", "--external_weight=1"]


def test_extra_flags_in_both_forms():
    out = cmd(extra_args=("--op_select_implmode", "high_precision", "--external_weight=1"))
    assert out[-3:] == ["--op_select_implmode", "high_precision", "--external_weight=1"]


def test_render_quotes_for_the_shell():
    text = render(cmd(input_shapes=("a:1,2", "b:3")))
    assert "'--input_shape=a:1,2;b:3'" in text


@pytest.mark.parametrize("soc", ["Ascend910B3", "Ascend310P3", "Ascend910B2C", "Ascend910B4_1", "Ascend310B1",
                                 "Ascend910_9392", "Ascend910_9362", "Ascend310", "Ascend910A"])
def test_known_soc_forms(soc):
    assert f"--soc_version={soc}" in cmd(soc=soc)


@pytest.mark.parametrize("soc, hint", [("ascend910b3", "Ascend910B3"), ("910B3", "Ascend910B3"),
                                       ("Ascend910B9", None), ("Ascend910", None), ("", None)])
def test_bad_soc_refused_with_hint(soc, hint):
    with pytest.raises(UsageError) as err:
        cmd(soc=soc)
    assert "npu-smi info" in str(err.value)
    assert (f"did you mean {hint}" in str(err.value)) == bool(hint)


@pytest.mark.parametrize("kw, message", [
    (dict(precision_mode="force_fp16", precision_mode_v2="fp16"), "mutually exclusive"),
    (dict(precision_mode="fp16"), "not one of"),
    (dict(precision_mode_v2="force_fp16"), "not one of"),
    (dict(log="verbose"), "not one of"),
    (dict(input_format="NHWC"), "not one of"),
    (dict(input_shapes=("a:1,-1",), dynamic_dims="8;16", dynamic_batch_size="1,2"), "mutually exclusive"),
    (dict(input_shapes=("a:1,128",), dynamic_dims="8;16"), "needs -1 dims"),
    (dict(dynamic_batch_size="1,2"), "needs -1 dims"),
    (dict(input_shapes=("a:1,-1",)), "-1 dims"),
    (dict(input_shapes=("a:1,-1",), dynamic_dims="8,8;16,16"), "has 2 value(s)"),
    (dict(input_shapes=("a:1,-1",), dynamic_dims="8"), "1 profile(s)"),
    (dict(input_shapes=("a:1,-1",), dynamic_dims=";".join(["8"] * 101)), "101 profile(s)"),
    (dict(input_shapes=("a:1,-1",), dynamic_dims="8;x"), "positive integers"),
    (dict(input_shapes=("a:1,-1",), dynamic_dims="8;16", extra_args=("--insert_op_conf=aipp.cfg",)), "AIPP"),
    (dict(input_shapes=("a:1,-1", "b:1~4,-1"), dynamic_dims="8,8;16,16"), "shape ranges"),
    (dict(input_shapes=("a:1,-1",), dynamic_batch_size="1,2"), "first (batch) dim"),
    (dict(input_shapes=("a:-1,128",), dynamic_batch_size="4"), "1 size(s)"),
    (dict(input_shapes=("a:-1,128",), dynamic_batch_size="0,4"), "positive integers"),
    (dict(input_shapes=("img:1,3,-1,224",), dynamic_image_size="1,1;2,2"), "pairs"),
    (dict(input_shapes=("img:1,3,-1,-1",), dynamic_image_size="224;448"), "has 1 value(s)"),
    (dict(input_shapes=("a:1,128", "a:1,64")), "twice"),
    (dict(input_shapes=("a:1,0",)), "not a positive int"),
    (dict(input_shapes=("a:1,8~4",)), "not a positive int"),
    (dict(input_shapes=("1,128",)), "expected NAME"),
    (dict(fusion_switch_file="/nonexistent/switch.cfg"), "no such file"),
    (dict(extra_args=("--soc_version=Ascend310P3",)), "repeats --soc_version"),
    (dict(extra_args=("--framework", "5")), "repeats --framework"),
    (dict(extra_args=("--weight=w.bin",)), "ignored for ONNX"),
    (dict(extra_args=("other.onnx",)), "is not a --flag"),
    (dict(extra_args=("--out_nodes=a:0", "stray")), "is not a --flag"),
])
def test_refused_before_atc(kw, message):
    with pytest.raises(UsageError) as err:
        cmd(**kw)
    assert message in str(err.value)


def test_output_prefix_must_not_have_om_suffix():
    with pytest.raises(UsageError, match="must not end in .om"):
        build_command("atc", "m.onnx", "out/m.om", AtcOptions(soc_version="Ascend910B3"))


def test_parse_input_shape():
    s = parse_input_shape("x:1,-1,4~8")
    assert (s.name, s.dims, s.unknown_dims, s.static) == ("x", ("1", "-1", "4~8"), 1, None)
    assert parse_input_shape("ids:1,128").static == (1, 128)
    assert parse_input_shape("s:").static == ()
