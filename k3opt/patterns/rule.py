"""A rule (pattern + check + rewrite) and applying one rule set to a graph in one linear sweep."""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Optional, Sequence

from ..graph.ir import Graph, Node, Tensor, is_graph_output
from ..pipeline.pass_base import PassContext
from .builder import Pattern, build_pattern
from .match import Match
from .matcher import Matcher, describe
from .rewriter import GraphEditor, RewriteBuilder, RewriteError

log = logging.getLogger("k3opt.patterns")

#: How many full structural matches one anchor may offer the check before the rule gives up there.
MAX_CANDIDATES_PER_ANCHOR = 16


class Rule:
    """A named fusion rule: ``pattern(op, *vars)``, ``check(m) -> bool``, ``rewrite(op, m) -> value(s)``.

    ``allow_escaping=True`` lets intermediates be used outside the match (they
    are then kept). ``debug=True`` (or ``K3OPT_DEBUG_RULES=name``) explains,
    at the closest candidate, why the rule did not match.
    """

    def __init__(
        self,
        name: str,
        pattern: Callable[..., Any],
        rewrite: Callable[..., Any],
        check: Optional[Callable[[Match], Any]] = None,
        *,
        description: str = "",
        allow_escaping: bool = False,
        debug: bool = False,
    ):
        self.name = name
        self.pattern: Pattern = build_pattern(pattern)
        self.rewrite = rewrite
        self.check = check
        self.description = description or (pattern.__doc__ or "").strip()
        self.allow_escaping = allow_escaping
        self.debug = debug

    def __repr__(self) -> str:
        return f"Rule({self.name!r})"

    def debugging(self) -> bool:
        """Debug on via the flag or ``K3OPT_DEBUG_RULES`` (comma-separated rule names, or ``all``)."""
        wanted = {w.strip() for w in os.environ.get("K3OPT_DEBUG_RULES", "").split(",") if w.strip()}
        return self.debug or self.name in wanted or bool(wanted & {"all", "*", "1"})


class RuleError(Exception):
    """A rule's check or rewrite raised, or its rewrite was invalid; names the rule."""

    def __init__(self, rule: str, message: str):
        super().__init__(f"rule '{rule}': {message}")
        self.rule = rule


class _Closest:
    """The deepest refusal seen for one rule (debug mode): depth = pattern nodes matched so far."""

    def __init__(self) -> None:
        self.depth = -1
        self.anchor: Optional[Node] = None
        self.reason = ""
        self.candidates = 0

    def record(self, anchor: Node, depth: int, reason: str) -> None:
        if depth > self.depth:
            self.depth, self.anchor, self.reason = depth, anchor, reason

    def explain(self, rule: Rule) -> str:
        if self.candidates == 0:
            return f"rule '{rule.name}': no candidate: no {'/'.join(sorted(rule.pattern.anchors))} node in the graph"
        assert self.anchor is not None
        progress = ("pattern matched, then refused" if self.depth > rule.pattern.node_count
                    else f"{self.depth} pattern node(s) matched, then")
        return (f"rule '{rule.name}': no match at {self.candidates} candidate(s); closest at "
                f"{describe(self.anchor)}: {progress}: {self.reason}")


