"""Opset steps at which onnx's version converter leaves a node as it is, and the nodes it returns unchanged.

For most schema changes onnx registers its ``CompatibleAdapter``: the newer
schema only accepts more (types, optional inputs, attribute values), and the
adapter returns the node untouched. A node whose op crosses only such steps,
made only of fields the converter's own representation carries over as they
are, comes out of onnx's converter byte for byte as it went in: it need not
go through it (:func:`passes_through`). tests/test_opset_compatible.py checks
every entry of :data:`COMPATIBLE_UP` against onnx's converter.
"""
from __future__ import annotations

import functools

import onnx
from google.protobuf.unknown_fields import UnknownFieldSet

#: Upward steps (the version a step reaches) whose adapter in onnx's converter is its CompatibleAdapter, by the
#: ops they hold (onnx/version_converter/convert.h, onnx 1.23; GroupNormalization 20 -> 21, registered twice,
#: is left out, as are
#: steps to a version where the op has no schema of its own, which the converter never takes).
_STEPS_OPS: dict[tuple[int, ...], tuple[str, ...]] = {
    (11,): ("LogSoftmax", "NonMaxSuppression", "ReduceSum", "Softmax", "Split"),
    (13,): (
        "Abs", "Ceil", "Erf", "Exp", "Expand", "Floor", "GatherElements", "LRN", "Log", "MeanVarianceNormalization",
        "Neg", "NonZero", "Reciprocal", "Sigmoid", "Sign", "SoftmaxCrossEntropyLoss", "Sqrt", "Tanh", "Tile"),
    (14,): ("CumSum",),
    (15,): ("BatchNormalization",),
    (16,): ("GreaterOrEqual", "LeakyRelu", "LessOrEqual", "Where"),
    (20,): ("IsInf",),
    (21,): ("QLinearMatMul",),
    (22,): (
        "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "Bernoulli", "Cos", "Cosh", "DeformConv", "Det", "Elu",
        "EyeLike", "GRU", "GlobalAveragePool", "GlobalLpPool", "GlobalMaxPool", "GridSample", "HardSigmoid",
        "HardSwish", "InstanceNormalization", "LSTM", "LpNormalization", "MaxRoiPool", "Mish", "Multinomial", "RNN",
        "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "RoiAlign", "Round", "Selu", "Sin",
        "Sinh", "Softplus", "Softsign", "Tan", "ThresholdedRelu"),
    (24,): ("SplitToSequence",),
    (27,): ("Range",),
    (28,): ("BitShift", "Celu", "Einsum", "Optional", "ReverseSequence", "Unique"),
    (8, 13): ("Mean", "Sum"),
    (9, 13): ("Greater", "Less", "MatMul"),
    (11, 13): (
        "Concat", "Gather", "Hardmax", "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMean",
        "ReduceProd", "ReduceSumSquare", "Slice"),
    (11, 22): ("Conv", "ConvTranspose", "LpPool", "MaxUnpool"),
    (11, 24): ("TopK",),
    (11, 28): ("Compress", "OneHot"),
    (12, 13): ("Clip", "GatherND"),
    (13, 14): ("Add", "Div", "Mul", "Relu", "Sub"),
    (13, 20): ("IsNaN",),
    (13, 22): ("NegativeLogLikelihoodLoss",),
    (13, 28): ("Mod", "SpaceToDepth"),
    (18, 28): ("OptionalGetElement", "OptionalHasElement"),
    (24, 25): ("Attention",),
    (7, 9, 16): ("PRelu",),
    (8, 12, 13): ("Max", "Min"),
    (10, 13, 22): ("Dropout",),
    (11, 12, 13): ("ArgMax", "ArgMin"),
    (11, 13, 19): ("Equal",),
    (11, 13, 28): ("DepthToSpace",),
    (12, 13, 15): ("Pow",),
    (13, 16, 18): ("ScatterElements", "ScatterND"),
    (13, 18, 19): ("Resize",),
    (6, 9, 11, 13): ("Gemm",),
    (11, 12, 13, 20): ("ReduceMax", "ReduceMin"),
    (7, 10, 11, 19, 22): ("AveragePool",),
    (8, 10, 11, 12, 22): ("MaxPool",),
    (11, 21, 23, 24, 25): ("Squeeze", "Unsqueeze"),
    (13, 21, 23, 24, 25): ("Transpose",),
    (19, 21, 23, 24, 25): ("CastLike",),
    (20, 21, 23, 24, 25): ("ConstantOfShape",),
    (13, 19, 21, 23, 24, 25): ("Size",),
    (9, 11, 13, 21, 23, 24, 25): ("Flatten",),
    (11, 16, 19, 21, 23, 24, 25): ("Scan",),
    (13, 14, 19, 21, 23, 24, 25): ("Reshape",),
    (13, 15, 19, 21, 23, 24, 25): ("Shape",),
    (13, 18, 19, 21, 23, 24, 25): ("Pad",),
    (13, 19, 21, 23, 24, 25, 28): ("DequantizeLinear", "QuantizeLinear"),
    (9, 13, 19, 21, 23, 24, 25, 28): ("Cast",),
    (11, 13, 16, 19, 21, 23, 24, 25): ("If", "Loop"),
    (13, 14, 16, 19, 21, 23, 24, 25): ("Identity",),
    (9, 11, 12, 13, 19, 21, 23, 24, 25): ("Constant",),
}
COMPATIBLE_UP: dict[str, frozenset[int]] = {op: frozenset(steps) for steps, ops in _STEPS_OPS.items() for op in ops}

