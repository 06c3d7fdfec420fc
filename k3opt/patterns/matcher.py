"""Structural matching of a pattern at one anchor tensor, by backtracking.

The matcher walks from the pattern's output towards its inputs following
producer links (``tensor.inputs``), so one attempt costs O(pattern size)
in the usual case. Commutative nodes try both operand orders, but only
orders whose operands can match structurally (op type of the producer,
constant-ness), and a sub-pattern that failed at a graph node under the
same relevant bindings is never retried (failure memo), so operand orders
do not multiply into 2^k attempts. A step budget bounds pathological cases.

Matches are generated lazily: the caller checks escaping intermediates and
the rule's check on each, and asks for the next only if those refuse.
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Iterator, Optional

import numpy as np
from .. import graph as gs

from ..graph.ir import Node, Tensor, const_tensor, const_value, is_const, producer
from .builder import (
    AnyConstantPattern,
    ConstantPattern,
    NodeOutput,
    NodePattern,
    OrPattern,
    Pattern,
    ValuePattern,
    Var,
    _walk,
)
from .schema import MISSING, attr_value

#: Most pattern-node visits one anchor may cost before the matcher gives up on it.
STEP_BUDGET = 20000


def is_empty(t: Optional[Tensor]) -> bool:
    """An omitted optional input (gs writes it as a nameless tensor without producer)."""
    return t is None or (not t.name and not t.inputs and not is_const(t))


def describe(n: Node) -> str:
    """How messages name a node: its name, or (unnamed) the tensor it computes."""
    return f"node '{n.name}' ({n.op})" if n.name else f"the {n.op} computing '{n.outputs[0].name if n.outputs else ''}'"


def _show(value: np.ndarray) -> str:
    if value.size > 8:
        return f"a {value.dtype} tensor of shape {value.shape}"
    text = ", ".join(f"{float(v):.7g}" if np.issubdtype(value.dtype, np.floating) else str(v) for v in value.reshape(-1))
    return text if value.ndim == 0 else f"[{text}]"


def node_inputs(n: Node) -> list[Tensor]:
    """The node's inputs without trailing omitted optional ones."""
    inputs = list(n.inputs)
    while inputs and is_empty(inputs[-1]):
        inputs.pop()
    return inputs


def attr_equal(want: Any, have: Any) -> bool:
    """Attribute comparison: lists as tuples, floats with float32 rounding tolerance."""
    if callable(want):
        return bool(want(have))
    if have is MISSING:
        return False
    if isinstance(have, bytes):
        have = have.decode()
    if isinstance(want, tuple):
        have = tuple(np.asarray(have).ravel().tolist()) if isinstance(have, (list, tuple, np.ndarray)) else None
        return have is not None and len(have) == len(want) and all(attr_equal(w, h) for w, h in zip(want, have))
    if isinstance(want, float) or isinstance(have, float):
        try:
            return math.isclose(float(want), float(have), rel_tol=1e-6, abs_tol=0.0)
        except (TypeError, ValueError):
            return False
    return want == have


class State:
    """Bindings of one (partial) match: values by key, graph nodes by node pattern."""

    def __init__(self) -> None:
        self.values: dict[Any, Tensor] = {}
        self.nodes: dict[int, tuple[NodePattern, Node]] = {}
        self.node_ids: dict[int, int] = {}  # id(node pattern) -> id(graph node), for the failure memo
        self.used: set[int] = set()
        self.which: dict[str, "int | str"] = {}
        self.root: Optional[Tensor] = None

    def bound(self, key: Any) -> Any:
        if isinstance(key, NodePattern):
            entry = self.nodes.get(id(key))
            return entry[1] if entry else None
        return self.values.get(key)


