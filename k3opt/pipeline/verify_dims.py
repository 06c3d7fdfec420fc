"""Sizes for verification inputs: values of the inputs' symbolic dims that the original model runs on.

A decode step with a KV cache takes ``past_key_values.*`` of length
``past_sequence``, new tokens of length ``sequence`` and an
``attention_mask`` over ``total_sequence``; it runs only when total = past +
new. Random sizes chosen per symbol break that, so the sizes are solved:

1. Every graph input dim is a number or a symbol (its dim_param; an unnamed
   dim gets its own). Equal dim_params are one symbol. A dim fixed by
   ``--input-shape`` (the model then has a number where it declared a
   symbol) or given by ``--input-data`` pins its symbol.
2. :mod:`k3opt.graph.symbolic.relations` walks the graph for the equations it imposes
   (broadcasts, MatMul, Concat sums, declared ``value_info`` dims).
3. The pins and equations are solved (Gaussian elimination); the free
   symbols get the base size (2, then 3), the others follow.
4. When a runner is given, the assignment must let the original run. If it
   does not, relations the graph does not show are tried, one at a time:
   ``t = a + b`` (or ``t = a + 1``, ``t = a``) between symbols, then all of
   that again without the learned equations (they rest on an assumption:
   two symbolic dims broadcast against each other are equal). Each
   distinct assignment is one run of the original on small inputs, at most
   :data:`MAX_TRIES`.

The sizes used are reported; when none works the verification is skipped
with a warning naming ``--input-data`` and ``--input-shape``.
"""
from __future__ import annotations

import itertools
from fractions import Fraction
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import numpy as np
import onnx

from ..graph.symbolic.relations import Dim, Lin, relations

#: Distinct assignments run at most before giving up.
MAX_TRIES = 48
Sizes = dict[str, int]
_Solved = dict[str, tuple[dict[str, Fraction], Fraction]]


class NoConsistentSizes(Exception):
    """onnxruntime ran the original model at none of the sizes tried."""

    def __init__(self, error: BaseException, tried: Sequence[Sizes]) -> None:
        self.error, self.tried = error, list(tried)
        super().__init__(self.describe())

    def describe(self) -> str:
        text = str(self.error).strip()
        first = (text.splitlines()[0] if text else type(self.error).__name__)[:300]
        if not self.tried or not self.tried[0]:
            return f"onnxruntime failed on the original model: {first}"
        symbols = ", ".join(self.tried[0])
        return (f"onnxruntime failed on the original model at each of the {len(self.tried)} sizes tried for "
                f"{symbols} (first: {format_sizes(self.tried[0])}): {first}; give inputs with "
                f"--input-data FILE.npz or sizes with --input-shape NAME:D1,D2")


class Feeds(dict):
    """Input arrays by name, and how they were chosen.

    ``sizes``: the size given to each symbolic dim; ``outputs``: the original
    model's outputs on these inputs when a runner chose them (else None);
    ``tries``: how many assignments were run to find them; ``sizing``: what
    chose them (:meth:`again` picks other sizes with it).
    """

    def __init__(self, arrays: Mapping[str, np.ndarray], sizes: Sizes, outputs: Optional[list] = None,
                 tries: int = 0, sizing: Optional["Sizing"] = None) -> None:
        super().__init__(arrays)
        self.sizes, self.outputs, self.tries, self.sizing = sizes, outputs, tries, sizing

    def again(self, base: int, run: Optional[Callable[[dict[str, np.ndarray]], list]] = None) -> "Feeds":
        """Feeds at other sizes than these (free symbols at ``base``, then ``base + 1``), chosen as these were
        (the model's relations are not read again); :class:`NoConsistentSizes` without a size tried when every
        symbol is pinned."""
        assert self.sizing is not None, "feeds chosen by a Sizing"
        return self.sizing.feeds(base, run, avoid=self.sizes)


def format_sizes(sizes: Mapping[str, int]) -> str:
    """``batch=2, sequence=1`` for the report."""
    return ", ".join(f"{k}={v}" for k, v in sizes.items())


def declared_dims(model: onnx.ModelProto) -> dict[str, list[Dim]]:
    """Each graph input's dims (initializers excluded): an int, its dim_param, or ``name[axis]`` when unnamed."""
    inits = {t.name for t in model.graph.initializer}
    out: dict[str, list[Dim]] = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        # a negative dim_value (Paddle exports write -1) is as unknown as an unnamed dim
        out[vi.name] = [d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else (d.dim_param or f"{vi.name}[{axis}]")
                        for axis, d in enumerate(vi.type.tensor_type.shape.dim)]
    return out


