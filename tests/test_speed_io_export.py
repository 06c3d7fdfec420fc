"""The fast export writes numpy-valued constants in place, with exactly gs's bytes."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto

from k3opt.graph import gs_export

ARRAYS = {
    "float32": np.arange(6, dtype=np.float32).reshape(2, 3), "float64": np.array([1.5]), "float16": np.ones(3, np.float16),
    "int8": np.array([-1, 2], np.int8), "int16": np.array([3], np.int16), "int32": np.array([-4], np.int32),
    "int64": np.array([[5]], np.int64), "uint8": np.array([6], np.uint8), "uint16": np.array([7], np.uint16),
    "uint32": np.array([8], np.uint32), "uint64": np.array([2**63], np.uint64), "bool": np.array([True, False]),
    "scalar": np.array(2.0, np.float32), "empty": np.zeros((0, 4), np.float32),
    "big-endian": np.array([1, 2], dtype=">i4"), "non-contiguous": np.arange(12, dtype=np.int64).reshape(3, 4).T,
    "strings": np.array(["a", "bc"], dtype=object), "complex": np.array([1 + 2j], np.complex64),
}


def graph_reading(*constants: gs.Constant) -> gs.Graph:
    x = gs.Variable("x", dtype=np.float32, shape=[2])
    y = gs.Variable("y", dtype=np.float32, shape=[2])
    return gs.Graph(nodes=[gs.Node("Custom", inputs=[x, *constants], outputs=[y], domain="my")], inputs=[x],
                    outputs=[y], opset=17)


def gs_bytes(graph: gs.Graph) -> bytes:
    return gs.export_onnx(graph, do_type_check=False).SerializeToString()


@pytest.mark.parametrize("case", list(ARRAYS))
def test_array_constant_is_gs_bytes(case):
    graph = graph_reading(gs.Constant("a", np.array([0.5], np.float32)), gs.Constant(f"c_{case}", ARRAYS[case]),
                          gs.Constant("z", np.array([1], np.int64)))
    try:
        expected = gs_bytes(graph)
    except Exception as exc:  # gs refuses it: so must the fast export
        with pytest.raises(type(exc)):
            gs_export.export_onnx(graph)
        return
    assert gs_export.export_onnx(graph).SerializeToString() == expected


def test_data_location_export_dtype_and_empty_name():
    located = gs.Constant("loc", np.ones(2, np.float32), data_location=TensorProto.DEFAULT)
    same = gs.Constant("same", np.ones(2, np.float32), export_dtype=np.float32)
    graph = graph_reading(located, same, gs.Constant("", np.ones(1, np.int64)))
    assert gs_export.export_onnx(graph).SerializeToString() == gs_bytes(graph)


def test_another_export_dtype_is_left_to_gs():
    graph = graph_reading(gs.Constant("i", np.ones(2, np.int32), export_dtype=np.int64))
    with pytest.raises(AssertionError, match="Source dtype must be float32"):
        gs_bytes(graph)
    with pytest.raises(AssertionError, match="Source dtype must be float32"):
        gs_export.export_onnx(graph)


def test_a_domain_used_only_in_a_body_is_imported():
    """The import domains come from bodies too: gs adds one a branch's node uses."""
    x = gs.Variable("x", dtype=np.float32, shape=[2])
    inner = gs.Variable("inner", dtype=np.float32, shape=[2])
    branch = gs.Graph(nodes=[gs.Node("Custom", inputs=[x], outputs=[inner], domain="body.only")], outputs=[inner])
    cond = gs.Variable("cond", dtype=np.bool_, shape=[])
    y = gs.Variable("y", dtype=np.float32, shape=[2])
    graph = gs.Graph(nodes=[gs.Node("If", inputs=[cond], outputs=[y], attrs={"then_branch": branch, "else_branch": branch})],
                     inputs=[x, cond], outputs=[y], opset=17)
    ours = gs_export.export_onnx(graph)
    assert [o.domain for o in ours.opset_import] == ["", "body.only"]
    assert ours.SerializeToString() == gs_bytes(graph)


def test_imported_domains_are_kept_as_they_are():
    """The second export finds every domain imported already (the first added "my"): same bytes as gs."""
    graph = graph_reading(gs.Constant("c", np.ones(1, np.float32)))
    first = gs_export.export_onnx(graph).SerializeToString()
    assert gs_export.export_onnx(graph).SerializeToString() == first == gs_bytes(graph)
