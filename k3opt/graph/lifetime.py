"""How long a run's graph lives: rarer garbage collections while it does, freed by reference counting after.

gs objects are reference cycles: a link list points back at the node or tensor holding it
(``SynchronizedList.parent_obj``), and nodes and tensors point at each other. Only the cycle collector
frees them, and a deep model's graph is some 300k objects: it walks them all at its next full
collection, or at interpreter exit, when a command-line run has nothing left to do but wait for it.

Within :func:`graph_scope` the graph layer records the link lists it builds (:func:`note_links`: every
imported node and tensor, every value made by ``ir.new_constant``/``ir.new_variable``) and the graphs it
imports with their inputs and outputs (:func:`note_graph`). Leaving the outermost scope empties those
lists, and those of every node of those graphs as they are then and of the values the nodes read and
write (some built by gs's own constructors), and drops their owners: each object is freed as soon as
nothing else holds it. What gs's constructors built and a pass then dropped is left to the collector (a
few objects). A graph built in the scope must not be used after it: ``api`` exports it to a ModelProto
first.
"""
from __future__ import annotations

import gc
import threading
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, Optional

import onnx_graphsurgeon as gs
from onnx_graphsurgeon.util.misc import SynchronizedList

#: Allocations between two young-generation collections while a graph is alive (CPython's default: 700).
GC_YOUNG_THRESHOLD = 50_000

#: The link lists built and the graphs imported in the active :func:`graph_scope` (this thread, task), else None.
#: A context variable, not an argument: what records into it is every value constructor of the graph layer
#: (``ir.new_constant``, ``ir.new_variable``, the importer), called by every pass and plugin with no scope at
#: hand. Safe: only :func:`graph_scope` sets it and always resets it in a ``finally``; a thread or asyncio task
#: has its own context (a new thread starts without the scope, a task with a copy), so concurrent runs record
#: and release their own graphs only.
_recorded: ContextVar[Optional[tuple[list, list]]] = ContextVar("k3opt_graph_objects", default=None)


class _GcThresholds:
    """The collector's thresholds, which are the process's: the first :func:`graph_scope` open in any thread
    raises the young one, the last one to end puts the caller's back (a scope restoring what it found would
    keep another thread's raised value for good)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = 0
        self._saved = gc.get_threshold()

    def enter(self) -> None:
        with self._lock:
            if self._open == 0:
                self._saved = gc.get_threshold()
                gc.set_threshold(max(self._saved[0], GC_YOUNG_THRESHOLD), *self._saved[1:])
            self._open += 1

    def leave(self) -> None:
        with self._lock:
            self._open -= 1
            if self._open == 0:
                gc.set_threshold(*self._saved)


#: Process-wide because the thresholds are; changed only under its lock, by scopes that always leave in a
#: ``finally``.
_GC = _GcThresholds()


def note_links(links: list) -> None:
    """Record a gs link list just built, to be released when the active :func:`graph_scope` ends."""
    recorded = _recorded.get()
    if recorded is not None:
        recorded[0].append(links)


def note_graph(graph: gs.Graph) -> None:
    """Record an imported graph, whose nodes (as they are when the active :func:`graph_scope` ends) are
    released, and its inputs and outputs now (gs's importer builds them; a rewrite may replace an output)."""
    recorded = _recorded.get()
    if recorded is not None:
        recorded[0].extend(lst for t in (*graph.inputs, *graph.outputs) for lst in (t.inputs, t.outputs))
        recorded[1].append(graph)


@contextmanager
def graph_scope() -> Iterator[None]:
    """Build, rewrite and export a graph in the block: the young generation is collected rarely (an
    imported graph is a hundred thousand long-lived objects the collector would walk over and over), and
    the graph's objects are released at the end (see the module docstring). The caller's thresholds are
    restored (when no other thread's scope is open); a nested scope belongs to the outermost one."""
    if _recorded.get() is not None:
        yield
        return
    _GC.enter()
    links: list = []
    graphs: list = []
    token = _recorded.set((links, graphs))
    try:
        yield
    finally:
        _recorded.reset(token)
        _GC.leave()
        release(links + [lst for g in graphs for lst in _graph_links(g)])


def _graph_links(graph: gs.Graph) -> Iterator[list]:
    """The lists of ``graph`` (nodes, inputs, outputs: a graph a cycle holds must not hold them too), the link
    lists of its nodes and of the values they read and write, and its bodies' (nested)."""
    yield graph.nodes
    yield graph.inputs
    yield graph.outputs
    for node in graph.nodes:
        yield node.inputs
        yield node.outputs
        for t in (*node.inputs, *node.outputs):
            yield t.inputs
            yield t.outputs
        for value in node.attrs.values():
            if isinstance(value, gs.Graph):
                yield from _graph_links(value)


def release(links: list) -> None:
    """Empty each list and drop a link list's owner: no gs cycle is left among their nodes and tensors."""
    for lst in links:
        if isinstance(lst, SynchronizedList):
            lst.__dict__["parent_obj"] = None
        list.clear(lst)


def return_freed_memory() -> None:
    """Hand the free pages inside the C heap back to the system (glibc's ``malloc_trim``).

    A run frees big buffers between its stages (the weights copied for the original's onnxruntime session,
    a session's own), but glibc keeps freed heap memory resident, and once a big buffer was freed it takes
    the next ones of that size from the heap instead of fresh mappings: without a trim, what one stage freed
    still counts in the resident size while the next allocates (issue #26 item 9). No-op off glibc.
    """
    global _TRIM
    if _TRIM is None:
        try:
            import ctypes

            _TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (ImportError, OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM = None
