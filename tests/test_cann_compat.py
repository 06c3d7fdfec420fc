"""The pre-flight check: unsupported ops by opset, opset imports, dynamic dims, input dtypes."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from k3opt.cann_bridge.atc_command import parse_input_shape
from k3opt.targets.cann.atc_ops import ATC_PARSERS, NPU_OPS
from k3opt.targets.cann.compat import check_model
from tests.helpers import make_model

F = TensorProto.FLOAT


def relu_model(opset=17, shape=(1, 4), dtype=F, extra_nodes=(), extra_opsets=()):
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="relu"), *extra_nodes]
    return make_model(nodes, [("x", dtype, list(shape))], [("y", dtype, list(shape))], opset=opset,
                      extra_opsets=extra_opsets)


def unchecked_model(nodes, inputs, outputs, opset=17):
    """A model onnx's checker would refuse (ops it does not know at this opset): the check must still see it."""
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_tensor_value_info(*o) for o in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_clean_model_has_no_findings():
    assert check_model(relu_model()) == []


def test_table_facts_from_the_reference():
    assert ATC_PARSERS["LayerNormalization"] == frozenset({17, 18})
    assert 17 not in ATC_PARSERS["NPUPromptFlashAttention"] and 19 in ATC_PARSERS["NPUPromptFlashAttention"]
    assert ATC_PARSERS["Softmax"] == frozenset(range(9, 19)) and ATC_PARSERS["Trilu"] == frozenset(range(14, 19))
    assert {"NPURmsNorm", "NPUAddRmsNorm"} <= NPU_OPS
    for op in ("Gelu", "RMSNormalization", "Attention"):
        assert op not in ATC_PARSERS


def test_unsupported_ops_listed_by_type_domain_and_opset():
    nodes = [helper.make_node("Gelu", ["y"], ["g1"], name="gelu_a"), helper.make_node("Gelu", ["y"], ["g2"], name="gelu_b"),
             helper.make_node("FastGelu", ["y"], ["g3"], name="fg", domain="com.microsoft")]
    model = make_model([helper.make_node("Relu", ["x"], ["y"], name="relu"), *nodes],
                       [("x", F, [1, 4])], [("g1", F, [1, 4]), ("g2", F, [1, 4]), ("g3", F, [1, 4])],
                       opset=20, extra_opsets=[("com.microsoft", 1)])
    found = [str(f) for f in check_model(model)]
    assert "op: ai.onnx::20::Gelu x2 (gelu_a, gelu_b): not in k3opt's table of ATC parsers" in found
    assert "op: com.microsoft::20::FastGelu x1 (fg): domain com.microsoft has no ATC parsers" in found
    assert any(f.startswith("opset: 2 opset imports") and "E16005" in f for f in found)
    assert any(f.startswith("opset: default-domain opset 20 is outside") for f in found)
    # Relu has a parser, but not at opset 20: every node of it is listed with the opsets that work.
    assert "op: ai.onnx::20::Relu x1 (relu): ATC parses it only at opsets 9..18" in found


def test_op_parsed_only_at_some_opsets():
    ln = helper.make_node("LayerNormalization", ["x", "s"], ["y"], name="ln", axis=-1)
    model = make_model([ln], [("x", F, [1, 4])], [("y", F, [1, 4])], {"s": np.ones(4, np.float32)}, opset=17)
    assert check_model(model) == []
    pfa = helper.make_node("NPUPromptFlashAttention", ["x", "x", "x"], ["y"], name="pfa", num_heads=1,
                           input_layout="BSH")
    model = unchecked_model([pfa], [("x", F, [1, 4])], [("y", F, [1, 4])])
    assert [str(f) for f in check_model(model)] == [
        "op: ai.onnx::17::NPUPromptFlashAttention x1 (pfa): ATC parses it only at opsets 11..16, 19"]