def choose(
    model: onnx.ModelProto, build: Callable[[Mapping[str, list[int]]], dict[str, np.ndarray]], *,
    declared: Optional[Mapping[str, Sequence[Dim]]] = None, given: Optional[Mapping[str, Sequence[int]]] = None,
    base: int = 2, run: Optional[Callable[[dict[str, np.ndarray]], list]] = None,
) -> Feeds:
    """Feeds built by ``build(shape of each input)`` at consistent sizes (see the module doc).

    ``declared``: the inputs' dims before ``--input-shape`` fixed some
    (default: the model's own); ``given``: shapes of the user's arrays.
    Without ``run`` the first solved assignment is taken; with it, the first
    one on which ``run(feeds)`` returns (its outputs are kept), else
    :class:`NoConsistentSizes`.
    """
    return Sizing(model, build, declared, given).feeds(base, run)


class Sizing:
    """A model's input symbols, their pins and the relations its graph imposes, read once; :meth:`feeds` picks
    sizes (a second verification picks others with the same reading: :meth:`Feeds.again`)."""

    def __init__(self, model: onnx.ModelProto, build: Callable[[Mapping[str, list[int]]], dict[str, np.ndarray]],
                 declared: Optional[Mapping[str, Sequence[Dim]]] = None,
                 given: Optional[Mapping[str, Sequence[int]]] = None) -> None:
        self.build = build
        self.dims, self.pins = _symbols(declared_dims(model), declared, given or {})
        self.symbols = list(dict.fromkeys(d for ds in self.dims.values() for d in ds if isinstance(d, str)))
        self.learned = relations(model.graph, {k: [self.pins.get(d, d) if isinstance(d, str) else d for d in ds]
                                               for k, ds in self.dims.items()}).equations if self.symbols else []
        self.order = _derive_order(self.dims, self.symbols)

    def feeds(self, base: int = 2, run: Optional[Callable[[dict[str, np.ndarray]], list]] = None,
              avoid: Optional[Sizes] = None) -> Feeds:
        """See :func:`choose`; ``avoid``: an assignment not to take (the one a first verification used)."""
        pin_eqs = [Lin({s: 1}, -v) for s, v in self.pins.items()]
        symbols, learned = self.symbols, self.learned
        tried: list[Sizes] = []
        first_error: Optional[BaseException] = None
        for size, known in itertools.product((base, base + 1), (learned, []) if learned else ([],)):
            for extra in _hypotheses(self.order, set(self.pins)):
                sizes = _assign(pin_eqs + known + extra, self.order, symbols, size)
                if sizes is None or sizes in tried or sizes == avoid:
                    continue
                tried.append(sizes)
                feeds = self.build({k: [sizes[d] if isinstance(d, str) else d for d in ds]
                                    for k, ds in self.dims.items()})
                if run is None:
                    return Feeds(feeds, sizes, sizing=self)
                try:
                    return Feeds(feeds, sizes, run(feeds), len(tried), self)
                except Exception as exc:  # noqa: BLE001 -- onnxruntime's own error types: try the next sizes
                    first_error = first_error or exc
                if len(tried) >= MAX_TRIES or not symbols:
                    raise NoConsistentSizes(first_error, tried)
        raise NoConsistentSizes(first_error or ValueError("no positive sizes satisfy the graph's relations"), tried)


def _symbols(now: dict[str, list[Dim]], declared: Optional[Mapping[str, Sequence[Dim]]],
             given: Mapping[str, Sequence[int]]) -> tuple[dict[str, list[Dim]], Sizes]:
    """(dims with symbols, pinned sizes): a declared symbol now fixed, or sized by a user array, is pinned.

    A symbol pinned to two different sizes (the user's shapes disagree) is
    split: the later dim gets its own symbol, pinned to its own size.
    """
    dims: dict[str, list[Dim]] = {}
    pins: Sizes = {}
    for name, fixed in now.items():
        before = list(declared.get(name, fixed)) if declared is not None else list(fixed)
        if len(before) != len(fixed):
            before = list(fixed)
        user = list(given[name]) if name in given and len(given[name]) == len(fixed) else None
        row: list[Dim] = []
        for axis, (b, f) in enumerate(zip(before, fixed)):
            value = user[axis] if user is not None else (f if isinstance(f, int) else None)
            if not isinstance(b, str):
                row.append(b if value is None else value)
                continue
            if value is not None and pins.setdefault(b, value) != value:
                b = f"{name}[{axis}]"
                pins[b] = value
            row.append(b)
        dims[name] = row
    return dims, pins


