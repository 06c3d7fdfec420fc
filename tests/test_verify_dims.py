"""Verification input sizes: relations between symbolic dims learned from the graph, solved, then searched."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

import k3opt
from k3opt.errors import UnverifiableError
from k3opt.pipeline import verify
from k3opt.cli import main
from k3opt.report import Report
from k3opt.graph.symbolic.relations import Lin, parse_dim, relations
from k3opt.pipeline.verify_dims import NoConsistentSizes, declared_dims
from tests.helpers import make_model, run_ort

F, I64 = TensorProto.FLOAT, TensorProto.INT64
HEADS, DIM = 2, 4


def attention_step(mask_form: str = "broadcast") -> onnx.ModelProto:
    """One attention step over a KV cache: k = Concat(past, new) on the cache axis, scores + mask, Softmax.

    ``broadcast``: the additive mask (batch, total) is broadcast against the
    scores (batch, heads, seq, past + seq), so the graph shows total = past + seq.
    ``gathered``: the mask is read at positions Range(0, past + seq) (what
    transformers' exports do), which no shape relation shows.
    """
    nodes = [helper.make_node("Concat", ["past", "k"], ["kc"], axis=2),
             helper.make_node("Transpose", ["kc"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["scores"]),
             helper.make_node("Cast", ["attention_mask"], ["mf"], to=F)]
    if mask_form == "broadcast":
        nodes += [helper.make_node("Unsqueeze", ["mf", "axes12"], ["m4"])]
    else:
        nodes += [helper.make_node("Shape", ["kc"], ["kshape"]),
                  helper.make_node("Gather", ["kshape", "two"], ["klen"]),
                  helper.make_node("Range", ["zero", "klen", "one"], ["kpos"]),
                  helper.make_node("Gather", ["mf", "kpos"], ["mk"], axis=1),
                  helper.make_node("Unsqueeze", ["mk", "axes12"], ["m4"])]
    nodes += [helper.make_node("Add", ["scores", "m4"], ["biased"]),
              helper.make_node("Softmax", ["biased"], ["probs"], axis=-1),
              helper.make_node("MatMul", ["probs", "kc"], ["y"])]
    inits = {"axes12": np.array([1, 2], dtype=np.int64), "two": np.array(2, dtype=np.int64),
             "zero": np.array(0, dtype=np.int64), "one": np.array(1, dtype=np.int64)}
    return make_model(nodes, [("q", F, ["batch", HEADS, "sequence", DIM]), ("k", F, ["batch", HEADS, "sequence", DIM]),
                              ("attention_mask", I64, ["batch", "total_sequence"]),
                              ("past", F, ["batch", HEADS, "past_sequence", DIM])],
                      [("y", F, ["batch", HEADS, "sequence", DIM])], inits)


def _optimize(model: onnx.ModelProto, **options) -> Report:
    report = Report()
    k3opt.optimize(model, verify=True, report=report, **options)
    return report


def _consistent(sizes: dict) -> bool:
    return sizes["total_sequence"] == sizes["past_sequence"] + sizes["sequence"]


def test_concat_and_broadcast_mask_give_total_as_sum() -> None:
    model = attention_step()
    rel = relations(model.graph, declared_dims(model))
    total_is_sum = Lin({"total_sequence": 1}) - Lin({"past_sequence": 1, "sequence": 1})
    assert any(e in (total_is_sum, total_is_sum.scale(-1)) for e in rel.equations)
    feeds = verify.make_feeds(model)  # no runner: the solved sizes alone
    assert feeds.sizes == {"batch": 2, "sequence": 2, "total_sequence": 4, "past_sequence": 2}
    assert feeds["attention_mask"].shape == (2, 4) and feeds["past"].shape == (2, HEADS, 2, DIM)
    run_ort(model, dict(feeds))


def test_hidden_relation_found_by_running() -> None:
    """The gathered mask: equal sizes fail in onnxruntime; the search finds total = past + sequence."""
    model = attention_step("gathered")
    assert verify.make_feeds(model).sizes["total_sequence"] == 2  # not learned from the graph
    sess = verify.session(model)
    feeds = verify.make_feeds(model, run=lambda f: verify.run(sess, f))
    assert _consistent(feeds.sizes) and feeds.tries > 1 and len(feeds.outputs) == 1
    np.testing.assert_array_equal(feeds.outputs[0], run_ort(model, dict(feeds))[0])


@pytest.mark.parametrize("form", ["broadcast", "gathered"])
def test_optimize_verifies_and_reports_sizes(form: str) -> None:
    report = _optimize(attention_step(form))
    assert report.verification["status"] == "passed" and _consistent(report.verification["sizes"])
    assert any(n.startswith("verification inputs sized batch=2, sequence=2, total_sequence=4") for n in report.notes)


@pytest.mark.parametrize("form", ["broadcast", "gathered"])
@pytest.mark.parametrize("pin,check", [
    ({"q": [1, HEADS, 1, DIM]}, lambda s: s["batch"] == 1 and s["sequence"] == 1),
    ({"attention_mask": [3, 9]}, lambda s: s["batch"] == 3 and s["total_sequence"] == 9),
    ({"past": [1, HEADS, 5, DIM]}, lambda s: s["past_sequence"] == 5),
])
def test_one_input_shape_pins_the_rest(form: str, pin: dict, check) -> None:
    report = _optimize(attention_step(form), input_shapes=pin)
    sizes = report.verification["sizes"]
    assert report.verification["status"] == "passed" and check(sizes)
    if form == "broadcast" or "attention_mask" not in pin:  # a pinned total can exceed past + new and still run
        assert _consistent(sizes)


def test_user_array_pins_its_symbols() -> None:
    ids = np.zeros((3, 6), dtype=np.int64)
    feeds = verify.make_feeds(attention_step(), input_data={"attention_mask": ids})
    assert feeds.sizes["batch"] == 3 and feeds.sizes["total_sequence"] == 6
    assert feeds["q"].shape[0] == 3 and feeds["past"].shape[2] + feeds["q"].shape[2] == 6


def _impossible() -> onnx.ModelProto:
    """Add(Concat(x, x), Concat(x, x, x)): 2n against 3n never broadcasts, whatever n."""
    nodes = [helper.make_node("Concat", ["x", "x"], ["x2"], axis=0),
             helper.make_node("Concat", ["x", "x", "x"], ["x3"], axis=0),
             helper.make_node("Add", ["x2", "x3"], ["y"])]
    return make_model(nodes, [("x", F, ["n"])], [("y", F, [None])])


def test_no_consistent_sizes_refuses_naming_the_options() -> None:
    """Verification that cannot run writes nothing (issue #26, item 5): it names the options that help."""
    model = _impossible()
    sess = verify.session(model)
    with pytest.raises(NoConsistentSizes) as err:
        verify.make_feeds(model, run=lambda f: verify.run(sess, f))
    assert err.value.tried and all(s["n"] >= 1 for s in err.value.tried)
    with pytest.raises(UnverifiableError) as refused:
        _optimize(model)
    text = str(refused.value)
    assert text.startswith("verification cannot run: onnxruntime failed on the original model at each of the")
    assert "--input-data" in text and "--input-shape" in text and "--no-verify" in text


def test_cli_refuses_and_prints_the_sizes(tmp_path) -> None:
    onnx.save(_impossible(), tmp_path / "bad.onnx")
    onnx.save(attention_step("gathered"), tmp_path / "good.onnx")
    runner = CliRunner()
    bad = runner.invoke(main, ["optimize", str(tmp_path / "bad.onnx"), "-o", str(tmp_path / "b.onnx")])
    assert bad.exit_code == 2 and "k3opt: error: verification cannot run" in bad.output
    assert "--input-shape NAME:D1,D2" in bad.output and not (tmp_path / "b.onnx").exists()
    good = runner.invoke(main, ["optimize", str(tmp_path / "good.onnx"), "-o", str(tmp_path / "g.onnx"),
                                "--input-shape", "q:1,2,1,4"])
    assert good.exit_code == 0, good.output
    assert "verification: passed" in good.output
    assert "verification inputs sized batch=1, sequence=1, total_sequence=3, past_sequence=2" in good.output


def test_static_model_that_fails_keeps_the_plain_reason() -> None:
    nodes = [helper.make_node("Gather", ["data", "idx"], ["y"])]
    model = make_model(nodes, [("idx", I64, [1])], [("y", F, [1])], {"data": np.zeros(3, np.float32)})
    sess = verify.session(model)
    with pytest.raises(NoConsistentSizes, match="^onnxruntime failed on the original model: "):
        verify.make_feeds(model, input_data={"idx": np.array([7])}, run=lambda f: verify.run(sess, f))


def test_reshape_keeps_the_element_count() -> None:
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["y"])]
    model = make_model(nodes, [("x", F, ["n"])], [("y", F, [5, 7])], {"shape": np.array([5, 7], dtype=np.int64)})
    assert verify.make_feeds(model).sizes == {"n": 35}


