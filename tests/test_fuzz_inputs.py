"""Fuzzing the input model (issue #26, "make it stay fixed"): seed models broken at the protobuf level, the
graph level and the external-data level (tests/fuzz/mutate.py), each run through ``k3opt optimize`` and held
to docs/cli.md's guarantees (tests/fuzz/check.py): exit 0 or 2 (a valid model verifies; an invalid one is
the input's fault), one line on failure, no traceback or internal error, the folder as it was, no byte of a
file outside the model's folder in any output.

A few seconds per kind in the default run (``K3OPT_FUZZ_SECONDS``); the slow test runs minutes.
"""
from __future__ import annotations

import onnx
import pytest

from tests.fuzz import seeds
from tests.fuzz.check import KINDS, assert_promises, budget, for_seconds, invoke_in, model_case, state


@pytest.mark.parametrize("kind", KINDS)
def test_fuzz_inputs_fixed_budget(tmp_path, kind):
    for seed in for_seconds(budget(6.0)):
        model_case(tmp_path, seed, kind)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_fuzz_inputs_bigger_budget(tmp_path, kind):
    for seed in for_seconds(budget(120.0, "K3OPT_FUZZ_SLOW_SECONDS"), first=100_000):
        model_case(tmp_path, seed, kind)


# What the fuzz found, each kept as a test of its own.


def _run(tmp_path, model_or_bytes, *flags):
    folder = tmp_path / "case"
    folder.mkdir()
    data = model_or_bytes if isinstance(model_or_bytes, bytes) else model_or_bytes.SerializeToString()
    (folder / "m.onnx").write_bytes(data)
    before = state(folder)
    args = ["optimize", "m.onnx", "o.onnx", "-q", *flags]
    code, out, err = invoke_in(folder, args)
    assert_promises(folder, before, args, code, out, err, "regression")
    return code, err


def test_an_invalid_transpose_perm_is_the_inputs_fault(tmp_path):
    """merge-transposes composed perm [0, 2, 33] and raised IndexError (an internal error)."""
    model = seeds.shapes()
    next(n for n in model.graph.node if n.output[0] == "t2").attribute[0].ints[:] = [0, 2, 33]
    code, err = _run(tmp_path, model, "--opset", "13")
    assert code == 2 and "the input m.onnx does not load in onnxruntime" in err and "perm" in err


def test_a_string_that_is_not_utf8_is_one_line(tmp_path):
    """protobuf decodes a string when Python reads it: a flipped byte raised UnicodeDecodeError mid-run."""
    model = seeds.branches()
    model.graph.name = "GRAPHNAME"
    data = model.SerializeToString().replace(b"GRAPHNAME", b"\xf3RAPHNAME")
    code, err = _run(tmp_path, data)
    assert code == 2 and "a name or text field is not UTF-8" in err


def test_a_nul_in_an_external_data_location_is_refused(tmp_path):
    """os.stat raised ValueError (embedded null byte): an internal error."""
    onnx.save(seeds.mlp(), tmp_path / "w.onnx", save_as_external_data=True, location="w.bin", size_threshold=0)
    saved = onnx.load(tmp_path / "w.onnx", load_external_data=False)
    next(e for e in saved.graph.initializer[0].external_data if e.key == "location").value = "w.bin\0x"
    code, err = _run(tmp_path, saved)
    assert code == 2 and "location with a NUL character" in err


def test_a_newline_in_a_name_stays_on_one_line(tmp_path):
    model = seeds.half()
    model.graph.node[2].input[0] = "h\nek"
    code, err = _run(tmp_path, model)
    assert code == 2 and "input 'h\\nek' of node 'Mul' is produced by nothing" in err


def test_an_attribute_given_twice_never_reaches_onnx_s_converter(tmp_path):
    """onnx's version converter (C++) crashed the process on a node with 'axes' twice, of two types."""
    model = seeds.layer_norm()
    model.graph.node[0].attribute.append(onnx.helper.make_attribute("axes", 2**40))
    code, err = _run(tmp_path, model, "--opset", "18", "--no-verify")
    assert code == 2


def test_an_opset_1_model_keeps_its_output_shapes(tmp_path):
    """Shape inference without strict mode dropped the declared output shape; onnx's checker then refused the
    written model (exit 1: k3opt's fault)."""
    model = seeds.layer_norm()
    model.opset_import[0].version = 1
    code, err = _run(tmp_path, model, "--skip", "fold-constants")
    assert code == 0, err



@pytest.mark.parametrize("seed, kind", [(100377, "protobuf"), (100023, "graph")])
def test_what_onnxruntime_runs_but_the_checker_rejects_is_refused_without_verification(tmp_path, seed, kind):
    """With --no-verify the written file was only loaded in onnxruntime, which runs both inputs (a Constant whose
    ``value`` became ``vadue``; an untyped graph output inference cannot type): exit 0, and the written file
    failed onnx's checker. Now it is held to the checker too, and the input is blamed (exit 2)."""
    model_case(tmp_path, seed, kind)


@pytest.mark.parametrize("seed, kind", [(115247, "protobuf"), (107665, "graph")])
def test_a_norm_that_is_not_exactly_one_is_never_fused(tmp_path, seed, kind):
    """fuse-layernorm took Pow(d, 2.000002) for Pow(d, 2) (constants matched to 1e-6: a negative base then gives
    NaN in the original, a number in the fusion); a contrib LayerNormalization with a scalar scale (onnxruntime
    reads it as the normalized shape, past its end) was repaired and fused. Both were exit 1 (verification)."""
    model_case(tmp_path, seed, kind)


@pytest.mark.parametrize("seed, kind", [(509982, "graph"), (115430, "protobuf"), (112133, "graph")])
def test_a_target_no_shape_can_take_or_data_that_does_not_fit_its_dims_is_the_inputs_fault(tmp_path, seed, kind):
    """Reshape targets concatenated from a symbolic dim and constant sizes below -1 (or multiplying past 2^63):
    onnxruntime runs the original (the dim is unknown at load) but not the folded output, which was blamed
    (exit 1); an int64 constant whose data does not fit its dims was an internal error in the dim relations."""
    model_case(tmp_path, seed, kind)