def _derive_order(dims: Mapping[str, list[Dim]], symbols: list[str]) -> list[str]:
    """Symbols, those to derive first: used by the fewest inputs, then declared last (a mask's total)."""
    uses = {s: sum(s in ds for ds in dims.values()) for s in symbols}
    return sorted(symbols, key=lambda s: (uses[s], -symbols.index(s)))


def _hypotheses(order: list[str], pinned: set[str]) -> Iterator[list[Lin]]:
    """No extra relation, then ``t = a + b``, ``t = a + 1``, ``t = a`` between symbols (``t`` not pinned)."""
    yield []
    one = ""  # stands for the constant 1 among the addends
    for t in order:
        if t in pinned:
            continue
        others = [s for s in order if s != t] + [one]
        for a, b in itertools.combinations(others, 2):
            yield [Lin({t: 1, a: -1, **({b: -1} if b else {})}, 0 if b else -1)]
    for t in order:
        if t not in pinned:
            yield from ([Lin({t: 1, a: -1})] for a in order if a != t)


def _assign(equations: list[Lin], order: list[str], symbols: list[str], size: int) -> Optional[Sizes]:
    """Sizes of ``symbols`` (declared order) solving ``equations``, free ones at ``size``; None if none is positive."""
    solved = _solve(equations, order)
    if solved is None:
        return None
    sizes: Sizes = {}
    for s in symbols:  # a solved symbol is a combination of free ones, which all get ``size``
        terms, const = solved.get(s, ({s: Fraction(1)}, Fraction(0)))
        value = const + size * sum(terms.values(), Fraction(0))
        if value.denominator != 1 or value < 1:
            return None
        sizes[s] = int(value)
    return sizes


def _solve(equations: list[Lin], order: list[str]) -> Optional[_Solved]:
    """Each pivot symbol as a combination of free ones (Gauss-Jordan over fractions); None if inconsistent.

    A pivot is a symbol the equation makes a sum of the others when there is
    one (so free sizes give it a positive size), then the first in ``order``;
    symbols outside ``order`` (the walk's auxiliary dims) before those.
    """
    rank = {s: i for i, s in enumerate(order)}
    solved: _Solved = {}
    for eq in equations:
        terms, const = _substitute({s: Fraction(c) for s, c in eq.terms}, Fraction(eq.const), solved)
        if not terms:
            if const != 0:
                return None
            continue
        pivot = min(terms, key=lambda s: (not _is_sum(terms, const, s), rank.get(s, -1)))
        coef = terms.pop(pivot)
        expr = ({s: -c / coef for s, c in terms.items()}, -const / coef)
        for key, (t, c0) in list(solved.items()):
            if pivot in t:
                solved[key] = _substitute(t, c0, {pivot: expr})
        solved[pivot] = expr
    return solved


def _is_sum(terms: dict[str, Fraction], const: Fraction, pivot: str) -> bool:
    """Whether ``pivot`` is a positive combination of the other symbols plus a constant of at least 0
    (total in total - past - new = 0)."""
    return const * terms[pivot] <= 0 and all(c * terms[pivot] < 0 for s, c in terms.items() if s != pivot)


def _substitute(terms: dict[str, Fraction], const: Fraction, solved: _Solved) -> tuple[dict[str, Fraction], Fraction]:
    out: dict[str, Fraction] = {}
    for s, c in terms.items():
        if s in solved:
            sub, sub_const = solved[s]
            const += c * sub_const
            for v, k in sub.items():
                out[v] = out.get(v, Fraction(0)) + c * k
        else:
            out[s] = out.get(s, Fraction(0)) + c
    return {s: c for s, c in out.items() if c}, const


def shapes_note(feeds: Any) -> Optional[str]:
    """The report's note on the sizes verification used, when the inputs have symbolic dims."""
    sizes = getattr(feeds, "sizes", None)
    if not sizes:
        return None
    tries = getattr(feeds, "tries", 0)
    return f"verification inputs sized {format_sizes(sizes)}" + (f" (found in {tries} tries)" if tries > 1 else "")