def test_unnamed_dims_and_disagreeing_pins_get_their_own_symbols() -> None:
    nodes = [helper.make_node("Identity", ["a"], ["y"]), helper.make_node("Identity", ["b"], ["z"])]
    model = make_model(nodes, [("a", F, ["n", None]), ("b", F, ["n"])], [("y", F, ["n", None]), ("z", F, ["n"])])
    assert declared_dims(model) == {"a": ["n", "a[1]"], "b": ["n"]}
    feeds = verify.make_feeds(model, input_data={"a": np.zeros((3, 1), np.float32), "b": np.zeros(4, np.float32)})
    assert feeds.sizes == {"n": 3, "a[1]": 1, "b[0]": 4}


@pytest.mark.parametrize("text,want", [
    ("past_sequence + sequence", Lin({"past_sequence": 1, "sequence": 1})),
    ("2*s - 1", Lin({"s": 2}, -1)),
    ("s0", Lin({"~s0": 1})),
    ("batch*sequence", None),
])
def test_parse_declared_dims(text: str, want) -> None:
    assert parse_dim(text, {"past_sequence", "sequence", "s"}) == want


def test_a_negative_input_dim_is_an_unknown_size() -> None:
    """Paddle exports write dim_value -1 for a run-time size: verification sizes it, never a numpy error."""
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [("x", F, [2, 3])], [("y", F, [2, 3])])
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = -1
    assert declared_dims(model) == {"x": ["x[0]", 3]}
    report = Report()
    k3opt.optimize(model, verify=True, report=report)
    assert report.verification["status"] == "passed"
