"""Applying a rewrite all-or-nothing.

A rule's rewrite builds nodes with a :class:`RewriteBuilder`; those are only
*staged* (recorded, no gs node yet, so no tensor's consumer list changes).
:class:`GraphEditor` validates the staged nodes against the ONNX schema and
only then creates them, re-points the consumers of the replaced outputs and
detaches the matched nodes that became dead. If the rewrite raises or is
invalid, the graph is exactly as before.

Node list edits are batched: removed nodes are detached at once but dropped
from ``graph.nodes`` (and new nodes inserted just before the node they
replace, keeping topological order) in one linear pass by :meth:`flush`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence, Union

import numpy as np
from .. import graph as gs

from ..graph import dtypes, ir
from ..graph.ir import Graph, Node, Tensor
from ..pipeline.pass_base import PassContext
from .schema import validate_node


class RewriteError(Exception):
    """A rewrite returned something unusable or built an invalid node."""


@dataclasses.dataclass
class _Staged:
    op: str
    name: str
    domain: str
    inputs: list[Tensor]
    outputs: list[gs.Variable]
    attrs: dict[str, Any]


class RewriteBuilder:
    """The ``op`` of a rewrite function: ``op.Gemm(a, b, c, transB=1)`` stages a node, returns its output.

    Inputs may be tensors, None (an omitted optional input), or numbers/numpy
    arrays (become initializers; ``op.const(value, dtype)`` picks the dtype).
    ``_outputs=N`` returns N outputs, ``_domain=`` sets the domain, ``_name=``
    the node name base. ``op.node("Or", a, b)`` builds ops named like helpers.
    """

    def __init__(self, ctx: PassContext, base: str):
        self._ctx = ctx
        self._base = base
        self.staged: list[_Staged] = []

    def __getattr__(self, op_type: str) -> Any:
        if op_type.startswith("_"):
            raise AttributeError(op_type)
        return lambda *inputs, **kw: self.node(op_type, *inputs, **kw)

    def node(
        self,
        op_type: str,
        *inputs: Union[Tensor, None, float, int, np.ndarray],
        _name: Optional[str] = None,
        _domain: str = "",
        _outputs: int = 1,
        **attrs: Any,
    ) -> Union[gs.Variable, tuple[gs.Variable, ...]]:
        name = self._ctx.fresh_name(_name or f"{self._base}/{op_type}")
        dtype = next((i.dtype for i in inputs if isinstance(i, gs.Tensor) and i.dtype is not None), None)
        tensors = [self._tensor(i, dtype) for i in inputs]
        outs = [gs.Variable(self._ctx.fresh_name(f"{name}_out{i}" if _outputs > 1 else f"{name}_out"))
                for i in range(_outputs)]
        self.staged.append(_Staged(op_type, name, _domain, tensors, outs, dict(attrs)))
        return outs[0] if _outputs == 1 else tuple(outs)

    def const(self, value: Any, dtype: Any = None, name: Optional[str] = None) -> gs.Constant:
        """A new initializer (created with the graph untouched until commit)."""
        arr = np.asarray(value, dtype=dtype)
        if dtype is None and arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        return gs.Constant(self._ctx.fresh_name(name or f"{self._base}/const"), arr)

    def _tensor(self, x: Any, dtype: Any) -> Tensor:
        """A node input; a number takes the dtype of the node's other (typed) inputs, else float32."""
        if x is None:
            return gs.Variable.empty()
        if isinstance(x, gs.Tensor):
            return x
        if isinstance(x, (int, float, bool, np.number, np.ndarray, list)):
            if dtype is not None and not isinstance(x, np.ndarray):
                return self.const(x, dtype=_numpy_dtype(dtype))
            return self.const(x)
        raise RewriteError(f"rewrite input {x!r} is not a tensor, number or array")


