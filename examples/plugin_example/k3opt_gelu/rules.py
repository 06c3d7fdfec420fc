"""Fuse decomposed GELU into one ``Gelu`` node (ONNX opset 20).

Exporters below opset 20 write GELU as a small graph; which one depends on
the exporter and the model code:

- erf form (``torch.nn.functional.gelu``): ``x * 0.5 * (1 + erf(x / sqrt(2)))``,
  with ``x / sqrt(2)`` sometimes written ``x * (1 / sqrt(2))``;
- tanh form (GPT-2 style "new GELU"):
  ``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3)))``, with ``x**3``
  sometimes written ``x * x * x``;

and the final ``0.5 * x * (...)`` is associated in any of three ways. Each
form is one rule; ``op.Or`` covers the variants, commutative matching the
operand orders, ``op.Constant``-by-value (numbers in the pattern) the
constants, whether initializers or Constant nodes.
"""
from __future__ import annotations

import math

from k3opt.patterns import Match, Rule, checks, rules_pass

SQRT2 = math.sqrt(2.0)
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _half_x_times(op, x, factor):
    """``0.5 * x * factor`` associated in any of the three ways exporters write it."""
    return op.Or(
        op.Mul(op.Mul(x, factor), 0.5),  # torch.onnx: (x * (1 + erf)) * 0.5
        op.Mul(op.Mul(x, 0.5), factor),  # (0.5 * x) * (1 + ...)
        op.Mul(x, op.Mul(factor, 0.5)),  # x * (0.5 * (1 + ...))
    )


def erf_gelu(op, x):
    """GELU, erf form: x * 0.5 * (1 + erf(x / sqrt(2)))."""
    scaled = op.Or(op.Div(x, SQRT2), op.Mul(x, 1.0 / SQRT2))
    return _half_x_times(op, x, op.Add(op.Erf(scaled), 1.0))


def tanh_gelu(op, x):
    """GELU, tanh approximation: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))."""
    cube = op.Or(op.Pow(x, 3.0), op.Mul(op.Mul(x, x), x))
    inner = op.Mul(op.Add(x, op.Mul(cube, 0.044715)), SQRT_2_OVER_PI)
    return _half_x_times(op, x, op.Add(op.Tanh(inner), 1.0))


def is_float_input(m: Match) -> bool:
    """Gelu is defined for float types only; decline when x is known not to be one."""
    x = m["x"]
    return x.dtype is None or checks.is_float(x) or m.fail(f"x has dtype {x.dtype}")


ERF_GELU = Rule("gelu-erf", erf_gelu, lambda op, m: op.Gelu(m["x"]), check=is_float_input,
                description="x*0.5*(1+erf(x/sqrt2)) -> Gelu")
TANH_GELU = Rule("gelu-tanh", tanh_gelu, lambda op, m: op.Gelu(m["x"], approximate="tanh"), check=is_float_input,
                 description="0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715x^3))) -> Gelu(approximate=tanh)")


def register() -> None:
    """Entry point: one pass, ``fuse-gelu``, right after constant folding (which folds sqrt(2)-style
    subexpressions into the constants the patterns compare against). Gelu needs opset 20; below it the
    pass manager skips the pass with a note."""
    rules_pass("fuse-gelu", [ERF_GELU, TANH_GELU], after="fold-constants", min_opset=20,
               description="fuse decomposed GELU (erf and tanh forms) into Gelu")
