"""The pattern API for fusion rules (see docs/design.md "Pattern API" and docs/writing-rules.md).

Modules: ``builder`` (pattern graphs), ``matcher`` (structural matching),
``match`` (the Match object), ``rewriter`` (all-or-nothing commits),
``rule`` (Rule and the one-sweep applier), ``rule_pass`` (rules as passes),
``checks`` (helpers for checks), ``schema`` (ONNX schema lookups).
"""
from __future__ import annotations

from . import checks
from .builder import COMMUTATIVE_OPS, PatternBuilder, PatternError
from .match import Match
from .rewriter import RewriteBuilder, RewriteError
from .rule import Rule, RuleError
from .rule_pass import RuleSetPass, apply_rules, explain, register_rules, rule, rules_pass

__all__ = [
    "COMMUTATIVE_OPS",
    "Match",
    "PatternBuilder",
    "PatternError",
    "RewriteBuilder",
    "RewriteError",
    "Rule",
    "RuleError",
    "RuleSetPass",
    "apply_rules",
    "checks",
    "explain",
    "register_rules",
    "rule",
    "rules_pass",
]
