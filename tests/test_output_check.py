"""Every write path checks that the written model loads before renaming it into place (issue #17: "Never write
a model that no longer runs"): onnxruntime by path, onnx's checker where onnxruntime lacks an op, the cann
target's own checks where NPU ops stand; a failure is exit 1, one line, and nothing written."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

import k3opt
from k3opt import modelio
from k3opt.targets.cann.target_form import check_written
from k3opt.cli import main
from k3opt.errors import InvalidOutputError
from k3opt.pipeline import verify
from k3opt.pipeline.verify import check_loads
from tests.conftest import ReluToSigmoid
from tests.helpers import make_model
from tests.test_io import save_external, weighted_model


class ReluToUnknownOp(ReluToSigmoid):
    """Test pass: rewrites Relu into a default-domain op no opset defines (onnxruntime refuses the model)."""

    name = "test-relu-to-unknown-op"
    description = "test: unloadable rewrite"
    replacement = "NoSuchOp"


def relu_model() -> onnx.ModelProto:
    return make_model([helper.make_node("Relu", ["x"], ["y"])], [("x", TensorProto.FLOAT, [4])],
                      [("y", TensorProto.FLOAT, [4])])


def invoke(args: list) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def test_unloadable_output_with_no_verify_is_exit_1_one_line_and_nothing_written(tmp_path, register):
    register(ReluToUnknownOp)
    onnx.save(relu_model(), tmp_path / "m.onnx")
    code, out, err = invoke(["optimize", tmp_path / "m.onnx", "-o", tmp_path / "o.onnx", "--no-verify",
                             "--passes", "test-relu-to-unknown-op"])
    assert code == 1
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("k3opt: error: the optimized model does not load in onnxruntime (")
    assert "NoSuchOp" in err and err.rstrip().endswith("nothing was written")
    assert "Load model from o.onnx failed" in err  # not the temporary folder's path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]  # no output, no temporary folder


@pytest.mark.parametrize("verify_on", [True, False], ids=["verified", "no-verify"])
def test_a_second_session_only_where_onnxruntime_has_not_run_the_graph(tmp_path, monkeypatch, verify_on):
    """A passed verification ran the optimized graph in onnxruntime: the written file is read back by onnx's
    checker only (a session holds ~2.7x the weights). Without it, onnxruntime loads the file, and the checker
    reads it too (onnxruntime runs files the checker rejects)."""
    loads = []
    real = verify.session
    monkeypatch.setattr(verify, "session", lambda model, load_only=False: loads.append(load_only) or real(model, load_only))
    checked = []
    real_check = onnx.checker.check_model
    monkeypatch.setattr(onnx.checker, "check_model", lambda m, *a, **k: checked.append(m) or real_check(m, *a, **k))
    onnx.save(weighted_model(), tmp_path / "m.onnx")
    k3opt.optimize_file(tmp_path / "m.onnx", tmp_path / "o.onnx", verify=verify_on)
    assert (True in loads) is not verify_on
    assert str(tmp_path / "o.onnx") not in [str(c) for c in checked]  # checked in its temporary folder
    assert any(isinstance(c, str) and c.endswith("o.onnx") for c in checked)
    assert (tmp_path / "o.onnx").exists()


def test_library_raises_and_keeps_an_existing_output(tmp_path, register):
    register(ReluToUnknownOp)
    onnx.save(relu_model(), tmp_path / "m.onnx")
    (tmp_path / "o.onnx").write_bytes(b"old")
    with pytest.raises(InvalidOutputError) as info:
        k3opt.optimize_file(tmp_path / "m.onnx", tmp_path / "o.onnx", overwrite=True,
                            passes=["test-relu-to-unknown-op"])
    assert info.value.exit_code == 1
    assert (tmp_path / "o.onnx").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "o.onnx"]


def test_check_sees_the_data_file_beside_the_model_under_its_final_name(tmp_path):
    seen = []

    def check(path: Path) -> None:
        seen.append((path.parent != tmp_path, sorted(p.name for p in path.parent.iterdir())))
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    modelio.save(weighted_model(), tmp_path / "o.onnx", external_data=True, check=check)
    assert seen == [(True, ["o.onnx", "o.onnx.data"])]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.onnx", "o.onnx.data"]


def test_failing_check_leaves_nothing(tmp_path):
    def check(path: Path) -> None:
        raise InvalidOutputError("no")

    with pytest.raises(InvalidOutputError):
        modelio.save(weighted_model(), tmp_path / "o.onnx", external_data=True, check=check)
    assert list(tmp_path.iterdir()) == []


def test_small_external_tensors_are_written_inline_so_the_output_loads(tmp_path):
    """onnxruntime's shape inference reads no data file: an Unsqueeze's axes kept outside fails the load."""
    model = make_model([helper.make_node("Unsqueeze", ["x", "axes"], ["u"]),
                        helper.make_node("MatMul", ["u", "w"], ["y"])],
                       [("x", TensorProto.FLOAT, [8])], [("y", TensorProto.FLOAT, [1, 8])],
                       {"axes": np.array([0], np.int64), "w": np.ones((8, 8), np.float32) * 0.5})
    save_external(model, tmp_path / "m.onnx", data_name="m.onnx.data")
    with pytest.raises(Exception, match="external"):  # the input itself does not load
        ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    k3opt.optimize_file(tmp_path / "m.onnx", tmp_path / "o.onnx", passes=[])
    saved = onnx.load(tmp_path / "o.onnx", load_external_data=False)
    assert {t.name: t.HasField("raw_data") for t in saved.graph.initializer} == {"axes": True, "w": True}
    x = np.arange(8, dtype=np.float32)
    got = ort.InferenceSession(str(tmp_path / "o.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(got[0], x[None] @ (np.ones((8, 8), np.float32) * 0.5))


def test_op_onnxruntime_lacks_falls_back_to_onnx_checker_with_a_warning(tmp_path):
    model = make_model([helper.make_node("Gelu", ["x"], ["y"], domain="my.ops")], [("x", TensorProto.FLOAT, [4])],
                       [("y", TensorProto.FLOAT, [4])], extra_opsets=[("my.ops", 1)])
    onnx.save(model, tmp_path / "m.onnx")
    assert check_loads(tmp_path / "m.onnx").startswith("the written model was checked with onnx's checker only")
    report = k3opt.optimize_file(tmp_path / "m.onnx", tmp_path / "o.onnx")
    assert (tmp_path / "o.onnx").exists()
    assert any("onnx's checker only" in w for w in report.warnings)


def test_onnx_checker_failure_after_the_fallback_is_refused(tmp_path, monkeypatch):
    def lacks_an_op(model, load_only):
        raise verify.Unrunnable("onnxruntime cannot run it: my.ops:Gelu(-1) is not a registered function/op")

    monkeypatch.setattr(verify, "session", lacks_an_op)
    model = make_model([helper.make_node("Gelu", ["x"], ["y"], domain="my.ops")], [("x", TensorProto.FLOAT, [4])],
                       [("y", TensorProto.FLOAT, [4])], extra_opsets=[("my.ops", 1)])
    model.graph.node.add().CopyFrom(helper.make_node("Gelu", ["x"], ["y"], domain="my.ops"))  # y written twice
    onnx.save(model, tmp_path / "m.onnx")
    with pytest.raises(InvalidOutputError, match="fails onnx's checker"):
        check_loads(tmp_path / "m.onnx")


def npu_model(extra_domain: bool = False, width: int = 8) -> onnx.ModelProto:
    """A cann-form model: an NPU op (NPURmsNorm) in the default domain at opset 17 (built unchecked: no schema)."""
    nodes = [helper.make_node("NPURmsNorm", ["x", "g"], ["y", "rstd"], epsilon=1e-6)]
    out = "y"
    imports = [helper.make_opsetid("", 17)]
    if extra_domain:
        nodes.append(helper.make_node("Foo", ["y"], ["z"], domain="my.ops"))
        imports.append(helper.make_opsetid("my.ops", 1))
        out = "z"
    graph = helper.make_graph(nodes, "npu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, width])],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, [2, width])],
                              [onnx.numpy_helper.from_array(np.ones(width, np.float32), "g")])
    return helper.make_model(graph, opset_imports=imports)


def test_cann_output_is_checked_by_the_checker_and_the_target_invariants(tmp_path):
    onnx.save(npu_model(), tmp_path / "good.onnx")
    with pytest.raises(InvalidOutputError, match="does not load"):  # onnxruntime has no NPU ops ...
        check_loads(tmp_path / "good.onnx")
    check_written(tmp_path / "good.onnx")  # ... the target's own checks stand in
    onnx.save(npu_model(extra_domain=True), tmp_path / "bad.onnx")
    with pytest.raises(InvalidOutputError, match="cann target's checks .*my.ops::Foo"):
        check_written(tmp_path / "bad.onnx")


def test_cann_check_refuses_a_truncated_data_file(tmp_path):
    model = npu_model(width=512)  # g goes to the data file
    modelio.save(model, tmp_path / "o.onnx", external_data=True)
    with open(tmp_path / "o.onnx.data", "r+b") as f:
        f.truncate(100)
    with pytest.raises(InvalidOutputError, match="does not read back"):
        check_written(tmp_path / "o.onnx")


def test_cann_check_reads_the_data_file_beside_the_output_not_the_current_folder(tmp_path, monkeypatch):
    """The checker looks for external data beside the written model, wherever the run started (it used to
    look in the current folder: a run from the input's folder judged the input's data file)."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    modelio.save(npu_model(width=512), out / "o.onnx", external_data=True)
    monkeypatch.chdir(elsewhere)
    check_written(out / "o.onnx")  # no o.onnx.data here: found beside the output
    (elsewhere / "o.onnx.data").write_bytes(b"")  # a stale namesake in the current folder is not looked at
    check_written(out / "o.onnx")
    assert sorted(p.name for p in out.iterdir()) == ["o.onnx", "o.onnx.data"]  # the checker's copy is gone


