"""Dims as symbols: sums, products, quotients and broadcasts of sizes, spelled canonically.

A dim is a number, a symbol or None (unknown). A symbol is a ``dim_param`` (equal names are equal sizes, as
ONNX defines), a canonical sum (``past_sequence + 1``) or product (``batch * 5``) of such names, or
``min(E, c)`` (a symbol ``E`` capped at a number ``c``: a ``Slice(x, 0, E)`` of a static dim). Equal sizes
spell equally, so sums of the same sizes are one symbol and a product divided by one of its factors is the
rest. Pure functions: nothing here reads a graph.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np

#: A dim as far as it is known: a number, a symbol (a ``dim_param``: equal names are equal sizes), or None.
Dim = Union[int, str, None]
#: Elements of a shape computation (symbols and None: dims, never negative) and its tensor shape.
Elements = tuple[list[Dim], tuple[int, ...]]


def as_dim(d: object) -> Dim:
    """An inferred shape entry as a :data:`Dim`: a non-negative number, a non-empty name, else None."""
    if isinstance(d, (int, np.integer)):
        return int(d) if d >= 0 else None
    return d if isinstance(d, str) and d else None


def known(dims: Sequence[Dim]) -> bool:
    """True when every dim is a number."""
    return all(isinstance(d, int) for d in dims)


def dim_sum(parts: Sequence[Dim]) -> Dim:
    """The sum of dims: a number, or a symbol spelling the sum (``past_sequence + 1``); None if one is unknown.

    The spelling is canonical (symbol terms sorted, the number last, a term
    that is itself such a sum split into its terms), so two sums of the same
    sizes are the same symbol: the present keys and values of every layer of
    a decode step have the one length ``past_sequence + 1``.
    """
    const, terms = 0, []
    for d in parts:
        if d is None:
            return None
        if isinstance(d, int):
            const += d
            continue
        for term in d.split(" + "):
            if term.isdigit():
                const += int(term)
            else:
                terms.append(term)
    if not terms:
        return const
    return " + ".join(sorted(terms) + ([str(const)] if const else []))


def factors(dims: Sequence[Dim]) -> tuple[int, list[str]]:
    """The product of known dims as (number, symbols): a product symbol (:func:`dim_product`) gives its
    factors, any other symbol (a name, a sum) is one factor."""
    number, symbols = 1, []
    for d in dims:
        if isinstance(d, int):
            number *= d
            continue
        for f in d.split(" * ") if " + " not in d else [d]:
            if f.isdigit():
                number *= int(f)
            else:
                symbols.append(f)
    return number, symbols


def dim_product(number: int, symbols: Sequence[str]) -> Dim:
    """``number`` times the sizes ``symbols`` name: a number, a symbol, or a symbol spelling the product
    (``batch * 5``; canonical: names sorted, the number last, as in :func:`dim_sum`); None for a sum
    times something.

    A Reshape's -1 of a flattened batch (``Reshape(Gemm(Reshape(x, [-1, C]), w), [-1, S, C'])``) is then
    the batch again, the flattened ``batch * S`` cancelling.
    """
    if not symbols or number == 0:
        return number
    if (len(symbols) > 1 or number != 1) and any(" + " in d for d in symbols):
        return None  # a sum times something: not spelled (dim_sum would read its terms apart)
    return " * ".join(sorted(symbols) + ([str(number)] if number != 1 else []))


def quotient(numerator: Sequence[Dim], denominator: Sequence[Dim]) -> Dim:
    """The product of ``numerator`` divided by the product of ``denominator`` (all known: numbers or symbols),
    when every symbol of the denominator cancels one of the numerator and the numbers divide exactly; else
    None."""
    (top, above), (bottom, below) = factors(numerator), factors(denominator)
    for d in below:
        if d not in above:
            return None
        above.remove(d)
    return dim_product(top // bottom, above) if bottom > 0 and top % bottom == 0 else None


def capped(symbol: str, c: int) -> str:
    """The spelling of ``min(symbol, c)`` (see :func:`broadcast_of`)."""
    return f"min({symbol}, {c})"


def capped_symbol(d: Dim) -> Optional[str]:
    """The symbol ``E`` of a dim spelled ``min(E, c)`` (:func:`capped`), else None."""
    return d[4:d.rindex(", ")] if isinstance(d, str) and d.startswith("min(") and ", " in d else None


def broadcast_of(dims: Sequence[Dim]) -> Dim:
    """The broadcast of ``dims``: a number other than 1 wins (the others are 1 or equal); a symbol wins over 1,
    itself, and ``min(itself, c)`` (a valid broadcast of ``E`` with ``min(E, c)``, ``c >= 1``, is ``E``: they are
    equal, or ``E > c`` and ``c`` is 1). An unknown beside a symbol stays unknown (a symbol 1 broadcasts it)."""
    numbers = [d for d in dims if isinstance(d, int) and d != 1]
    if numbers:
        return numbers[0]
    rest = {d for d in dims if d != 1}
    rest -= {d for d in rest if capped_symbol(d) is not None and capped_symbol(d) in rest}
    return rest.pop() if len(rest) == 1 else (1 if not rest else None)
