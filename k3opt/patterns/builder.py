"""Pattern graphs: what ``op.<OpType>(...)`` builds inside a rule's pattern function.

A pattern function ``def pattern(op, x, w): return op.Add(op.MatMul(x, w), 1.0)``
is called once, when the rule is created, with a :class:`PatternBuilder` and
one :class:`Var` per parameter after ``op``. The result is a small DAG of
value patterns that the matcher (``matcher.py``) walks from its output(s)
towards the inputs, so matching is anchored at the output node's op type.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import ml_dtypes
import numpy as np

#: Ops whose operands can be reordered without changing the result.
COMMUTATIVE_OPS = frozenset(
    {"Add", "Mul", "Sum", "Max", "Min", "Mean", "And", "Or", "Xor", "Equal",
     "BitwiseAnd", "BitwiseOr", "BitwiseXor"}
)


def _is_numeric(dtype: np.dtype) -> bool:
    """True for numpy numbers and bools, and for ml_dtypes' floats (bfloat16, float8) that numpy calls 'V'."""
    if np.issubdtype(dtype, np.number) or dtype == np.bool_:
        return True
    try:
        ml_dtypes.finfo(dtype)
    except ValueError:
        return False
    return True


class PatternError(ValueError):
    """A pattern function builds something the matcher cannot anchor or match."""


class ValuePattern:
    """Something that matches one tensor. ``key`` is what it binds (None: binds nothing)."""

    key: Any = None

    def children(self) -> Sequence["ValuePattern"]:
        return ()


@dataclasses.dataclass(eq=False)
class Var(ValuePattern):
    """Matches any tensor; every use of the same name must be the same tensor."""

    name: str

    @property
    def key(self) -> Any:
        return ("v", self.name)


@dataclasses.dataclass(eq=False)
class ConstantPattern(ValuePattern):
    """Matches a constant (initializer or Constant node) equal to ``value``.

    A scalar ``value`` matches a constant of size 1 and rank <= ``max_rank``
    (default 1: shapes ``()`` and ``(1,)``, which cannot broadcast the other
    operand to a higher rank). An array ``value`` needs the same shape.
    """

    value: np.ndarray
    name: Optional[str] = None
    rtol: float = 1e-6
    atol: float = 0.0
    max_rank: int = 1

    @property
    def key(self) -> Any:
        return ("v", self.name) if self.name else None

    def fits_shape(self, shape: tuple) -> bool:
        """Whether a constant of ``shape`` can be accepted at all (checked before its data is read)."""
        if self.value.ndim == 0:
            return len(shape) <= self.max_rank and int(np.prod(shape, dtype=np.int64)) == 1
        return tuple(shape) == self.value.shape

    def accepts(self, actual: np.ndarray) -> bool:
        actual = np.asarray(actual)
        if not _is_numeric(actual.dtype):
            return False
        if self.value.ndim == 0:
            if actual.size != 1 or actual.ndim > self.max_rank:
                return False
            have, want = float(actual.reshape(-1)[0]), float(self.value)
            return abs(have - want) <= self.atol + self.rtol * abs(want)
        if actual.shape != self.value.shape:
            return False
        return bool(np.allclose(actual.astype(np.float64), self.value, rtol=self.rtol, atol=self.atol))


@dataclasses.dataclass(eq=False)
class AnyConstantPattern(ValuePattern):
    """Matches any constant tensor; binds it under ``name`` when given."""

    name: Optional[str] = None

    @property
    def key(self) -> Any:
        return ("v", self.name) if self.name else None


@dataclasses.dataclass(eq=False)
class OrPattern(ValuePattern):
    """Matches the first alternative that matches (in order); ``m.which(name)`` says which: the alternative's
    name when they are named (``op.Or(plain=..., guarded=..., _name="probs")``), else its index."""

    alternatives: tuple[ValuePattern, ...]
    name: Optional[str] = None
    #: The alternatives' names, in order (None: unnamed, ``which`` gives the index).
    tags: Optional[tuple[str, ...]] = None

    def tag(self, i: int) -> "int | str":
        """What ``m.which`` answers when alternative ``i`` matched."""
        return i if self.tags is None else self.tags[i]

    @property
    def key(self) -> Any:
        return ("v", self.name) if self.name else None

    def children(self) -> Sequence[ValuePattern]:
        return self.alternatives