_A = onnx.AttributeProto
#: Attribute kinds carried over as they are, with the one field holding each kind's value (floats are left
#: out: the converter keeps them as doubles, which may quiet a signalling NaN).
_PLAIN_KINDS = {_A.INT: "i", _A.INTS: "ints", _A.STRING: "s", _A.STRINGS: "strings"}
#: NodeProto fields the converter writes back as it read them.
_NODE_FIELDS = frozenset(("input", "output", "name", "op_type", "domain", "attribute"))


@functools.lru_cache(maxsize=None)  # of onnx's built-in schemas: shared by runs and threads, never changes
def compatible_steps(op: str, current: int, wanted: int) -> bool:
    """Does default-domain ``op`` go from opset ``current`` up to ``wanted`` through compatible steps only
    (each schema version in between reached by a CompatibleAdapter)?"""
    steps = COMPATIBLE_UP.get(op)
    if steps is None or wanted <= current:
        return False
    version = wanted
    try:
        while True:
            since = onnx.defs.get_schema(op, version, "").since_version
            if since <= current:
                return True
            if since not in steps:
                return False
            version = since - 1
    except onnx.defs.SchemaError:  # the op does not exist at some version in between: the converter decides
        return False


def passes_through(node: onnx.NodeProto, current: int, wanted: int) -> bool:
    """Would onnx's converter, from opset ``current`` up to ``wanted``, give ``node`` back unchanged? True
    for a default-domain node of compatible steps only, every name given, attributes of plain kinds that
    the op at ``wanted`` still has, and no other field."""
    if node.domain not in ("", "ai.onnx") or not compatible_steps(node.op_type, current, wanted):
        return False
    if not {fd.name for fd, _ in node.ListFields()} <= _NODE_FIELDS or len(UnknownFieldSet(node)):
        return False
    if not all(node.input) or not all(node.output):
        return False
    if node.attribute:
        known = onnx.defs.get_schema(node.op_type, wanted, "").attributes
        return all(_plain_attribute(a) and a.name in known for a in node.attribute)
    return True


def _plain_attribute(attr: onnx.AttributeProto) -> bool:
    value = _PLAIN_KINDS.get(attr.type)
    return (value is not None and {fd.name for fd, _ in attr.ListFields()} <= {"name", "type", value}
            and not len(UnknownFieldSet(attr)))
