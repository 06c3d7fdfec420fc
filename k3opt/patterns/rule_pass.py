"""Turning rules into passes: :class:`RuleSetPass`, :func:`rules_pass`, :func:`register_rules`, :func:`rule`.

A rule set is one pass, so the pass manager's statistics, fixed-point loop,
``--skip`` and verification bisection apply to rules like to any pass.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Collection, Iterator, Optional, Sequence, Type, Union

import onnx

from ..errors import PluginError
from ..graph.ir import Graph, NameScope, producer
from ..pipeline import registry
from ..pipeline.pass_base import Pass, PassContext, register_pass
from .builder import NodeOutput, OrPattern, ValuePattern
from .rule import Rule, RuleApplier, RuleError


class RuleSetPass(Pass):
    """A pass applying ``rules`` (first matching rule wins at each node) until the manager's fixed point.

    Subclass with ``name`` and ``rules`` class attributes, or instantiate
    directly: ``RuleSetPass([rule], name="my-rules")``.
    """

    rules: ClassVar[Sequence[Rule]] = ()
    #: Made by :func:`register_rules`: only such a set takes more rules later (never a built-in pass).
    open_set: ClassVar[bool] = False

    def __init__(self, rules: Optional[Sequence[Rule]] = None, name: Optional[str] = None):
        if rules is not None:
            self.rules = list(rules)
        if name is not None:
            self.name = name
        elif not self.name:
            self.name = "+".join(r.name for r in self.rules)

    def run(self, graph: Graph, ctx: PassContext) -> int:
        """Apply the rules to the graph and to every control-flow subgraph (If/Loop/Scan bodies)."""
        if ctx.names is None:
            ctx.names = NameScope(graph)
        try:
            rewrites = sweep(graph, ctx, self.rules)
            # in gs's order (bodies()), looked for only when the census (or a scan) saw a body at all
            for sub in list(bodies(graph)) if len(ctx.graphs(graph)) > 1 else []:
                rewrites += sweep(sub, ctx, self.rules, explain=False)
            return rewrites
        except RuleError as exc:
            if self.plugin:
                raise PluginError(f"plugin '{self.plugin}', pass '{self.name}', {exc}") from exc
            raise


def sweep(graph: Graph, ctx: PassContext, rules: Sequence[Rule], explain: bool = True) -> int:
    """One :class:`RuleApplier` sweep of ``rules`` over ``graph`` (not its bodies); returns the rewrites.

    It finds the rules' anchors through ``ctx.nodes_of``, none when no rule can match here (:func:`possible`;
    all or none: one rule's rewrites may create the nodes another needs), and tells ``ctx`` when it changed
    the graph.
    """
    present = ctx.ops_in(graph)
    edges: dict[tuple[str, str], bool] = {}

    def linked(a: str, b: str) -> bool:
        if (a, b) not in edges:
            edges[a, b] = any(n is not None and n.op == a
                              for c in ctx.nodes_of(graph, (b,)) for n in map(producer, c.inputs))
        return edges[a, b]

    ops = {op for r in rules for op in r.pattern.anchors} if any(possible(r, present, linked) for r in rules) else ()
    done = RuleApplier(graph, ctx, rules, explain=explain, nodes=ctx.nodes_of(graph, ops) if ops else []).run()
    if done:
        ctx.changed()
    return done


def apply_rules(graph: Graph, ctx: PassContext, rules: Sequence[Rule], *, bodies: bool = False) -> int:
    """Apply ``rules`` one :func:`sweep` each, in order (a rule claims the nodes it matches before the next one
    looks: list larger patterns first), to ``graph`` and, with ``bodies``, then to each If/Loop/Scan body in it
    (declines are explained in ``graph`` only); returns the rewrites.

    The sweeps find their anchors through ``ctx``'s census, shared until a rewrite changes the graph. The one way
    the fusions and lowerings that recognise with ordered rules (attention, norms, rotary) apply them.
    """
    if ctx.names is None:
        ctx.names = NameScope(graph)
    graphs = ctx.graphs(graph) if bodies else [graph]
    return sum(sweep(g, ctx, [rule], explain=g is graph) for g in graphs for rule in rules)


def possible(rule: Rule, present: Collection[str], linked: Optional[Callable[[str, str], bool]] = None) -> bool:
    """Whether ``rule`` may match in a graph whose nodes have the op types ``present``: each op every match
    holds is there, and (given ``linked(a, b)``: does an ``a`` node feed a ``b`` node here?) each producer to
    consumer link every match holds (:func:`required_links`). (A match reaching a node outside the graph is
    refused anyway.) A rule being debugged always tries, so that it can explain itself at its closest candidate.
    """
    if rule.debugging():
        return True
    if not required_ops(rule.pattern.outputs) <= set(present):
        return False
    return linked is None or all(linked(a, b) for a, b in sorted(required_links(rule.pattern.outputs)))


def required_ops(patterns: Sequence[Optional[ValuePattern]]) -> frozenset[str]:
    """The op types every match of all of ``patterns`` holds a node of (an ``op.Or`` needs what each
    alternative needs; variables and constants need no node). Each shared sub-pattern is walked once.
    """
    memo: dict[int, frozenset[str]] = {}

    def need(p: Optional[ValuePattern]) -> frozenset[str]:
        if id(p) not in memo:
            if isinstance(p, NodeOutput):
                memo[id(p)] = frozenset((p.node.op_type,)).union(*map(need, p.node.inputs))
            elif isinstance(p, OrPattern):
                memo[id(p)] = frozenset.intersection(*map(need, p.alternatives))
            else:
                memo[id(p)] = frozenset()
        return memo[id(p)]

    return frozenset().union(*map(need, patterns))


def required_links(patterns: Sequence[Optional[ValuePattern]]) -> frozenset[tuple[str, str]]:
    """The (producer op, consumer op) pairs every match of all of ``patterns`` holds an edge of: a node pattern
    reading another's output (an ``op.Or`` operand gives what each alternative gives)."""
    memo: dict[tuple[int, str], frozenset[tuple[str, str]]] = {}

    def need(p: Optional[ValuePattern], consumer: str) -> frozenset[tuple[str, str]]:
        key = (id(p), consumer)
        if key not in memo:
            if isinstance(p, NodeOutput):
                op = p.node.op_type
                own = frozenset(((op, consumer),)) if consumer else frozenset()
                memo[key] = own.union(*(need(q, op) for q in p.node.inputs))
            elif isinstance(p, OrPattern):
                memo[key] = frozenset.intersection(*(need(a, consumer) for a in p.alternatives))
            else:
                memo[key] = frozenset()
        return memo[key]

    return frozenset().union(*(need(p, "") for p in patterns))