@dataclasses.dataclass(eq=False)
class NodePattern:
    """One node of the pattern: op type, domain, input patterns, required attribute values."""

    op_type: str
    domain: str
    inputs: tuple[Optional[ValuePattern], ...]
    attrs: dict[str, Any]
    label: Optional[str]
    n_outputs: int
    allow_other_inputs: bool
    commutative: bool
    outputs: tuple["NodeOutput", ...] = ()
    #: What a match below this node binds (filled by :func:`_fill_closures`, keys the failure memo):
    #: the ids of the node patterns, and the value keys.
    closure_nodes: tuple[int, ...] = ()
    closure_values: tuple = ()


@dataclasses.dataclass(eq=False)
class NodeOutput(ValuePattern):
    """Output ``index`` of a :class:`NodePattern`; ``name`` labels the output tensor."""

    node: NodePattern
    index: int
    name: Optional[str] = None

    @property
    def key(self) -> Any:
        return ("v", self.name) if self.name else None

    def children(self) -> Sequence[ValuePattern]:
        return [p for p in self.node.inputs if p is not None]


PatternLike = Union[ValuePattern, float, int, bool, np.ndarray, None]


def _as_pattern(x: PatternLike) -> Optional[ValuePattern]:
    """Python numbers and arrays in a pattern mean "a constant equal to this"."""
    if x is None or isinstance(x, ValuePattern):
        return x
    if isinstance(x, (int, float, bool, np.number, np.ndarray, list, tuple)):
        return ConstantPattern(np.asarray(x, dtype=np.float64))
    raise PatternError(f"pattern input {x!r} is not a pattern value, number or array")


def _normalize_attr(v: Any) -> Any:
    """Attribute values as compared: strings for bytes, tuples for lists and arrays."""
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, np.ndarray):
        v = v.tolist()
    if isinstance(v, (list, tuple)):
        return tuple(_normalize_attr(e) for e in v)
    return v


class PatternBuilder:
    """The ``op`` of a pattern function.

    ``op.MatMul(x, w, _name="mm")`` is a node pattern; special forms:
    ``op.Or(a, b, _name=None)`` alternatives (or named ones: ``op.Or(a=..., b=..., _name="k")``),
    ``op.Constant(2.0)`` a constant by value, ``op.AnyConstant("c")`` any constant, ``op.Var("x")`` a named value,
    and ``op.node("Or", a, b)`` for ONNX ops whose names these forms take.
    """

    def __getattr__(self, op_type: str) -> Callable[..., Any]:
        if op_type.startswith("_"):
            raise AttributeError(op_type)
        return lambda *inputs, **kw: self.node(op_type, *inputs, **kw)

    def node(
        self,
        op_type: str,
        *inputs: PatternLike,
        _name: Optional[str] = None,
        _domain: str = "",
        _outputs: Union[int, Sequence[Optional[str]]] = 1,
        _allow_other_inputs: bool = False,
        _commute: Optional[bool] = None,
        **attrs: Any,
    ) -> Union[NodeOutput, tuple[NodeOutput, ...]]:
        """A node pattern; returns its output (or a tuple of outputs when ``_outputs`` > 1).

        Attributes given must be equal (schema defaults filled in), or be a
        predicate ``callable(value) -> bool``; attributes not given match anything.
        """
        names = [None] * _outputs if isinstance(_outputs, int) else list(_outputs)
        node = NodePattern(
            op_type=op_type,
            domain="" if _domain == "ai.onnx" else _domain,
            inputs=tuple(_as_pattern(i) for i in inputs),
            attrs={k: (v if callable(v) else _normalize_attr(v)) for k, v in attrs.items()},
            label=_name,
            n_outputs=len(names),
            allow_other_inputs=_allow_other_inputs,
            commutative=op_type in COMMUTATIVE_OPS and not _domain if _commute is None else _commute,
        )
        node.outputs = tuple(NodeOutput(node, i, n) for i, n in enumerate(names))
        return node.outputs[0] if isinstance(_outputs, int) and _outputs == 1 else node.outputs

    def Or(self, *alternatives: PatternLike, _name: Optional[str] = None,  # noqa: N802
           **named: PatternLike) -> OrPattern:
        """The first of ``alternatives`` that matches; or of ``named`` ones (``op.Or(dropout=..., plain=...,
        _name="probs")``: ``m.which("probs")`` then answers the name, not an index)."""
        if alternatives and named:
            raise PatternError("op.Or takes its alternatives all positional or all named")
        tags = tuple(named) if named else None
        if named:
            alternatives = tuple(named.values())
        if len(alternatives) < 2:
            raise PatternError("op.Or needs at least two alternatives")
        if tags is not None and _name is None:
            raise PatternError("op.Or with named alternatives needs _name= (m.which(name) tells them apart)")
        return OrPattern(tuple(_as_pattern(a) for a in alternatives), _name, tags)

    def Constant(  # noqa: N802
        self, value: Any, *, name: Optional[str] = None, rtol: float = 1e-6, atol: float = 0.0, max_rank: int = 1
    ) -> ConstantPattern:
        return ConstantPattern(np.asarray(value, dtype=np.float64), name, rtol, atol, max_rank)

    def AnyConstant(self, name: Optional[str] = None) -> AnyConstantPattern:  # noqa: N802
        return AnyConstantPattern(name)

    def Var(self, name: str) -> Var:  # noqa: N802
        return Var(name)