def test_nodes_inside_subgraphs_are_checked():
    then = helper.make_graph([helper.make_node("Gelu", ["x"], ["t"], name="inner")], "then", [],
                             [helper.make_tensor_value_info("t", F, [1, 4])])
    other = helper.make_graph([helper.make_node("Relu", ["x"], ["e"], name="inner_relu")], "else", [],
                              [helper.make_tensor_value_info("e", F, [1, 4])])
    node = helper.make_node("If", ["c"], ["y"], name="if", then_branch=then, else_branch=other)
    model = unchecked_model([node], [("c", TensorProto.BOOL, []), ("x", F, [1, 4])], [("y", F, [1, 4])])
    assert [f.message for f in check_model(model)] == [
        "ai.onnx::17::Gelu x1 (inner): not in k3opt's table of ATC parsers"]


def test_dynamic_dims_need_input_shape():
    model = relu_model(shape=("batch", 128))
    found = check_model(model)
    assert [str(f) for f in found] == ["dynamic: input 'x' [batch, 128] has dynamic dims and no --input-shape "
                                       "(e.g. --input-shape x:1,128)"]
    assert check_model(model, [parse_input_shape("x:1,128")]) == []
    assert check_model(model, [parse_input_shape("x:-1,128")], dynamic_option="dynamic_batch_size") == []
    assert "no --dynamic-dims" in check_model(model, [parse_input_shape("x:-1,128")])[0].message
    assert "has rank 3" in check_model(model, [parse_input_shape("x:1,1,128")])[0].message
    assert "not a graph input" in check_model(model, [parse_input_shape("x:1,128"), parse_input_shape("z:1")])[0].message


def test_rejected_input_dtypes():
    model = relu_model()
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.STRING
    assert [str(f) for f in check_model(model)] == ["dtype: input 'x' has dtype STRING, which ATC does not accept"]
    for ok in (TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.INT64, TensorProto.BOOL):
        model.graph.input[0].type.tensor_type.elem_type = ok
        assert check_model(model) == []


def _flash_model(opset, domain="", imports=()):
    pfa = helper.make_node("NPUPromptFlashAttention", ["x", "x", "x"], ["y"], name="pfa", num_heads=1,
                           input_layout="BSH", domain=domain)
    ifa = helper.make_node("NPUIncreFlashAttention", ["y", "x", "x", "", "", ""], ["z"], name="ifa", num_heads=1,
                           input_layout="BSH", domain=domain)
    graph = helper.make_graph([pfa, ifa], "g", [helper.make_tensor_value_info("x", F, [1, 1, 4])],
                              [helper.make_tensor_value_info("z", F, [1, 1, 4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                   *(helper.make_opsetid(d, v) for d, v in imports)])


def test_both_flash_attention_forms_parse():
    """ai.onnx::16 (default domain) and npu::1 (torch_npu's form, two imports) are both registered."""
    assert check_model(_flash_model(16)) == []
    assert check_model(_flash_model(17, "npu", [("npu", 1)])) == []
    found = [str(f) for f in check_model(_flash_model(17))]
    assert "op: ai.onnx::17::NPUIncreFlashAttention x1 (ifa): ATC parses it only at opsets 11..16, 19" in found
    found = [str(f) for f in check_model(_flash_model(17, "npu"))]
    assert any("npu::1::NPUPromptFlashAttention x1 (pfa): the model has no npu:1 opset import" in f for f in found)
    bad = _flash_model(17, "npu", [("npu", 1)])
    bad.graph.node[1].op_type = "NPUFusedAttentionScore"
    found = [str(f) for f in check_model(bad)]
    assert any(f.startswith("op: npu::1::NPUFusedAttentionScore x1 (ifa): ATC registers npu::1 only for")
               for f in found)
    found = [str(f) for f in check_model(_flash_model(17, "npu", [("npu", 2)]))]
    assert any(f.startswith("opset: 2 opset imports") for f in found)