def bodies(graph: Graph) -> Iterator[Graph]:
    """``graph.subgraphs(recursive=True)``, in its order, asking gs only about nodes that hold a body."""
    for node in graph.nodes:
        for value in node.attrs.values():
            if isinstance(value, Graph):
                yield from node.subgraphs(recursive=True)
                break


def rules_pass(
    name: str,
    rules: Sequence[Rule],
    *,
    order: Optional[float] = None,
    description: str = "",
    before: Optional[str] = None,
    after: Optional[str] = None,
    plugin: Optional[str] = None,
    register: bool = True,
    **attrs: Any,
) -> Type[RuleSetPass]:
    """A :class:`RuleSetPass` subclass named ``name`` (registered unless ``register=False``).

    ``attrs`` set other :class:`~k3opt.pipeline.pass_base.Pass` class attributes
    (``needs_shapes``, ``preserves``, ``min_opset``, ``targets``, ``default``, ``options``,
    ``anchor_ops``, ``option_values``; k3opt's own passes also ``_hints``).
    """
    unknown = set(attrs) - {"needs_shapes", "preserves", "_hints", "min_opset", "targets", "default",
                            "options", "anchor_ops", "option_values"}
    if unknown:
        raise TypeError(f"rules_pass got unknown pass attribute(s): {sorted(unknown)}")
    body = dict(attrs, name=name, rules=list(rules),
                description=description or "; ".join(r.description or r.name for r in rules))
    if order is not None:
        body["order"] = float(order)
    cls = type(_class_name(name), (RuleSetPass,), body)
    if register:
        register_pass(cls, before=before, after=after, plugin=plugin)
    elif plugin is not None:
        cls.plugin = plugin
    return cls