def _numpy_dtype(dtype: Any) -> Any:
    """gs dtypes are numpy dtypes, or ONNX enums for types numpy lacks (bfloat16, float8): those map to
    ml_dtypes' types, so the constant has its tensor's type (a float32 one would make the node invalid).
    """
    try:
        return np.dtype(dtype)
    except TypeError:
        return dtypes.numpy_dtype(int(dtype))


class GraphEditor:
    """Commits staged rewrites into one graph and batches the node-list edits."""

    def __init__(self, graph: Graph, ctx: PassContext):
        self.graph = graph
        self.ctx = ctx
        self.removed: set[int] = set()
        self._inserts: dict[int, list[Node]] = {}

    def validate(self, staged: Sequence[_Staged], replaced: Sequence[Tensor], results: Sequence[Any]) -> None:
        """Raise :class:`RewriteError` unless committing would give a valid graph."""
        if len(results) != len(replaced):
            raise RewriteError(f"rewrite returned {len(results)} value(s) for {len(replaced)} pattern output(s)")
        for r in results:
            if not isinstance(r, gs.Tensor):
                raise RewriteError(f"rewrite returned {r!r}, not a tensor")
        replaced_ids = {id(t) for t in replaced}
        for s in staged:
            why = validate_node(s.op, s.domain, self.ctx.opset, len(s.inputs), len(s.outputs), s.attrs)
            if why:
                raise RewriteError(f"invalid node {s.name}: {why}")
            if any(id(t) in replaced_ids for t in s.inputs):
                raise RewriteError(f"node {s.name} reads the output it replaces (a cycle)")
        if any(id(r) in replaced_ids for r in results):
            raise RewriteError("rewrite returned the value it replaces")

    def commit(self, anchor: Node, staged: Sequence[_Staged], replaced: Sequence[Tensor],
               results: Sequence[Tensor], matched: Sequence[Node]) -> list[Node]:
        """Create the staged nodes before ``anchor``, redirect uses, detach dead matched nodes; returns the
        nodes created (Identity nodes keeping graph output names included)."""
        created = [gs.Node(s.op, s.name, s.attrs, s.inputs, s.outputs, s.domain or None) for s in staged]
        inserts = self._inserts.setdefault(id(anchor), [])
        first = len(inserts)
        inserts.extend(created)
        staged_outs = {id(o) for s in staged for o in s.outputs}
        for old, new in zip(replaced, results):
            if ir.is_graph_output(self.graph, old) and (id(new) not in staged_outs or ir.is_graph_output(self.graph, new)):
                new = self._identity(anchor, new, old)  # never rename an input, constant or other output
            if new.dtype is None:
                new.dtype = old.dtype
            if new.shape is None:
                new.shape = old.shape
            ir.replace_uses(self.graph, old, new)
        self._detach_dead(matched)
        return inserts[first:]

    def _identity(self, anchor: Node, src: Tensor, old: Tensor) -> Tensor:
        out = gs.Variable(self.ctx.fresh_name(old.name + "_id"))
        node = gs.Node("Identity", self.ctx.fresh_name(old.name + "_identity"), inputs=[src], outputs=[out])
        self._inserts[id(anchor)].append(node)
        return out

    def _detach_dead(self, matched: Sequence[Node]) -> None:
        """Detach matched nodes none of whose outputs is still read (root first, then upwards)."""
        pending = list(matched)
        changed = True
        while changed:
            changed = False
            for n in list(pending):
                if all(not o.outputs and not ir.is_graph_output(self.graph, o) for o in n.outputs):
                    ir.disconnect(n)  # by identity, not gs's structural Node.__eq__
                    self.removed.add(id(n))
                    pending = [p for p in pending if p is not n]
                    changed = True

    def flush(self) -> None:
        """Apply the batched node-list edits in one pass over ``graph.nodes``."""
        if not self.removed and not self._inserts:
            return
        nodes: list[Node] = []
        for n in self.graph.nodes:
            for new in self._inserts.pop(id(n), ()):
                if id(new) not in self.removed:
                    nodes.append(new)
            if id(n) not in self.removed:
                nodes.append(n)
        self.graph.nodes = nodes
        self.removed.clear()
