"""Reusing the exported protos of gs nodes and constants that did not change since the last export.

Shape inference re-exports the whole graph before every pass that needs
shapes; on a 16k-node model most nodes are untouched between two refreshes,
and exporting them again (attribute by attribute, through onnx.helper) was
most of a refresh. An entry is reused only when everything the proto is
made of is the same: op, name, domain, input/output names, and attributes
that are plain values (compared by value and type) or constants (compared
by identity of the Constant and its values, which the entry keeps alive so
an id is never recycled). Anything else (subgraphs, unusual attribute
types) is exported afresh every time.
"""
from __future__ import annotations

from operator import attrgetter, is_
from typing import Any, Callable, Hashable, Optional

import onnx_graphsurgeon as gs

_PLAIN = (int, float, str, bytes)
_name = attrgetter("name")


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
        return self._get(node, sig[0], sig[1], make)

    def constant(self, tensor: gs.Constant, make: Callable[[gs.Constant], Any]) -> Any:
        """``make(tensor)``, reused while the Constant keeps its name and values object."""
        return self._get(tensor, tensor.name, (tensor._values,), make)

    def _get(self, obj: Any, key: Hashable, refs: tuple, make: Callable[[Any], Any]) -> Any:
        entry = self._old.get(id(obj))
        if (entry is None or entry[0] is not obj or entry[1] != key or len(entry[2]) != len(refs)
                or not all(map(is_, entry[2], refs))):
            self.exported += 1
            entry = (obj, key, refs, make(obj))
        self._new[id(obj)] = entry
        return entry[3]


def _node_signature(node: gs.Node) -> Optional[tuple[Hashable, tuple]]:
    """(comparable key, objects compared by identity) describing the node's proto; None: do not cache.

    The key holds each value's type beside it: ``1 == 1.0 == True`` but their protos differ; floats
    go by their bits (:func:`_exact`).
    """
    refs: tuple = ()
    attrs: tuple = ()
    if node.attrs:
        described: list[Hashable] = []
        for name, value in node.attrs.items():
            if isinstance(value, _PLAIN):
                described.append((name, type(value), _exact(value)))
            elif isinstance(value, (list, tuple)) and all(isinstance(v, _PLAIN) for v in value):
                described.append((name, type(value), tuple(map(_exact, value)), tuple(map(type, value))))
            elif isinstance(value, gs.Constant):
                described.append((name, value.name))
                refs += (value, value._values)
            else:
                return None
        attrs = tuple(described)
    key = (node.op, node.name, node.domain, tuple(map(_name, node.inputs)), tuple(map(_name, node.outputs)), attrs)
    return key, refs


def _exact(value: Any) -> Hashable:
    """``value`` as a key equal only for equal protos: floats by bits (``-0.0 == 0.0``; NaN is not even itself)."""
    return float(value).hex() if isinstance(value, float) else value