class Matcher:
    """Generates the structural matches of ``pattern`` at a tensor."""

    def __init__(self, pattern: Pattern, opset: int, trace: Optional[Callable[[int, str], None]] = None):
        self.pattern = pattern
        self.opset = opset
        self.trace = trace  # debug: trace(depth, reason) at each refusal
        self.s = State()
        self._failed: dict[tuple, set] = {}  # (pattern node, graph node) -> binding states that failed
        self._impure = 0
        self._steps = 0
        self._may: dict[int, tuple[bool, bool, frozenset]] = {}
        for p in _walk(pattern.outputs):
            _summarize(p, self._may)
        self._roots = _alternatives(pattern.outputs[0])
        #: (id(constant pattern), id(initializer)) -> (initializer, accepted), kept for this matcher's sweep
        self._initializers: dict[tuple[int, int], tuple[Tensor, bool]] = {}

    def matches(self, root: Tensor) -> Iterator[State]:
        """Each full structural match rooted at ``root`` (the pattern's first output)."""
        if self.trace is None and not self._may_root(root):
            return  # (when tracing, the walk runs to explain the refusal)
        self.s = State()
        self._failed = {}
        self._steps = 0
        first, extra = self.pattern.outputs[0], self.pattern.outputs[1:]
        for _ in self._value(first, root):
            added = self._bind_extra_outputs(extra)
            if added is not None:
                yield self.s
                for key in added:
                    del self.s.values[key]

    def _bind_extra_outputs(self, extra: tuple) -> Optional[list]:
        """Bind the labels of a multi-output pattern's other outputs; None if one is missing."""
        added = []
        for p in extra:
            node = self.s.bound(p.node)
            if node is None or p.index >= len(node.outputs):
                for key in added:
                    del self.s.values[key]
                self._fail(f"{p.node.op_type} has no output {p.index}")
                return None
            if p.key is not None and p.key not in self.s.values:
                self.s.values[p.key] = node.outputs[p.index]
                added.append(p.key)
        return added

    def _fail(self, reason: str) -> bool:
        if self.trace is not None:
            self.trace(len(self.s.nodes), reason)
        return False

    # -- one generator per kind of value pattern; each binds before yielding and unbinds after.

    def _value(self, p: Optional[ValuePattern], t: Tensor) -> Iterator[None]:
        self._steps += 1
        if self._steps > STEP_BUDGET:
            self._fail("search budget exhausted")
            return
        if p is None:
            if is_empty(t):
                yield
            else:
                self._fail(f"expected an omitted input, got '{t.name}'")
            return
        key = p.key
        if key is not None and key in self.s.values:
            if self.s.values[key] is t:
                yield
            else:
                self._fail(f"'{key[1]}' is bound to '{self.s.values[key].name}', here it would be '{t.name}'")
            return
        if isinstance(p, Var):  # the most common case, without a nested generator
            self.s.values[key] = t
            yield
            del self.s.values[key]
            return
        if isinstance(p, NodeOutput):
            inner = self._node_output(p, t)
        elif isinstance(p, ConstantPattern):
            inner = self._constant(p, t)
        elif isinstance(p, AnyConstantPattern):
            inner = iter((None,)) if is_const(t) else self._refuse(f"'{t.name}' is not a constant")
        else:
            assert isinstance(p, OrPattern)
            inner = self._or(p, t)
        for _ in inner:
            if key is not None:
                self.s.values[key] = t
            yield
            if key is not None:
                del self.s.values[key]

    def _refuse(self, reason: str) -> Iterator[None]:
        self._fail(reason)
        return iter(())

    def _constant(self, p: ConstantPattern, t: Tensor) -> Iterator[None]:
        if self.trace is None and isinstance(t, gs.Constant):  # an initializer's value is read once per sweep
            key = (id(p), id(t))
            hit = self._initializers.get(key)
            if hit is None:
                hit = self._initializers[key] = (t, any(True for _ in self._read_constant(p, t)))
            if hit[1]:
                yield
            return
        yield from self._read_constant(p, t)

    def _read_constant(self, p: ConstantPattern, t: Tensor) -> Iterator[None]:
        c = const_tensor(t)
        if c is not None and not p.fits_shape(tuple(c.shape)):  # size it up before reading it
            self._fail(f"constant '{t.name}' has shape {tuple(c.shape)}, expected {_show(p.value)}")
            return
        value = const_value(t) if c is not None else None
        if value is None:
            self._fail(f"'{t.name}' is not a constant (expected {_show(p.value)})")
        elif not p.accepts(value):
            self._fail(f"constant '{t.name}' is {_show(value)}, expected {_show(p.value)}")
        else:
            yield

    def _or(self, p: OrPattern, t: Tensor) -> Iterator[None]:
        for i, alt in enumerate(p.alternatives):
            for _ in self._value(alt, t):
                if p.name:
                    self.s.which[p.name] = p.tag(i)
                yield
                if p.name:  # backtracking out of this alternative: no longer part of the match
                    del self.s.which[p.name]

    def _node_output(self, p: NodeOutput, t: Tensor) -> Iterator[None]:
        np_ = p.node
        n = producer(t)
        if n is None:
            self._fail(f"'{t.name}' is not computed by a node (expected {np_.op_type})")
            return
        bound = self.s.bound(np_)
        if bound is not None:
            if bound is n and p.index < len(n.outputs) and n.outputs[p.index] is t:
                yield
            else:
                self._fail(f"{np_.op_type} pattern node is already matched to {describe(bound)}, not {describe(n)}")
            return
        if p.index >= len(n.outputs) or n.outputs[p.index] is not t:
            self._fail(f"'{t.name}' is not output {p.index} of {describe(n)}")
            return
        if id(n) in self.s.used:
            self._impure += 1
            self._fail(f"{describe(n)} is already matched by another pattern node")
            return
        pair = (id(np_), id(n))
        failed_before = self._failed.get(pair)
        if failed_before is not None and self._bindings(np_) in failed_before:
            return
        impure_before, found = self._impure, False
        if self._header(np_, n):
            inputs = node_inputs(n)
            self.s.nodes[id(np_)] = (np_, n)
            self.s.node_ids[id(np_)] = id(n)
            self.s.used.add(id(n))
            for order in self._orders(np_, inputs):
                pairs = [(np_.inputs[i], inputs[j]) for i, j in enumerate(order)]
                for _ in self._inputs(pairs, 0):
                    found = True
                    yield
            del self.s.nodes[id(np_)]
            del self.s.node_ids[id(np_)]
            self.s.used.discard(id(n))
        if not found and self._impure == impure_before:
            self._failed.setdefault(pair, set()).add(self._bindings(np_))

    def _bindings(self, p: NodePattern) -> tuple:
        """What a sub-pattern's outcome can depend on: the current bindings of everything under it."""
        s = self.s
        return tuple(map(s.node_ids.get, p.closure_nodes)), tuple(map(id, map(s.values.get, p.closure_values)))

    def _inputs(self, pairs: list, i: int) -> Iterator[None]:
        if i == len(pairs):
            yield
            return
        p, t = pairs[i]
        for _ in self._value(p, t):
            yield from self._inputs(pairs, i + 1)

    def _header(self, p: NodePattern, n: Node) -> bool:
        """Op type, domain, arity and attributes (with schema defaults)."""
        if n.op != p.op_type:
            return self._fail(f"{describe(n)}: expected op {p.op_type}")
        domain = "" if n.domain in (None, "ai.onnx") else n.domain
        if domain != p.domain:
            return self._fail(f"{describe(n)}: domain '{domain}', expected '{p.domain}'")
        n_in = len(node_inputs(n))
        if n_in != len(p.inputs) and not (p.allow_other_inputs and n_in >= len(p.inputs)):
            return self._fail(f"{describe(n)}: has {n_in} inputs, pattern has {len(p.inputs)}")
        if len(n.outputs) < p.n_outputs:
            return self._fail(f"{describe(n)}: has {len(n.outputs)} outputs, pattern needs {p.n_outputs}")
        for name, want in p.attrs.items():
            have = attr_value(n.attrs, n.op, domain, self.opset, name)
            if not attr_equal(want, have):
                shown = "a predicate" if callable(want) else repr(want)
                return self._fail(f"{describe(n)}: attribute {name}={have!r}, expected {shown}")
        return True

    def _orders(self, p: NodePattern, inputs: list[Tensor]) -> list[tuple[int, ...]]:
        """Operand orders worth trying: identity, plus for commutative ops those that fit structurally."""
        k = len(p.inputs)
        if not p.commutative or k < 2 or k > 4 or len(inputs) != k:
            return [tuple(range(len(p.inputs)))]
        if k == 2:
            orders = [(0, 1)] if self._may_match(p.inputs[0], inputs[0]) and self._may_match(p.inputs[1], inputs[1]) \
                else []
            if inputs[0] is not inputs[1] and self._may_match(p.inputs[0], inputs[1]) and \
                    self._may_match(p.inputs[1], inputs[0]):
                orders.append((1, 0))
            return orders
        orders, seen = [], set()
        for perm in itertools.permutations(range(k)):
            operands = tuple(id(inputs[j]) for j in perm)
            if operands in seen:
                continue  # the same tensor twice: swapping it gives the same order
            seen.add(operands)
            if all(self._may_match(p.inputs[i], inputs[j]) for i, j in enumerate(perm)):
                orders.append(perm)
        return orders

    def _may_root(self, t: Tensor) -> bool:
        """Cheap necessary condition for a match at ``t``: a root alternative's op computes ``t`` with as many
        inputs, and its operands pass :meth:`_may_match` in an order the matcher would try.
        """
        n = producer(t)
        if n is None:
            return False
        inputs = None
        for p in self._roots:
            np_ = p.node
            if n.op != np_.op_type or p.index >= len(n.outputs) or n.outputs[p.index] is not t:
                continue
            if inputs is None:
                inputs = node_inputs(n)
            k = len(np_.inputs)
            if len(inputs) != k and not (np_.allow_other_inputs and len(inputs) >= k):
                continue
            for order in self._orders(np_, inputs):
                if all(self._may_match(np_.inputs[i], inputs[j]) for i, j in enumerate(order)):
                    return True
        return False

    def _may_match(self, p: Optional[ValuePattern], t: Tensor) -> bool:
        """Cheap structural filter: could ``p`` match ``t`` at all? (See :func:`_summarize`.)"""
        if p is None:
            return True
        anything, constant, ops = self._may[id(p)]
        if anything or (constant and is_const(t)):
            return True
        n = producer(t)
        return n is not None and n.op in ops