def _class_name(name: str) -> str:
    return "".join(part.capitalize() for part in name.replace("_", "-").split("-") if part) + "Pass"


def register_rules(
    *rules: Rule,
    name: Optional[str] = None,
    before: Optional[str] = None,
    after: Optional[str] = None,
    order: Optional[float] = None,
    plugin: Optional[str] = None,
    description: str = "",
) -> Type[RuleSetPass]:
    """Register rules for library users and plugins: one pass named ``name`` (default: the single rule's name).

    Registering into a pass of that name made by ``register_rules`` adds the rules to it; any other
    existing pass of that name (a built-in) is an error.
    """
    if not rules:
        raise TypeError("register_rules needs at least one rule")
    if name is None:
        if len(rules) > 1:
            raise TypeError("register_rules with several rules needs name=")
        name = rules[0].name
    existing = registry.current().entries().get(name)
    if existing is not None and getattr(existing, "open_set", False) and before is None and after is None:
        # A new class, not the registered one changed: the registry's entries stay its whole state (a run's
        # plugins are undone by putting the entries back).
        added = [r for r in rules if r not in existing.rules]
        return register_pass(type(existing.__name__, (existing,), {"rules": list(existing.rules) + added}),
                             replace=True)
    cls = rules_pass(name, rules, order=order, description=description, plugin=plugin, register=False)
    cls.open_set = True
    return register_pass(cls, before=before, after=after, plugin=plugin)


def rule(
    name: Optional[str] = None,
    *,
    pass_name: Optional[str] = None,
    before: Optional[str] = None,
    after: Optional[str] = None,
    order: Optional[float] = None,
    allow_escaping: bool = False,
    debug: bool = False,
) -> Callable[[type], Rule]:
    """Class decorator: a class with ``pattern``, ``rewrite`` and optional ``check`` functions becomes a
    registered :class:`Rule` (in pass ``pass_name``, default the rule's name); the docstring describes it.
    """

    def decorate(cls: type) -> Rule:
        rule_name = name or _kebab(cls.__name__)
        r = Rule(rule_name, cls.pattern, cls.rewrite, getattr(cls, "check", None),
                 description=(cls.__doc__ or "").strip(), allow_escaping=allow_escaping, debug=debug)
        register_rules(r, name=pass_name or rule_name, before=before, after=after, order=order)
        return r

    return decorate


def _kebab(name: str) -> str:
    return "".join("-" + c.lower() if c.isupper() and i else c.lower() for i, c in enumerate(name))


def explain(rules: Union[Rule, Sequence[Rule]], model: Union[onnx.ModelProto, Graph], opset: Optional[int] = None
            ) -> list[str]:
    """Without changing anything: for each rule, where it matches, or why not at the closest candidate."""
    from .. import graph as gs

    rules = [rules] if isinstance(rules, Rule) else list(rules)
    if isinstance(model, onnx.ModelProto):
        opset = opset or next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
        graph = gs.import_onnx(model)
    else:
        graph = model
    ctx = PassContext(opset=opset or 17, names=NameScope(graph))
    applier = RuleApplier(graph, ctx, rules, dry_run=True)
    applier.run()
    return [f"rule '{r.name}': matches at {applier.matched[r.name]} node(s)" if applier.matched[r.name]
            else applier.closest[r.name].explain(r) for r in rules]
