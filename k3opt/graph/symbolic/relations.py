"""Relations a graph imposes between the symbolic dims of its inputs (what verification's inputs must agree on).

A light symbolic shape walk: every dim is a linear expression (:class:`Lin`)
over the graph inputs' symbols, and small integer tensors (the Shape ->
Gather -> Concat arithmetic of exports) are followed element by element. Ops
that require equal dims record an equation: broadcasting (Add, Where,
Expand... of two dims that are not 1), MatMul's contracted dims, Concat's
other axes; a Concat along an axis sums it (past + new of a KV cache). The
declared ``value_info``/output dims join in: a dim_param that reads as a sum
of input symbols (the dynamo exporter writes ``past_sequence + sequence``) or
names one symbol again ties the computed dim to it, equal dim_params being
one symbol.

The walk is deliberately partial: an op it does not know gives unknown
shapes, hence no equation. The equations are hints that
:mod:`k3opt.pipeline.verify_dims` solves and then checks by running the model.
"""
from __future__ import annotations

import re
from typing import Callable, Iterable, Mapping, Optional, Sequence, Union

import numpy as np
import onnx
from onnx import numpy_helper

Dim = Union[int, str]
_SMALL = 64  # integer constants up to this many elements are followed by value
_BIG = 2**62  # an end index at least this large means "to the end" (exports write INT64_MAX)