def _alternatives(p: ValuePattern) -> list[NodeOutput]:
    """The node outputs a root pattern can be, through nested ``op.Or`` (build_pattern allows nothing else)."""
    if isinstance(p, OrPattern):
        return [q for alt in p.alternatives for q in _alternatives(alt)]
    assert isinstance(p, NodeOutput)
    return [p]


def _summarize(p: ValuePattern, into: dict[int, tuple[bool, bool, frozenset]]) -> tuple[bool, bool, frozenset]:
    """What ``p`` can match at all: (any tensor, a constant, the output of a node of these op types).

    ``op.Or`` combines its alternatives', so the filter costs the same whatever the nesting.
    """
    known = into.get(id(p))
    if known is not None:
        return known
    if isinstance(p, Var):
        summary = (True, False, frozenset())
    elif isinstance(p, (ConstantPattern, AnyConstantPattern)):
        summary = (False, True, frozenset())
    elif isinstance(p, NodeOutput):
        summary = (False, False, frozenset((p.node.op_type,)))
    else:
        assert isinstance(p, OrPattern)
        parts = [(True, False, frozenset()) if a is None else _summarize(a, into) for a in p.alternatives]
        summary = (any(a for a, _, _ in parts), any(c for _, c, _ in parts), frozenset().union(*(o for _, _, o in parts)))
    into[id(p)] = summary
    return summary
