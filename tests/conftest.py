"""Shared pytest fixtures: the example model, and registering throw-away passes."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator, Type

import pytest

from k3opt.pipeline.pass_base import Pass, register_pass, unregister_pass
from k3opt.plugins import registered_passes

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def no_leaked_passes() -> Iterator[None]:
    """Passes a test registers (rules_pass, plugins loaded by optimize) are gone after it: the
    registry is global, and a leftover pass joins every later test's default pipeline."""
    before = set(registered_passes())
    yield
    for name in set(registered_passes()) - before:
        unregister_pass(name)


@pytest.fixture
def tiny_transformer() -> Path:
    """examples/tiny_transformer.onnx (committed; rebuilt by examples/build_tiny_transformer.py)."""
    return ROOT / "examples" / "tiny_transformer.onnx"


@pytest.fixture
def register() -> Iterator[Callable[..., Type[Pass]]]:
    """``register(PassClass, **register_pass_kwargs)``; every pass registered this way is removed afterwards."""
    registered_passes()  # built-ins first, so test passes never shadow them
    names: list[str] = []

    def add(cls: Type[Pass], **kwargs) -> Type[Pass]:
        names.append(cls.name)
        return register_pass(cls, **kwargs)

    yield add
    for name in names:
        unregister_pass(name)


class DropOneIdentity(Pass):
    """Test pass: bypasses ONE Identity node per run, so the fixed point takes several rounds."""

    name = "test-drop-one-identity"
    description = "test: bypass one Identity per run"
    default = False

    def run(self, graph, ctx) -> int:
        from k3opt.graph.ir import replace_uses

        for node in graph.nodes:
            if node.op == "Identity":
                src, out = node.inputs[0], node.outputs[0]
                if any(o is src for o in graph.inputs) and any(o is out for o in graph.outputs):
                    continue
                replace_uses(graph, out, src)
                node.outputs.clear()
                node.inputs.clear()
                graph.cleanup()
                return 1
        return 0


class ReluToSigmoid(Pass):
    """Test pass: a WRONG rewrite (Relu -> Sigmoid) that verification must catch."""

    name = "test-relu-to-sigmoid"
    description = "test: wrong rewrite"
    default = False
    #: The op every Relu becomes (a subclass may choose one no opset defines).
    replacement = "Sigmoid"

    def run(self, graph, ctx) -> int:
        n = 0
        for node in graph.nodes:
            if node.op == "Relu":
                node.op = self.replacement
                n += 1
        return n


class Crash(Pass):
    """Test pass: a bug (raises ValueError)."""

    name = "test-crash"
    description = "test: raises"
    default = False

    def run(self, graph, ctx) -> int:
        raise ValueError("boom")