def test_nodes_of_one_name_are_renamed_so_the_output_loads(tmp_path):
    """onnxruntime refuses two nodes named alike (the input too); the output names the later one ``n_1``."""
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="n"), helper.make_node("Neg", ["a"], ["b"], name="n"),
             helper.make_node("Abs", ["b"], ["y"], name="n_1")]
    onnx.save(make_model(nodes, [("x", TensorProto.FLOAT, [2])], [("y", TensorProto.FLOAT, [2])]), tmp_path / "m.onnx")
    k3opt.optimize_file(tmp_path / "m.onnx", tmp_path / "o.onnx", passes=[])
    assert [n.name for n in onnx.load(tmp_path / "o.onnx").graph.node] == ["n", "n_2", "n_1"]
    got = ort.InferenceSession(str(tmp_path / "o.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"x": np.array([-1, 2], np.float32)})
    np.testing.assert_array_equal(got[0], [0, 2])


@pytest.mark.parametrize("as_proto", [False, True], ids=["path", "proto"])
def test_compile_checks_the_written_model_with_the_cann_checks(tmp_path, monkeypatch, tiny_transformer, as_proto):
    """Both compile paths (a model file through optimize_file, a proto saved by compile) run the cann check."""
    from k3opt.cann_bridge import AtcOptions, compile_model
    from k3opt.targets.cann import target_form

    seen = []

    def refuse(path: Path) -> None:
        seen.append(sorted(p.name for p in path.parent.iterdir()))
        raise InvalidOutputError("refused")

    monkeypatch.setattr(target_form, "check_written", refuse)
    model = onnx.load(tiny_transformer) if as_proto else tiny_transformer
    with pytest.raises(InvalidOutputError):
        compile_model(model, tmp_path / "m", AtcOptions(soc_version="Ascend910B3"), dry_run=True)
    assert seen == [["m.onnx"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == []
