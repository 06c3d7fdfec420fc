"""Pattern matcher throughput: a rule set over a ~100k-node graph must take seconds, not minutes.

``python -m bench.bench_matcher [--blocks 6250] [--rules 6]`` builds, directly in onnx-graphsurgeon,
a chain of transformer-FFN-like blocks (MatMul + bias Add, decomposed erf GELU in one of its
exporter forms, a residual Add, a decomposed square) of 16 nodes each, and times:

- ``first``: one rule-set pass run that rewrites every block (matches + commits);
- ``fixpoint``: a second run over the rewritten graph (nothing left to match: the pure scan cost);
- ``decoys``: the same rules over a copy whose GELUs all carry a wrong constant (every GELU
  candidate is refused deep in the pattern; the bias and square rules still fire).

Prints one line per phase (wall and CPU seconds, nodes, rewrites, µs of CPU per node; CPU time
because the machine is shared) and exits 1 if any phase exceeds ``--limit`` CPU seconds (default 30).
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np
import onnx_graphsurgeon as gs

from k3opt.graph.ir import NameScope
from k3opt.pipeline.pass_base import PassContext
from k3opt.patterns import Rule
from k3opt.patterns.rule import RuleApplier

HIDDEN = 8


def _gelu_pattern(op, x):
    scaled = op.Or(op.Div(x, math.sqrt(2.0)), op.Mul(x, 1 / math.sqrt(2.0)))
    cdf = op.Add(op.Erf(scaled), 1.0)
    return op.Or(op.Mul(op.Mul(x, cdf), 0.5), op.Mul(op.Mul(x, 0.5), cdf), op.Mul(x, op.Mul(cdf, 0.5)))


def _bias_pattern(op, x, w, b):
    return op.Add(op.MatMul(x, w), b)


def _bias_check(m) -> bool:
    return m.is_const("w") and m.is_const("b") or m.fail("weights not constant")


def rules(count: int) -> list[Rule]:
    """A realistic rule set: two that fire, the rest anchored at common ops but never matching."""
    out = [
        Rule("gelu", _gelu_pattern, lambda op, m: op.Gelu(m["x"])),
        Rule("bias", _bias_pattern, lambda op, m: op.Gemm(m["x"], m["w"], m["b"]), check=_bias_check),
        Rule("square", lambda op, x: op.Sqrt(op.Or(op.Pow(x, 2.0), op.Mul(x, x))), lambda op, m: op.Abs(m["x"])),
    ]
    decoy_roots = ["Add", "Mul", "Div", "Erf"]
    for i in range(max(0, count - len(out))):
        root = decoy_roots[i % len(decoy_roots)]
        out.append(Rule(f"decoy{i}", lambda op, x, r=root: op.node(r, op.Sigmoid(op.Tanh(x)), x),
                        lambda op, m: m["x"]))
    return out


def build(blocks: int, decoy: bool = False) -> gs.Graph:
    """``blocks`` FFN-like blocks in a chain; ``decoy`` makes every GELU constant wrong (0.6 for 0.5)."""
    rng = np.random.default_rng(0)
    x = gs.Variable("x", np.float32, (2, HIDDEN))
    nodes, cur, k = [], x, 0

    def node(op, *inputs, **attrs):
        nonlocal k
        k += 1
        out = gs.Variable(f"t{k}", np.float32)
        nodes.append(gs.Node(op, f"n{k}", attrs, list(inputs), [out]))
        return out

    def const(value):
        nonlocal k
        k += 1
        return gs.Constant(f"c{k}", np.asarray(value, np.float32))

    half = 0.6 if decoy else 0.5
    for i in range(blocks):
        h = node("Add", node("MatMul", cur, const(rng.standard_normal((HIDDEN, HIDDEN)) * 0.1)),
                 const(np.zeros(HIDDEN)))
        scaled = node("Div", h, const(math.sqrt(2.0))) if i % 2 else node("Mul", h, const(1 / math.sqrt(2.0)))
        cdf = node("Add", const(1.0), node("Erf", scaled))
        g = node("Mul", node("Mul", h, cdf), const(half)) if i % 3 else node("Mul", node("Mul", const(half), h), cdf)
        r = node("Add", g, cur)
        sq = node("Sqrt", node("Mul", r, r) if i % 2 else node("Pow", r, const(2.0)))
        cur = node("Add", node("Mul", sq, const(0.5)), node("Tanh", r))
        cur = node("Add", node("Sigmoid", cur), node("Relu", cur))
    return gs.Graph(nodes=nodes, inputs=[x], outputs=[cur], opset=20)


def timed(graph: gs.Graph, rule_set: list[Rule]) -> tuple[float, float, int]:
    """(wall s, CPU s, rewrites) of one rule-set run."""
    ctx = PassContext(opset=20, names=NameScope(graph))
    t0, c0 = time.perf_counter(), time.process_time()
    n = RuleApplier(graph, ctx, rule_set).run()
    return time.perf_counter() - t0, time.process_time() - c0, n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=6250, help="16 nodes each (default 6250: 100k nodes)")
    ap.add_argument("--rules", type=int, default=6)
    ap.add_argument("--limit", type=float, default=30.0, help="fail above this many seconds per phase")
    args = ap.parse_args(argv)
    rule_set = rules(args.rules)
    slow = False
    graph = build(args.blocks)
    for phase, g in (("first", graph), ("fixpoint", graph), ("decoys", build(args.blocks, decoy=True))):
        nodes = len(g.nodes)
        wall, cpu, n = timed(g, rule_set)
        print(f"{phase:9s} {wall:7.2f} s wall {cpu:7.2f} s CPU  {nodes:7d} nodes  {n:6d} rewrites  "
              f"{cpu / nodes * 1e6:6.1f} us/node")
        slow |= cpu > args.limit
    return 1 if slow else 0


if __name__ == "__main__":
    sys.exit(main())