@dataclasses.dataclass
class Pattern:
    """A built pattern: its output value patterns and the op types its root node can have."""

    outputs: tuple[ValuePattern, ...]
    anchors: frozenset[str]
    var_names: tuple[str, ...]
    node_count: int = 0

    def nodes(self) -> Iterator[NodePattern]:
        """Every node pattern, each once."""
        seen: set[int] = set()
        for p in _walk(self.outputs):
            if isinstance(p, NodeOutput) and id(p.node) not in seen:
                seen.add(id(p.node))
                yield p.node


def _walk(roots: Sequence[ValuePattern]) -> Iterator[ValuePattern]:
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        p = stack.pop()
        if id(p) in seen:
            continue
        seen.add(id(p))
        yield p
        stack.extend(p.children())


def _anchor_ops(p: ValuePattern) -> set[str]:
    if isinstance(p, NodeOutput):
        return {p.node.op_type}
    if isinstance(p, OrPattern):
        ops: set[str] = set()
        for alt in p.alternatives:
            ops |= _anchor_ops(alt)
        return ops
    raise PatternError("a pattern's output must be computed by a node (or an op.Or of such)")


def _fill_closures(outputs: Sequence[ValuePattern]) -> None:
    """Give each node pattern the binding keys of everything it reaches (for failure memoization)."""
    done: set[int] = set()
    for p in _walk(outputs):
        if isinstance(p, NodeOutput) and id(p.node) not in done:
            done.add(id(p.node))
            nodes: dict[int, None] = {}
            values: dict[Any, None] = {}
            for q in _walk(p.children()):
                if isinstance(q, NodeOutput):
                    nodes[id(q.node)] = None
                if q.key is not None:
                    values[q.key] = None
            p.node.closure_nodes, p.node.closure_values = tuple(nodes), tuple(values)


def build_pattern(fn: Callable[..., Any]) -> Pattern:
    """Call a pattern function with a builder and fresh variables; validate the result."""
    params = list(inspect.signature(fn).parameters)
    if not params:
        raise PatternError(f"pattern function {fn.__name__} must take `op` as first parameter")
    var_names = tuple(params[1:])
    result = fn(PatternBuilder(), *[Var(n) for n in var_names])
    outputs = tuple(result) if isinstance(result, (tuple, list)) else (result,)
    if not outputs or not all(isinstance(o, ValuePattern) for o in outputs):
        raise PatternError(f"pattern function {fn.__name__} must return pattern values")
    anchors = frozenset(_anchor_ops(outputs[0]))
    reachable = {id(q.node) for q in _walk(outputs[:1]) if isinstance(q, NodeOutput)}
    for extra in outputs[1:]:
        if not isinstance(extra, NodeOutput) or id(extra.node) not in reachable:
            raise PatternError(
                "every extra output of a multi-output pattern must come from a node inside the first output's pattern"
            )
    _fill_closures(outputs)
    pattern = Pattern(outputs, anchors, var_names)
    pattern.node_count = sum(1 for _ in pattern.nodes())
    return pattern