class RuleApplier:
    """Applies ``rules`` to one graph: one sweep over the nodes, rules looked up by the anchor's op type."""

    def __init__(self, graph: Graph, ctx: PassContext, rules: Sequence[Rule], dry_run: bool = False,
                 explain: bool = True, nodes: Optional[Sequence[Node]] = None):
        self.graph = graph
        self.nodes = nodes  # the graph's nodes in order, or a subsequence holding every anchor (None: all)
        self.ctx = ctx
        self.rules = list(rules)
        self.dry_run = dry_run
        self.explain = explain  # debug explanations for rules that did not match (off for subgraphs)
        self.editor = GraphEditor(graph, ctx)
        self.closest = {r.name: _Closest() for r in self.rules if r.debugging() or dry_run}
        self.matched: dict[str, int] = {r.name: 0 for r in self.rules}
        self._by_op: dict[str, list[tuple[Rule, Matcher]]] = {}
        for r in self.rules:
            trace = self._tracer(r) if r.name in self.closest else None
            for op in r.pattern.anchors:
                self._by_op.setdefault(op, []).append((r, Matcher(r.pattern, ctx.opset, trace)))
        self._anchor: Optional[Node] = None
        self._members: Optional[set[int]] = None  # ids of this graph's nodes (built on the first match)

    def _tracer(self, rule: Rule) -> Callable[[int, str], None]:
        closest = self.closest[rule.name]
        return lambda depth, reason: closest.record(self._anchor, depth, reason)

    def run(self) -> int:
        """Rewrite every match; returns the number of rewrites.

        Nodes are visited from the outputs backwards, so a pattern ending later (usually the larger
        one: a norm with its scale and bias) claims its nodes before a pattern ending inside it; at
        one node the rules are tried in list order.
        """
        rewrites = 0
        try:
            nodes = self.graph.nodes if self.nodes is None else self.nodes
            anchors = [n for n in nodes if n.op in self._by_op]  # op types never change in a sweep
            for node in reversed(anchors):
                if id(node) in self.editor.removed:
                    continue
                for rule, matcher in self._by_op.get(node.op, ()):
                    if self._try(rule, matcher, node):
                        rewrites += 1
                        break
        finally:
            self.editor.flush()
        if not self.dry_run:
            for rule in self.rules:
                self.ctx.count(f"rule:{rule.name}", self.matched[rule.name])
                if rule.name in self.closest and self.explain and not self.ctx.counters[f"rule:{rule.name}"]:
                    message = self.closest[rule.name].explain(rule)  # never matched in this optimization
                    log.warning(message)
                    self.ctx.note(message)
        return rewrites

    def _try(self, rule: Rule, matcher: Matcher, node: Node) -> bool:
        self._anchor = node
        closest = self.closest.get(rule.name)
        if closest is not None:
            closest.candidates += 1
        n_patterns = rule.pattern.node_count
        for tried, state in enumerate(self._states(matcher, node)):
            if tried >= MAX_CANDIDATES_PER_ANCHOR:
                break
            outputs = [state.root] + [state.bound(p.node).outputs[p.index] for p in rule.pattern.outputs[1:]]
            m = Match(state, outputs, self.graph, self.ctx, owns=self.owns)
            why = self._foreign(m) or (None if rule.allow_escaping else self._escapes(m))
            if why is None:
                why = self._check(rule, m)
            if why is not None:
                m.memo.clear()  # what a check kept may hold the match: a cycle only the collector frees
                if closest is not None:
                    closest.record(node, n_patterns + 1, why)
                if not self.dry_run:
                    self.ctx.site(describe(node), "declined", why, rule.name)
                continue
            rewritten = self.dry_run or self._rewrite(rule, m, node)
            m.memo.clear()
            if rewritten:
                self.matched[rule.name] += 1
                if not self.dry_run:
                    self.ctx.site(describe(node), "applied", rule=rule.name)
                if rule.debugging():
                    log.warning("rule '%s' matched at node '%s' (%s)", rule.name, node.name, node.op)
                return True
            return False
        return False

    @staticmethod
    def _states(matcher: Matcher, node: Node):
        for root in node.outputs:
            for state in matcher.matches(root):
                state.root = root
                yield state

    def owns(self, node: Node) -> bool:
        """``node`` is one of the swept graph's own nodes (not of an enclosing graph a body's tensors lead to)."""
        if self._members is None:
            self._members = {id(n) for n in self.graph.nodes}
        return id(node) in self._members

    def _foreign(self, m: Match) -> Optional[str]:
        """Why the match reaches out of this graph (into an enclosing one, through an outer-scope tensor), else None.

        Rewriting such a match would move the outer nodes' work into this (branch or loop) body.
        """
        outer = next((n for n in m.nodes if not self.owns(n)), None)
        return None if outer is None else f"{describe(outer)} belongs to an enclosing graph"

    def _escapes(self, m: Match) -> Optional[str]:
        """Why an intermediate of the match would be lost (used outside, or a graph output), else None."""
        inside = {id(n) for n in m.nodes}
        keep = {id(t) for t in m.outputs}
        for n in m.nodes:
            for t in n.outputs:
                if id(t) in keep:
                    continue
                if is_graph_output(self.graph, t):
                    return f"intermediate '{t.name}' is a graph output"
                outside = [c for c in t.outputs if id(c) not in inside]
                if outside:
                    return f"intermediate '{t.name}' is also used by node '{outside[0].name}' ({outside[0].op})"
        return None

    def _check(self, rule: Rule, m: Match) -> Optional[str]:
        if rule.check is None:
            return None
        try:
            ok = rule.check(m)
        except Exception as exc:
            raise RuleError(rule.name, f"check raised {type(exc).__name__}: {exc}") from exc
        if ok:
            return None
        return f"check declined: {m.failure}" if m.failure else f"check returned {ok!r}"

    def _rewrite(self, rule: Rule, m: Match, anchor: Node) -> bool:
        builder = RewriteBuilder(self.ctx, rule.name)
        try:
            result = rule.rewrite(builder, m)
        except Exception as exc:
            raise RuleError(rule.name, f"rewrite raised {type(exc).__name__}: {exc}") from exc
        if result is None:
            return False
        results: list[Tensor] = list(result) if isinstance(result, (tuple, list)) else [result]
        try:
            self.editor.validate(builder.staged, m.outputs, results)
        except RewriteError as exc:
            raise RuleError(rule.name, f"invalid rewrite: {exc}") from exc
        created = self.editor.commit(anchor, builder.staged, m.outputs, results, m.nodes)
        if self._members is not None:
            self._members.update(id(n) for n in created)
        return True
