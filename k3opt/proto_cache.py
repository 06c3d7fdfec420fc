"""Reusing the exported protos of gs nodes and constants that did not change since the last export.

Shape inference re-exports the whole graph before every pass that needs
shapes; on a 16k-node model most nodes are untouched between two refreshes,
and exporting them again (attribute by attribute, through onnx.helper) was
most of a refresh. An entry is reused only when everything the proto is
made of is the same: op, name, domain, input/output names, and attributes
that are plain values (compared by value) or constants (compared by
identity of the Constant and its values, which the entry keeps alive so an
id is never recycled). Anything else (subgraphs, unusual attribute types) is
exported afresh every time.
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Optional

import onnx_graphsurgeon as gs

_PLAIN = (int, float, str, bytes)


class ProtoCache:
    """``node(n, make)`` / ``constant(t, make)``: what ``make`` built at the last export when ``n``/``t`` is unchanged.

    Entries not asked for during one export are dropped at the next ``start()``.
    """

    def __init__(self) -> None:
        self._old: dict[int, tuple] = {}
        self._new: dict[int, tuple] = {}
        self.exported = 0  # protos built (not reused) since start(): tests and profiling
        self.uncached = 0  # nodes that cannot be cached (subgraphs, unusual attributes) since start()

    def start(self) -> None:
        """Begin an export: keep only what the previous export used."""
        self._old, self._new = self._new, {}
        self.exported = self.uncached = 0

    def node(self, node: gs.Node, make: Callable[[gs.Node], Any]) -> Any:
        """``make(node)`` (made of the node's exported proto), reused while the node is unchanged."""
        sig = _node_signature(node)
        if sig is None:
            self.exported += 1
            self.uncached += 1
            return make(node)
        key, refs = sig
        return self._get(node, key, refs, lambda: make(node))

    def constant(self, tensor: gs.Constant, make: Callable[[gs.Constant], Any]) -> Any:
        """``make(tensor)``, reused while the Constant keeps its name and values object."""
        return self._get(tensor, (tensor.name,), (tensor._values,), lambda: make(tensor))

    def _get(self, obj: Any, key: Hashable, refs: tuple, make: Callable[[], Any]) -> Any:
        entry = self._old.get(id(obj))
        if entry is None or entry[0] is not obj or entry[1] != key or not _same(entry[2], refs):
            self.exported += 1
            entry = (obj, key, refs, make())
        self._new[id(obj)] = entry
        return entry[3]


def _same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _node_signature(node: gs.Node) -> Optional[tuple[Hashable, tuple]]:
    """(comparable key, objects compared by identity) describing the node's proto; None: do not cache."""
    attrs: list[Hashable] = []
    refs: list[Any] = []
    for name, value in node.attrs.items():
        if isinstance(value, _PLAIN):
            attrs.append((name, type(value), value))
        elif isinstance(value, (list, tuple)) and all(isinstance(v, _PLAIN) for v in value):
            attrs.append((name, type(value), tuple((type(v), v) for v in value)))
        elif isinstance(value, gs.Constant):
            attrs.append((name, value.name))
            refs += [value, value._values]
        else:
            return None
    key = (node.op, node.name, node.domain, tuple(t.name for t in node.inputs),
           tuple(t.name for t in node.outputs), tuple(attrs))
    return key, tuple(refs)