class Lin:
    """An integer linear expression ``const + sum(coeff * symbol)``; immutable, hashable."""

    __slots__ = ("terms", "const")

    def __init__(self, terms: Mapping[str, int] | Iterable[tuple[str, int]] = (), const: int = 0) -> None:
        items = terms.items() if isinstance(terms, Mapping) else terms
        self.terms = tuple(sorted((s, c) for s, c in items if c))
        self.const = int(const)

    @staticmethod
    def of(dim: Dim) -> "Lin":
        return Lin((), dim) if isinstance(dim, int) else Lin({dim: 1})

    def __add__(self, other: "Lin") -> "Lin":
        terms = dict(self.terms)
        for s, c in other.terms:
            terms[s] = terms.get(s, 0) + c
        return Lin(terms, self.const + other.const)

    def scale(self, k: int) -> "Lin":
        return Lin({s: c * k for s, c in self.terms}, self.const * k)

    def __sub__(self, other: "Lin") -> "Lin":
        return self + other.scale(-1)

    def exact_div(self, k: int) -> Optional["Lin"]:
        """``self / k`` when every coefficient divides (ONNX integer Div of a size), else None."""
        if k == 0 or any(c % k for _, c in self.terms) or self.const % k:
            return None
        return Lin({s: c // k for s, c in self.terms}, self.const // k)

    @property
    def is_const(self) -> bool:
        return not self.terms

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Lin) and self.terms == other.terms and self.const == other.const

    def __hash__(self) -> int:
        return hash((self.terms, self.const))

    def __repr__(self) -> str:
        parts = [f"{c}*{s}" if c != 1 else s for s, c in self.terms]
        return " + ".join(parts + ([str(self.const)] if self.const or not parts else []))


Shape = list[Optional[Lin]]
ONE = Lin((), 1)

_UNARY = {
    "Abs", "Acos", "Asin", "Atan", "BitwiseNot", "Cast", "CastLike", "Ceil", "Celu", "Cos", "Cosh", "CumSum",
    "Dropout", "Elu", "Erf", "Exp", "Floor", "Gelu", "HardSigmoid", "HardSwish", "Hardmax", "Identity",
    "InstanceNormalization", "IsInf", "IsNaN", "LayerNormalization", "LeakyRelu", "Log", "LogSoftmax", "LpNormalization",
    "Mish", "Neg", "Not", "Reciprocal", "Relu", "Round", "RMSNormalization", "Selu", "Shrink", "Sigmoid", "Sign",
    "SimplifiedLayerNormalization", "Sin", "Sinh", "Softmax", "Softplus", "Softsign", "Sqrt", "Tan", "Tanh",
    "ThresholdedRelu", "Trilu", "BatchNormalization",
}
_BROADCAST = {
    "Add", "And", "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "Div", "Equal", "Greater", "GreaterOrEqual",
    "Less", "LessOrEqual", "Max", "Mean", "Min", "Mod", "Mul", "Or", "Pow", "PRelu", "Sub", "Sum", "Where", "Xor",
}
_VALUE_PASSTHROUGH = {"Cast", "Identity", "Squeeze", "Unsqueeze", "Reshape", "Flatten", "CastLike"}


class Relations:
    """The equations (each ``Lin == 0``) the walk found, and the symbolic shapes it computed."""

    def __init__(self) -> None:
        self.equations: list[Lin] = []
        self.shapes: dict[str, Shape] = {}
        self.values: dict[str, list[Optional[Lin]]] = {}

    def equal(self, a: Optional[Lin], b: Optional[Lin]) -> None:
        """Record ``a == b`` unless one is unknown or it holds trivially."""
        if a is None or b is None or a == b:
            return
        diff = a - b
        if not diff.is_const:
            self.equations.append(diff)


def relations(graph: onnx.GraphProto, inputs: Mapping[str, Sequence[Dim]], aux_prefix: str = "~") -> Relations:
    """Walk ``graph`` (its nodes in order) from the input dims ``inputs`` (ints or symbols) and collect equations.

    Symbols of declared dims that are not input symbols are prefixed with
    ``aux_prefix``: the solver eliminates them and never sizes them.
    """
    rel = Relations()
    symbols = {d for dims in inputs.values() for d in dims if isinstance(d, str)}
    declared = _declared(graph, symbols, aux_prefix)
    for name, dims in inputs.items():
        rel.shapes[name] = [Lin.of(d) for d in dims]
    for t in graph.initializer:
        rel.shapes[t.name] = [Lin.of(int(d)) for d in t.dims]
        _constant_value(rel, t.name, t)
    for node in graph.node:
        try:
            _walk(rel, node)
        except (ValueError, IndexError, KeyError, TypeError, ZeroDivisionError, StopIteration, AttributeError):
            pass  # an odd node (missing input, unexpected attribute) gives unknown outputs, no equation
        for out in node.output:
            _tie(rel, out, declared.get(out))
    return rel


def _tie(rel: Relations, name: str, declared: Optional[Shape]) -> None:
    """Join a value's computed shape with its declared one (equations where both are known)."""
    if declared is None:
        return
    computed = rel.shapes.get(name)
    if computed is None or len(computed) != len(declared):
        rel.shapes[name] = list(declared)
        return
    for i, (c, d) in enumerate(zip(computed, declared)):
        rel.equal(c, d)
        if c is None:
            computed[i] = d


_TERM = re.compile(r"^\s*(?:(\d+)\s*\*\s*)?([A-Za-z_][\w.:/\[\]]*|\d+)\s*$")


def parse_dim(text: str, symbols: set[str], aux_prefix: str = "~") -> Optional[Lin]:
    """A dim_param like ``past_sequence + sequence`` or ``2*s - 1`` as a Lin; unknown names become aux symbols."""
    terms: dict[str, int] = {}
    const = 0
    for sign, body in re.findall(r"([+-]?)\s*([^+-]+)", text.strip()):
        m = _TERM.match(body)
        if not m:
            return None
        k = (-1 if sign == "-" else 1) * int(m.group(1) or 1)
        name = m.group(2)
        if name.isdigit():
            const += k * int(name)
        else:
            key = name if name in symbols else aux_prefix + name
            terms[key] = terms.get(key, 0) + k
    return Lin(terms, const) if terms or const else None


def _declared(graph: onnx.GraphProto, symbols: set[str], aux_prefix: str) -> dict[str, Shape]:
    out: dict[str, Shape] = {}
    for vi in list(graph.value_info) + list(graph.output):
        tt = vi.type.tensor_type
        if not tt.HasField("shape"):
            continue
        out[vi.name] = [Lin((), d.dim_value) if d.HasField("dim_value") and d.dim_value >= 0
                        else parse_dim(d.dim_param, symbols, aux_prefix) if d.dim_param else None
                        for d in tt.shape.dim]
    return out


def _constant_value(rel: Relations, name: str, tensor: onnx.TensorProto) -> None:
    if tensor.data_type not in (onnx.TensorProto.INT64, onnx.TensorProto.INT32) or len(tensor.dims) > 1:
        return
    if int(np.prod(tensor.dims)) > _SMALL or tensor.data_location == onnx.TensorProto.EXTERNAL:
        return
    try:
        values = numpy_helper.to_array(tensor).reshape(-1)
    except ValueError:  # its data does not fit its dims: unknown here, onnxruntime names the fault of the input
        return
    rel.values[name] = [Lin((), int(v)) for v in values]


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _const_ints(rel: Relations, name: str) -> Optional[list[int]]:
    vals = rel.values.get(name) if name else None
    if vals is None or any(v is None or not v.is_const for v in vals):
        return None
    return [v.const for v in vals]


def _axis(axis: int, rank: int) -> int:
    if not -rank <= axis < max(rank, 1):
        raise ValueError(f"axis {axis} out of range for rank {rank}")
    return axis + rank if axis < 0 else axis


def _broadcast(rel: Relations, shapes: Sequence[Optional[Shape]]) -> Optional[Shape]:
    """Numpy broadcasting of symbolic shapes; dims that are not 1 must be equal (recorded)."""
    if any(s is None for s in shapes):
        return None
    rank = max((len(s) for s in shapes), default=0)
    out: Shape = []
    for i in range(rank):
        dims = [s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0]
        known = [d for d in dims if d is not None and d != ONE]
        for d in known[1:]:
            rel.equal(known[0], d)
        if known:
            out.append(next((d for d in known if not d.is_const), known[0]))
        else:
            out.append(ONE if all(d == ONE for d in dims) else None)
    return out


def _product(dims: Sequence[Optional[Lin]]) -> Optional[Lin]:
    """Product of dims when at most one is not a constant (else not linear: None)."""
    const, var = 1, None
    for d in dims:
        if d is None:
            return None
        if d.is_const:
            const *= d.const
        elif var is None:
            var = d
        else:
            return None
    return ONE.scale(const) if var is None else var.scale(const)


def _reshape(shape: Optional[Shape], target: list[Optional[Lin]], allowzero: int) -> Shape:
    out = [shape[i] if (t is not None and t.is_const and t.const == 0 and not allowzero and shape is not None
                        and i < len(shape)) else t for i, t in enumerate(target)]
    holes = [i for i, t in enumerate(out) if t is not None and t.is_const and t.const == -1]
    if len(holes) == 1 and shape is not None:
        out[holes[0]] = _quotient(shape, [d for i, d in enumerate(out) if i != holes[0]])
    return out


def _quotient(numerator: Shape, denominator: Shape) -> Optional[Lin]:
    """prod(numerator) / prod(denominator) after cancelling equal factors, when that is linear."""
    num, den = list(numerator), list(denominator)
    for d in list(den):
        if d is not None and not d.is_const and d in num:
            num.remove(d)
            den.remove(d)
    top, bottom = _product(num), _product(den)
    if top is None or bottom is None or not bottom.is_const:
        return None
    return top.exact_div(bottom.const)


def _slice_dim(dim: Optional[Lin], start: int, end: int, step: int) -> Optional[Lin]:
    """The length of ``dim[start:end:step]`` for step 1, when it is linear in a symbolic ``dim``."""
    if dim is None:
        return None
    if dim.is_const:
        return Lin((), len(range(dim.const)[start:end:step]))
    if step != 1:
        return None
    end_at_dim = end >= _BIG
    if start >= 0 and end_at_dim:
        return dim - Lin((), start)
    if start < 0 and end_at_dim:
        return Lin((), -start)
    if start >= 0 and end < 0:
        return dim + Lin((), end - start)
    if 0 <= start <= end:
        return Lin((), end - start)  # assumes the dim is at least ``end`` long
    return None


#: ``(rel, node, shapes of its inputs, followed values of its inputs)``: records what ``node`` computes.
Walker = Callable[[Relations, onnx.NodeProto, list, list], None]


def _walk(rel: Relations, node: onnx.NodeProto) -> None:
    """Record the output shapes (and followed values) of ``node``, and the equations it imposes."""
    op = node.op_type
    walker = _WALKERS.get(op) or (_reduce if op.startswith("Reduce") else None)
    if walker is not None:
        walker(rel, node, [rel.shapes.get(i) if i else None for i in node.input],
               [rel.values.get(i) if i else None for i in node.input])


def _constant(rel: Relations, node: onnx.NodeProto, shp: list, val: list) -> None:
    out = node.output[0]
    t = _attr(node, "value")
    if isinstance(t, onnx.TensorProto):
        rel.shapes[out] = [Lin((), int(d)) for d in t.dims]
        _constant_value(rel, out, t)
    elif _attr(node, "value_ints") is not None:
        ints = list(_attr(node, "value_ints"))
        rel.shapes[out] = [Lin((), len(ints))]
        rel.values[out] = [Lin((), v) for v in ints]
    elif _attr(node, "value_int") is not None:
        rel.shapes[out] = []
        rel.values[out] = [Lin((), _attr(node, "value_int"))]


def _unary(rel: Relations, node: onnx.NodeProto, shp: list, val: list) -> None:
    """An op whose output has its input's shape (and, for a cast or copy, its values)."""
    if shp[0] is not None:
        rel.shapes[node.output[0]] = list(shp[0])
    if node.op_type in _VALUE_PASSTHROUGH and val[0] is not None:
        rel.values[node.output[0]] = list(val[0])


def _broadcasting(rel: Relations, node: onnx.NodeProto, shp: list, val: list) -> None:
    out = _broadcast(rel, shp)
    if out is not None:
        rel.shapes[node.output[0]] = out
    _value_arith(rel, node.op_type, val, node.output[0])


def _shape(rel: Relations, node: onnx.NodeProto, shp: list, val: list) -> None:
    if shp[0] is None:
        return
    rank = len(shp[0])
    start, end = _attr(node, "start", 0), _attr(node, "end", rank)
    dims = shp[0][slice(start, end)]
    rel.shapes[node.output[0]] = [Lin((), len(dims))]
    rel.values[node.output[0]] = list(dims)


def _size(rel: Relations, node: onnx.NodeProto, shp: list, val: list) -> None:
    rel.shapes[node.output[0]] = []


def _squeezing(rel: Relations, node: onnx.NodeProto, shp: list, val: list) -> None:
    """Unsqueeze and Squeeze: the values kept, the axes added or dropped."""
    ins, out = node.input, node.output[0]
    axes = _attr(node, "axes")
    axes = list(axes) if axes is not None else (_const_ints(rel, ins[1]) if len(ins) > 1 and ins[1] else None)
    if val[0] is not None:
        rel.values[out] = list(val[0])
    if shp[0] is None:
        return
    if node.op_type == "Squeeze":
        if axes is not None:
            drop = {_axis(a, len(shp[0])) for a in axes}
            rel.shapes[out] = [d for i, d in enumerate(shp[0]) if i not in drop]
        elif all(d is not None and d.is_const for d in shp[0]):
            rel.shapes[out] = [d for d in shp[0] if d != ONE]
    elif axes is not None:
        rank = len(shp[0]) + len(axes)
        add = {_axis(a, rank) for a in axes}
        rest = iter(shp[0])
        rel.shapes[out] = [ONE if i in add else next(rest) for i in range(rank)]


def _reshaped(rel: Relations, node: onnx.NodeProto, shp: list, val: list) -> None:
    out = node.output[0]
    if val[0] is not None:
        rel.values[out] = list(val[0])
    target = val[1] if len(val) > 1 else None
    if target is not None:
        dims = _reshape(shp[0], target, _attr(node, "allowzero", 0))
        rel.shapes[out] = dims
        if shp[0] is not None and all(d is not None for d in dims):  # the element count is kept
            rel.equal(_product(shp[0]), _product(dims))


def _flatten(rel: Relations, node: onnx.NodeProto, shp: list, val: list) -> None:
    if shp[0] is not None:
        axis = _axis(_attr(node, "axis", 1), len(shp[0]) + 1)
        rel.shapes[node.output[0]] = [_product(shp[0][:axis]), _product(shp[0][axis:])]


def _transpose(rel: Relations, node: onnx.NodeProto, shp: list, val: list) -> None:
    if shp[0] is not None:
        perm = _attr(node, "perm") or list(range(len(shp[0])))[::-1]
        rel.shapes[node.output[0]] = [shp[0][p] for p in perm]


def _gemm(rel: Relations, node: onnx.NodeProto, shp: list, val: list) -> None:
    a, b = shp[0], shp[1]
    if a is not None and b is not None and len(a) == len(b) == 2:
        a = a[::-1] if _attr(node, "transA", 0) else a
        b = b[::-1] if _attr(node, "transB", 0) else b
        rel.equal(a[1], b[0])
        rel.shapes[node.output[0]] = [a[0], b[1]]


def _gather_elements(rel: Relations, node: onnx.NodeProto, shp: list, val: list) -> None:
    if shp[1] is not None:
        rel.shapes[node.output[0]] = list(shp[1])


def _scatter(rel: Relations, node: onnx.NodeProto, shp: list, val: list) -> None:
    if shp[0] is not None:
        rel.shapes[node.output[0]] = list(shp[0])


def _expand(rel: Relations, node: onnx.NodeProto, shp: list, val: list) -> None:
    if len(val) > 1 and val[1] is not None and shp[0] is not None:
        out = _broadcast(rel, [shp[0], list(val[1])])
        if out is not None:  # a 1 in the target keeps the input's dim
            rel.shapes[node.output[0]] = out


def _constant_of_shape(rel: Relations, node: onnx.NodeProto, shp: list, val: list) -> None:
    if val[0] is not None:
        rel.shapes[node.output[0]] = list(val[0])


def _range(rel: Relations, node: onnx.NodeProto, shp: list, val: list) -> None:
    start, limit, delta = (v[0] if v is not None and len(v) == 1 else None for v in val[:3])
    if start is not None and limit is not None and delta is not None and delta.is_const and delta.const == 1:
        rel.shapes[node.output[0]] = [limit - start]


def _tile(rel: Relations, node: onnx.NodeProto, shp: list, val: list) -> None:
    ins = node.input
    reps = _const_ints(rel, ins[1]) if len(ins) > 1 else None
    if shp[0] is not None and reps is not None and len(reps) == len(shp[0]):
        rel.shapes[node.output[0]] = [None if d is None else d.scale(r) for d, r in zip(shp[0], reps)]


def _value_arith(rel: Relations, op: str, val: list, out: str) -> None:
    """Element-wise Add/Sub/Mul/Div of followed integer values (Mul and Div by a constant only)."""
    if op not in ("Add", "Sub", "Mul", "Div") or len(val) != 2 or val[0] is None or val[1] is None:
        return
    a, b = val
    if len(a) != len(b) and 1 not in (len(a), len(b)):
        return
    n = max(len(a), len(b))
    a, b = (a * n if len(a) == 1 else a), (b * n if len(b) == 1 else b)
    result: list[Optional[Lin]] = []
    for x, y in zip(a, b):
        if x is None or y is None:
            result.append(None)
        elif op == "Add":
            result.append(x + y)
        elif op == "Sub":
            result.append(x - y)
        elif op == "Mul":
            result.append(x.scale(y.const) if y.is_const else y.scale(x.const) if x.is_const else None)
        else:  # integer Div truncates: exact quotients of sizes only
            result.append(x.exact_div(y.const) if y.is_const and y.const > 0 else None)
    rel.values[out] = result


def _concat(rel: Relations, node: onnx.NodeProto, shp: list, val: list) -> None:
    out = node.output[0]
    if all(v is not None for v in val) and val:
        rel.values[out] = [x for v in val for x in v]
    known = [s for s in shp if s is not None]
    if len(known) != len(shp) or not known:
        return
    rank = len(known[0])
    if any(len(s) != rank for s in known):
        return
    axis = _axis(_attr(node, "axis"), rank)
    dims: Shape = []
    for i in range(rank):
        col = [s[i] for s in known]
        if i == axis:
            dims.append(None if any(d is None for d in col) else sum(col[1:], col[0]))
        else:
            first = next((d for d in col if d is not None), None)
            for d in col:
                rel.equal(first, d)
            dims.append(first)
    rel.shapes[out] = dims


def _split(rel: Relations, node: onnx.NodeProto, shp: list, val: list) -> None:
    outs = list(node.output)
    if shp[0] is None:
        return
    axis = _axis(_attr(node, "axis", 0), len(shp[0]))
    sizes = _attr(node, "split")
    sizes = list(sizes) if sizes is not None else (_const_ints(rel, node.input[1]) if len(node.input) > 1 and
                                                   node.input[1] else None)
    dim = shp[0][axis]
    if sizes is None and dim is not None:
        part = dim.exact_div(len(outs))
        sizes_lin = [part] * len(outs)
    elif sizes is not None:
        sizes_lin = [Lin((), s) for s in sizes]
        if dim is not None:
            rel.equal(dim, Lin((), sum(sizes)))
    else:
        return
    for o, s in zip(outs, sizes_lin):
        rel.shapes[o] = [s if i == axis else d for i, d in enumerate(shp[0])]


def _matmul(rel: Relations, node: onnx.NodeProto, shp: list, val: list) -> None:
    out = node.output[0]
    a, b = shp[0], shp[1]
    if a is None or b is None or not a or not b:
        return
    a2, b2 = (a if len(a) > 1 else [ONE] + a), (b if len(b) > 1 else b + [ONE])
    rel.equal(a2[-1], b2[-2])
    batch = _broadcast(rel, [a2[:-2], b2[:-2]])
    if batch is None:
        return
    rel.shapes[out] = batch + ([a2[-2]] if len(a) > 1 else []) + ([b2[-1]] if len(b) > 1 else [])


def _gather(rel: Relations, node: onnx.NodeProto, shp: list, val: list) -> None:
    ins, out = node.input, node.output[0]
    data, idx = shp[0], shp[1]
    axis = _attr(node, "axis", 0)
    if data is not None and idx is not None:
        a = _axis(axis, len(data))
        rel.shapes[out] = data[:a] + list(idx) + data[a + 1:]
    picks = _const_ints(rel, ins[1])
    if val[0] is not None and picks is not None and len(data or [None]) == 1:
        n = len(val[0])
        if all(-n <= p < n for p in picks):
            rel.values[out] = [val[0][p] for p in picks]


def _slice(rel: Relations, node: onnx.NodeProto, shp: list, val: list) -> None:
    ins, out = node.input, node.output[0]
    if len(ins) >= 3:
        starts, ends = _const_ints(rel, ins[1]), _const_ints(rel, ins[2])
        axes = _const_ints(rel, ins[3]) if len(ins) > 3 and ins[3] else None
        steps = _const_ints(rel, ins[4]) if len(ins) > 4 and ins[4] else None
    else:
        starts, ends, axes = _attr(node, "starts"), _attr(node, "ends"), _attr(node, "axes")
        starts, ends, axes, steps = (list(x) if x is not None else None for x in (starts, ends, axes, None))
    if starts is None or ends is None or shp[0] is None:
        return
    rank = len(shp[0])
    axes = axes if axes is not None else list(range(len(starts)))
    steps = steps if steps is not None else [1] * len(starts)
    dims = list(shp[0])
    for s, e, a, st in zip(starts, ends, axes, steps):
        a = _axis(a, rank)
        dims[a] = _slice_dim(dims[a], s, e, st)
    rel.shapes[out] = dims
    if val[0] is not None and rank == 1 and axes == [0]:
        rel.values[out] = list(val[0])[starts[0]:ends[0]:steps[0]]  # Python clamps as ONNX does


def _reduce(rel: Relations, node: onnx.NodeProto, shp: list, val: list) -> None:
    """A Reduce* (any ``Reduce`` op) or ArgMax/ArgMin: the reduced axes kept as 1 or dropped."""
    ins, out = node.input, node.output[0]
    if shp[0] is None:
        return
    keep = _attr(node, "keepdims", 1)
    if node.op_type in ("ArgMax", "ArgMin"):
        axes = [_attr(node, "axis", 0)]
    else:
        axes = _attr(node, "axes")
        axes = list(axes) if axes is not None else (_const_ints(rel, ins[1]) if len(ins) > 1 and ins[1] else None)
    if axes is None:
        if len(ins) > 1 and ins[1]:
            return  # axes computed at run time
        axes = list(range(len(shp[0])))
    drop = {_axis(a, len(shp[0])) for a in axes}
    rel.shapes[out] = [ONE if i in drop else d for i, d in enumerate(shp[0]) if keep or i not in drop]


#: The walker of each op (any other ``Reduce*`` op reduces too: :func:`_walk`); an op not here gives unknown
#: shapes and no equation.
_WALKERS: dict[str, Walker] = {
    **dict.fromkeys(_UNARY, _unary),
    **dict.fromkeys(_BROADCAST, _broadcasting),
    **dict.fromkeys(("Unsqueeze", "Squeeze"), _squeezing),
    **dict.fromkeys(("ScatterND", "ScatterElements", "Scatter"), _scatter),
    **dict.fromkeys(("ArgMax", "ArgMin"), _reduce),
    "Constant": _constant,
    "Shape": _shape,
    "Size": _size,
    "Reshape": _reshaped,
    "Flatten": _flatten,
    "Transpose": _transpose,
    "Concat": _concat,
    "Split": _split,
    "MatMul": _matmul,
    "Gemm": _gemm,
    "Gather": _gather,
    "GatherElements": _gather_elements,
    "Slice": _slice,
    "Expand": _expand,
    "ConstantOfShape": _constant_of_shape,
    "Range": _range,
    "Tile": _tile,
}
