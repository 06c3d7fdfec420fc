"""Shape computations that fold from inferred shapes, without the data.

``Shape(x)`` (with ``start``/``end``) and ``Size(x)`` become constants when
the dims they read are statically known; ``Gather(Shape(x), i)`` and
``Slice(Shape(x), ...)`` fold when only the selected dims are known (the
common "batch is dynamic, hidden size is not" case). Everything downstream
then folds as ordinary constants.

Dims inference left unknown are traced through their producer (Reshape
target elements, the Reshape's -1 as a quotient, Transpose, elementwise
ops, Concat's sum along its axis, spelled as a canonical symbol such as
``past_sequence + 1``, Split's sizes and the dims it keeps, Gemm, Expand,
Gather, GatherElements, and a ``Slice(x, 0, S)`` of a static dim c as
``min(S, c)``, which a broadcast with S gives S); a
Reshape's -1 of a flattened batch is a product (``batch * 5``, which the
next -1 cancels); equal ``dim_param`` names are taken as equal sizes, as
ONNX defines.

``Equal`` of a shape computation (``Shape``, ``Gather``/``Slice`` of it,
``Unsqueeze`` of a scalar, ``Concat`` of 1-D pieces, small integer
constants) with another folds when every element pair is decided: two known
numbers compare, a symbol equals itself, and an unknown dim (never
negative) differs from any negative number. This is TorchScript's ``expand`` spelling
``Where(Equal(shape, -1), 1, shape)``, whose ``Equal`` is all known even
when the batch and sequence are not.
"""
from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from contextvars import ContextVar, Token
from typing import Callable, Iterable, Iterator, Optional, Sequence, Union

import numpy as np

from ..ir import Graph, Node, Tensor, as_int_list, const_tensor, peek, producer
from ..small_constants import constant_value, is_small, small_const_value, small_int_list

#: Longest integer constant read as part of a shape computation.
MAX_SHAPE_ELEMENTS = 64
#: How many producers deep :func:`shape_elements` and :func:`tensor_dims` look.
MAX_SHAPE_DEPTH = 8
#: A slack no walk reaches (:attr:`DimMemo.slack`: a walk that tests no depth holds at every depth).
_UNBOUNDED = 1 << 30


#: A dim as far as it is known: a number, a symbol (a ``dim_param``: equal names are equal sizes), or None.
Dim = Union[int, str, None]
#: Elements of a shape computation (symbols and None: dims, never negative) and its tensor shape.
Elements = tuple[list[Dim], tuple[int, ...]]


def _dim(d: object) -> Dim:
    if isinstance(d, (int, np.integer)):
        return int(d) if d >= 0 else None
    return d if isinstance(d, str) and d else None


def known(dims: Sequence[Dim]) -> bool:
    """True when every dim is a number."""
    return all(isinstance(d, int) for d in dims)


def tensor_dims(t: Tensor, depth: int = MAX_SHAPE_DEPTH) -> Optional[list[Dim]]:
    """``t``'s dims (numbers, symbols, None for unknown ones); None when the rank is unknown.

    A dim inference left symbolic or unknown is traced back through the
    producer (:func:`_traced_dim`), since shape inference often loses what a
    Reshape target spelled out (``Reshape(x, [b, s, -1, 8])`` of a
    ``[b, s, 16]`` tensor has 2 at dim 2).
    """
    shape = t.shape
    if shape is None:
        _read(t)
        return None
    return [_dim_at(t, i, depth) for i in range(len(shape))]


def dim_at(t: Tensor, i: int, depth: int = MAX_SHAPE_DEPTH) -> Dim:
    """Dim ``i`` of ``t`` as :func:`tensor_dims` gives it (None when ``i`` is out of range), tracing only that one."""
    return _dim_at(t, i, depth)


class DimMemo:
    """What tracing found, kept while it is active (:func:`activate`), and which results read which tensors.

    Tracing re-walks the same producers for every Shape of a deep model. A
    result is remembered per tensor and slot (slot: the dim, -1 for shape
    elements, -2 for a constant's value). When no branch was cut short by the
    depth limit it holds at every depth from the least one its walk needed
    (its depth less its :attr:`slack`) up: more depth walks the same path, and
    so does less as long as every depth test the walk made still passes. A
    result that was cut short is valid at its own depth only (any less depth
    cuts the walk elsewhere). Results read other tensors' results, producers,
    constant values or unknown shapes (a known shape changes only when shapes
    are inferred again, which drops the analysis); :meth:`forget` drops the
    results of changed tensors and, transitively, of the tensors whose results
    read them.
    """

    def __init__(self, declared: frozenset[str] = frozenset()) -> None:
        #: Symbols the graph's inputs declare (see :func:`_dim_at`): never traced.
        self.declared = declared
        #: ``id(t) -> (t, results)``; results: ``slot -> (value, depth)`` when complete (valid at ``depth`` and
        #: deeper: the least depth its walk needed), ``(slot, depth) -> value`` when cut short by the depth limit.
        self._results: dict[int, tuple[Tensor, dict]] = {}
        #: ``id(tensor) -> ids of the tensors whose results read it`` (a defaultdict: ``setdefault(k, set())``
        #: would build a set on every read, the memo's hottest path).
        self._readers: defaultdict[int, set[int]] = defaultdict(set)
        #: Ids of the tensors whose results are being computed (innermost last).
        self._computing: list[int] = []
        #: True once the result being computed depends on a cut-short branch.
        self.cut = False
        #: How much less depth the result being computed could have been asked at and still walk the same path
        #: (every depth test it made, and every remembered result it read, holding at that depth too).
        self.slack = _UNBOUNDED

    def get(self, t: Tensor, slot: int, depth: int, compute: Callable[[], object]) -> object:
        """``compute()`` for ``(t, slot)`` at ``depth``, remembered.

        A dim (``slot >= 0``) is asked for only once :func:`_dim_at`'s depth test passed (``depth > 0``): the
        asking walk's path holds down to depth 1 there."""
        tid = id(t)
        computing = self._computing
        if computing and computing[-1] != tid:  # self.read(t), inlined: the memo's hottest path
            self._readers[tid].add(computing[-1])
        own = self._results.get(tid)
        if own is None or own[0] is not t:
            own = self._results[tid] = (t, {})
        results = own[1]
        if slot >= 0 and depth <= self.slack:  # self.tested(depth), inlined
            self.slack = depth - 1
        hit = results.get(slot)
        if hit is not None and hit[1] <= depth:
            if depth - hit[1] < self.slack:
                self.slack = depth - hit[1]
            return hit[0]
        key = (slot, depth)
        if key in results:
            self.cut = True
            return results[key]
        outer, outer_slack = self.cut, self.slack
        self.cut, self.slack = False, _UNBOUNDED
        computing.append(tid)
        try:
            value = compute()
        finally:
            computing.pop()
        if self.cut:
            results[key] = value
        else:
            results[slot] = (value, depth - self.slack)
        self.cut = self.cut or outer
        if outer_slack < self.slack:
            self.slack = outer_slack
        return value

    def tested(self, depth: int) -> None:
        """Note a depth test the walk passed at ``depth`` (``depth > 0``): it passes down to depth 1."""
        if depth <= self.slack:
            self.slack = depth - 1

    def read(self, t: Tensor) -> None:
        """Note that the result being computed read ``t``'s result, producer, value or unknown shape."""
        computing = self._computing
        if computing and computing[-1] != id(t):
            self._readers[id(t)].add(computing[-1])

    def forget(self, tensors: Iterable[Tensor]) -> None:
        """Drop the results of ``tensors`` (their producer, its inputs, their name or shape changed) and of
        every tensor whose results read a dropped one."""
        if not self._results:  # nothing to drop (every run starts so): reader links lead nowhere
            self._readers.clear()
            return
        todo = [id(t) for t in tensors]
        while todo:
            tid = todo.pop()
            self._results.pop(tid, None)
            todo.extend(self._readers.pop(tid, ()))


#: The memo active in this context (thread, task), else None (see :func:`activate`).
_active: ContextVar[Optional[DimMemo]] = ContextVar("k3opt_dim_memo", default=None)


def activate(memo: DimMemo) -> Token:
    """Make ``memo`` the one tracing uses in this context, until :func:`deactivate` with the token returned."""
    return _active.set(memo)


def deactivate(token: Token) -> None:
    """Undo the :func:`activate` that returned ``token``."""
    _active.reset(token)


@contextmanager
def remembering(graph: Graph, memo: Optional[DimMemo] = None) -> Iterator[DimMemo]:
    """``memo`` (default: a fresh :class:`DimMemo` of ``graph``'s input symbols) active in the block."""
    memo = DimMemo(input_symbols(graph)) if memo is None else memo
    token = activate(memo)
    try:
        yield memo
    finally:
        deactivate(token)


def _remembered(t: Tensor, slot: int, depth: int, compute: Callable[[], object]) -> object:
    """``compute()``, once per ``(t, slot, depth)`` while a memo is active."""
    memo = _active.get()
    return compute() if memo is None else memo.get(t, slot, depth, compute)


def _read(t: Tensor) -> None:
    """Note a read of ``t`` by the result being remembered."""
    memo = _active.get()
    if memo is not None:
        memo.read(t)


def _cut() -> None:
    """Note that the depth limit cut the current walk short."""
    memo = _active.get()
    if memo is not None:
        memo.cut = True


def _depth_test(depth: int) -> None:
    """Note a test of the depth limit at ``depth``: a cut when ``depth <= 0``, else a test passed."""
    memo = _active.get()
    if memo is not None:
        if depth <= 0:
            memo.cut = True
        else:
            memo.tested(depth)


def _const(t: Tensor) -> object:
    """:func:`small_const_value` of ``t``, a read of ``t`` for the result being remembered. Only big values go
    through the memo (decoded once per memo): a small one is remembered per process already, and most
    constants are read once per memo, where the memo's bookkeeping cost more than the read."""
    _read(t)
    c = const_tensor(t)
    if c is None or is_small(c):
        return constant_value(c)
    return _remembered(t, -2, 0, lambda: peek(c))


#: True while :func:`naming_unknown_dims` is active (in this context: thread, task).
_naming: ContextVar[bool] = ContextVar("k3opt_dim_naming", default=False)


@contextmanager
def naming_unknown_dims(graph: Graph) -> Iterator[DimMemo]:
    """A fresh :class:`DimMemo` of ``graph``, active in the block, in which a dim nothing pins is the
    symbol ``<tensor id:axis>`` instead of None.

    The name stands for that one size, so two paths that reach the same unknown dim (a Reshape's -1 of a
    flattened ``x`` and a target read from ``Shape(x)``) cancel or compare equal, however far the dim's
    origin is. The names live only as long as the block (ids of tensors the graph holds while it runs):
    so the memo is not the run's, and the results must not be kept past it.
    """
    token = _naming.set(True)
    try:
        with remembering(graph) as memo:
            yield memo
    finally:
        _naming.reset(token)


def input_symbols(graph: Graph) -> frozenset[str]:
    """The symbols the graph's inputs declare: sizes chosen at run time, which no producer pins.

    An output's dim_param (the TorchScript exporter names a KV cache's
    ``Concatpresent.0.key_dim_2``) is computed by the graph: it is traced.
    """
    return frozenset(d for t in graph.inputs for d in (t.shape or ()) if isinstance(d, str))


def dim_sum(parts: Sequence[Dim]) -> Dim:
    """The sum of dims: a number, or a symbol spelling the sum (``past_sequence + 1``); None if one is unknown.

    The spelling is canonical (symbol terms sorted, the number last, a term
    that is itself such a sum split into its terms), so two sums of the same
    sizes are the same symbol: the present keys and values of every layer of
    a decode step have the one length ``past_sequence + 1``.
    """
    const, terms = 0, []
    for d in parts:
        if d is None:
            return None
        if isinstance(d, int):
            const += d
            continue
        for term in d.split(" + "):
            if term.isdigit():
                const += int(term)
            else:
                terms.append(term)
    if not terms:
        return const
    return " + ".join(sorted(terms) + ([str(const)] if const else []))


def _dim_at(t: Tensor, i: int, depth: int) -> Dim:
    """Dim ``i`` of ``t``: a number when inference says so, or a symbol the graph declares while a
    memo is active, else what the producer says, else inference's symbol or None.

    A symbol a graph input declares (:func:`input_symbols`) is a size chosen
    at run time: no producer pins it to a number (inference would have
    propagated that number), so it is not traced. Tracing every ``batch``
    dim of a deep model through its residual stream was most of
    fold-constants' time.
    """
    shape = t.shape
    if shape is None:
        _read(t)
        return None
    if not 0 <= i < len(shape):
        return None
    d = _dim(shape[i])
    if isinstance(d, int):
        return d
    memo = _active.get()
    if d is not None and memo is not None and d in memo.declared:
        return d
    if depth <= 0:
        _cut()
        return d
    return _remembered(t, i, depth, lambda: _traced_or(d, t, i, len(shape), depth))


def _traced_or(d: Dim, t: Tensor, i: int, rank: int, depth: int) -> Dim:
    """The traced dim ``i`` of ``t``, else ``d`` (inference's), else its name while :func:`naming_unknown_dims`."""
    traced = _traced_dim(t, i, rank, depth - 1)
    # A traced symbol names the same size as an inferred one, and names it as the producers do
    # (inference invents a fresh ``unk__N`` wherever it loses track).
    if traced is None and d is None and _naming.get():
        return f"<{id(t)}:{i}>"
    return d if traced is None else traced


def _traced_dim(t: Tensor, i: int, rank: int, depth: int) -> Dim:
    """Dim ``i`` of ``t`` (rank ``rank``) from its producer: an exact consequence of the op's definition."""
    node = producer(t)
    if node is None or (node.domain or "") not in ("", "ai.onnx") or not node.inputs:
        return None
    if node.op == "Split":
        return _split_dim(node, t, i, rank, depth)
    if t is not node.outputs[0]:
        return None
    x = node.inputs[0]
    if node.op == "Reshape" and len(node.inputs) > 1:
        return _reshaped_dim(node, i, rank, depth)
    if node.op == "Transpose":
        perm = node.attrs.get("perm")
        perm = list(range(rank))[::-1] if perm is None else [int(p) for p in perm]
        return _dim_at(x, perm[i], depth) if len(perm) == rank else None
    if node.op in UNARY_SAME_SHAPE:
        return _dim_at(x, i, depth)
    if node.op == "Concat":
        return _concat_dim(node, i, rank, depth)
    if (node.op in BATCH_KEEPING and i == 0) or \
            (node.op in ("Slice", "Resize", "Upsample") and _keeps_axis(node, i, rank)):
        return _dim_at(x, i, depth)
    if node.op == "Slice":
        return _capped_dim(node, i, rank, depth)
    if node.op == "Expand" and len(node.inputs) == 2:
        return _expanded_dim(node, i, rank, depth)
    if node.op == "GatherElements" and len(node.inputs) == 2:
        return _dim_at(node.inputs[1], i, depth)  # the output has the indices' shape
    if node.op == "Gather" and len(node.inputs) == 2:
        return _gathered_dim(node, i, rank, depth)
    if node.op in BROADCASTING and len(node.inputs) >= 2:
        return _broadcast_dim(node.inputs, i, rank, depth)
    if node.op == "Gemm" and len(node.inputs) >= 2 and rank == 2:
        # A' @ B' (+ C, broadcast to it): the rows are A''s, the columns B''s
        src, trans = (x, "transA") if i == 0 else (node.inputs[1], "transB")
        return _dim_at(src, i ^ int(bool(node.attrs.get(trans, 0))), depth)
    if node.op == "MatMul" and len(node.inputs) == 2 and rank >= 2:
        return _matmul_dim(node, i, rank, depth)
    if node.op == "Attention" and len(node.inputs) >= 3 and rank == 4:
        # Attention-23 on 4-D (B, heads, seq, head size) inputs: Y is (B, q heads, q seq) of Q, v's head size
        src = node.inputs[2] if i == 3 else x
        if src.shape is None or len(src.shape) != 4:
            _read(src)
            return None
        return _dim_at(src, i, depth)
    return None


def _matmul_dim(node: Node, i: int, rank: int, depth: int) -> Dim:
    """Dim ``i`` of ``[..., M, K] @ [..., K, N]`` with both operands of rank >= 2 (a 1-D one drops an axis):
    the rows come from the first operand, the columns from the second, the batch dims are the operands'
    batch dims broadcast (aligned right, as numpy's matmul does)."""
    if any(x.shape is None or len(x.shape) < 2 for x in node.inputs) \
            or rank != max(len(x.shape) for x in node.inputs):
        for x in node.inputs:  # a 1-D operand drops an axis of the output: not claimed
            _read(x)
        return None
    if i < rank - 2:
        return _broadcast_dim(node.inputs, i, rank, depth)
    src = node.inputs[0] if i == rank - 2 else node.inputs[1]
    return _dim_at(src, len(src.shape) - (rank - i), depth)


def _concat_dim(node: Node, i: int, rank: int, depth: int) -> Dim:
    """Dim ``i`` of a Concat: the sum of the parts' along the axis (a KV cache's past + new), else any part's."""
    axis = int(node.attrs.get("axis", 0))
    if any(x.shape is None or len(x.shape) != rank for x in node.inputs) or not -rank <= axis < rank:
        for x in node.inputs:
            _read(x)
        return None
    if i != axis % rank:
        dims = [_dim_at(x, i, depth) for x in node.inputs]
        return next((d for d in dims if isinstance(d, int)), next((d for d in dims if d is not None), None))
    return dim_sum([_dim_at(x, i, depth) for x in node.inputs])


def _split_dim(node: Node, t: Tensor, i: int, rank: int, depth: int) -> Dim:
    """Dim ``i`` of the Split output ``t``: the input's off the split axis; on it, ``t``'s entry of the
    constant ``split`` (input or attribute), else its share of the input's known dim: equal shares
    (an uneven dim is invalid there), or with ``num_outputs`` (opset 18) ``ceil(dim / n)`` each and
    the rest in the last."""
    x = node.inputs[0]
    axis = int(node.attrs.get("axis", 0))
    if x.shape is None or len(x.shape) != rank or not -rank <= axis < rank:
        _read(x)
        return None
    if i != axis % rank:
        return _dim_at(x, i, depth)
    n, k = len(node.outputs), next(j for j, o in enumerate(node.outputs) if o is t)
    if "split" in node.attrs:  # opset < 13
        sizes = [int(s) for s in node.attrs["split"]]
    elif len(node.inputs) > 1 and node.inputs[1].name:
        sizes = as_int_list(_const(node.inputs[1]))
    else:
        sizes = _equal_shares(_dim_at(x, i, depth), n, node.attrs.get("num_outputs"))
    return sizes[k] if sizes is not None and len(sizes) == n and sizes[k] >= 0 else None


def _equal_shares(d: Dim, n: int, num_outputs: Optional[int]) -> Optional[list[int]]:
    """The sizes a Split without ``split`` gives ``n`` outputs of a dim ``d``; None when ``d`` is not a number
    or does not split so."""
    if not isinstance(d, int) or (num_outputs is not None and int(num_outputs) != n):
        return None
    if num_outputs is None:
        return [d // n] * n if d % n == 0 else None
    share = -(-d // n)
    rest = d - share * (n - 1)
    return [share] * (n - 1) + [rest] if rest > 0 else None


def _keeps_axis(node: Node, i: int, rank: int) -> bool:
    """A Slice that does not slice axis ``i``, or a Resize/Upsample whose constant scale for it is 1."""
    if node.op == "Slice":
        if "starts" in node.attrs:  # opset < 10
            axes = node.attrs.get("axes", list(range(len(node.attrs["starts"]))))
        else:
            starts = small_int_list(node.inputs[1]) if len(node.inputs) > 1 else None
            has_axes = len(node.inputs) > 3 and node.inputs[3].name
            axes = (small_int_list(node.inputs[3]) if has_axes else
                    None if starts is None else list(range(len(starts))))
        return axes is not None and i not in [int(a) % rank for a in axes]
    if len(node.inputs) > 3 and node.inputs[3].name:  # Resize by sizes: inference knows them when constant
        return False
    scales = node.inputs[1] if len(node.inputs) == 2 else node.inputs[2] if len(node.inputs) > 2 else None
    values = None if scales is None or not scales.name else small_const_value(scales)
    return values is not None and values.size == rank and float(values.ravel()[i]) == 1.0


def _capped_dim(node: Node, i: int, rank: int, depth: int) -> Dim:
    """Dim ``i`` of ``Slice(x, 0, E, [i], 1)`` (opset >= 10) where ``E`` is a dim named by a plain symbol and
    x's dim a number ``c >= 1``: ``min(E, c)`` (an end at least 0 is clamped to ``c``), spelled so for
    :func:`_broadcast_dim` (an embedding table's rows sliced to the sequence: ``position_ids[:, :S]``)."""
    x = node.inputs[0]
    if "starts" in node.attrs or len(node.inputs) < 4 or x.shape is None or len(x.shape) != rank:
        return None
    starts, axes = small_int_list(node.inputs[1]), small_int_list(node.inputs[3])
    steps = small_int_list(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4].name else [1]
    ends = shape_elements(node.inputs[2], depth)
    if starts != [0] or steps != [1] or axes is None or len(axes) != 1 or axes[0] % rank != i or ends is None \
            or len(ends[0]) != 1:
        return None
    end, c = ends[0][0], _dim_at(x, i, depth)
    if not isinstance(end, str) or not isinstance(c, int) or c < 1 or " " in end:
        return None
    return f"min({end}, {c})"


def _capped_symbol(d: Dim) -> Optional[str]:
    """The symbol ``E`` of a dim :func:`_capped_dim` spelled ``min(E, c)``, else None."""
    return d[4:d.rindex(", ")] if isinstance(d, str) and d.startswith("min(") and ", " in d else None


def _expanded_dim(node: Node, i: int, rank: int, depth: int) -> Dim:
    """Dim ``i`` of ``Expand(x, shape)``: x's dim broadcast with the target's element (:func:`_broadcast_of`)."""
    x = node.inputs[0]
    target = shape_elements(node.inputs[1], depth)
    if x.shape is None or target is None or len(target[0]) != rank or len(x.shape) > rank \
            or (isinstance(target[0][i], int) and target[0][i] < 0):
        _read(x)
        return None
    j = i - (rank - len(x.shape))
    return _broadcast_of([1 if j < 0 else _dim_at(x, j, depth), target[0][i]])


def _gathered_dim(node: Node, i: int, rank: int, depth: int) -> Dim:
    """Dim ``i`` of ``Gather(data, indices, axis)``: data's dims before and after the axis around the indices'."""
    data, indices = node.inputs
    if data.shape is None or indices.shape is None or len(data.shape) + len(indices.shape) - 1 != rank:
        _read(data)
        _read(indices)
        return None
    axis = int(node.attrs.get("axis", 0)) % len(data.shape)
    if i < axis:
        return _dim_at(data, i, depth)
    if i < axis + len(indices.shape):
        return _dim_at(indices, i - axis, depth)
    return _dim_at(data, i - len(indices.shape) + 1, depth)


def _broadcast_dim(operands: Sequence[Tensor], i: int, rank: int, depth: int) -> Dim:
    """Dim ``i`` of a broadcast of ``operands`` (:func:`_broadcast_of` of their dims, aligned right).

    The dims are traced in order up to the first number other than 1, which is the broadcast's (the later
    operands' dims are not needed)."""
    unknown = next((x for x in operands if x.shape is None), None)
    if unknown is not None:
        _read(unknown)
        return None
    dims = []
    for x in operands:
        j = i - (rank - len(x.shape))
        d = 1 if j < 0 else _dim_at(x, j, depth)
        if isinstance(d, int) and d != 1:
            return d
        dims.append(d)
    return _broadcast_of(dims)


def _broadcast_of(dims: Sequence[Dim]) -> Dim:
    """The broadcast of ``dims``: a number other than 1 wins (the others are 1 or equal); a symbol wins over 1,
    itself, and ``min(itself, c)`` (a valid broadcast of ``E`` with ``min(E, c)``, ``c >= 1``, is ``E``: they are
    equal, or ``E > c`` and ``c`` is 1). An unknown beside a symbol stays unknown (a symbol 1 broadcasts it)."""
    numbers = [d for d in dims if isinstance(d, int) and d != 1]
    if numbers:
        return numbers[0]
    rest = {d for d in dims if d != 1}
    rest -= {d for d in rest if _capped_symbol(d) is not None and _capped_symbol(d) in rest}
    return rest.pop() if len(rest) == 1 else (1 if not rest else None)


def _reshaped_dim(node: Node, i: int, rank: int, depth: int) -> Dim:
    """Dim ``i`` of a Reshape: the target's element, the input's dim for a 0, and for the -1 the quotient
    of the input's dims by the target's others, when their symbols cancel and numbers remain."""
    x = node.inputs[0]
    target = shape_elements(node.inputs[1], depth)
    if target is None or len(target[0]) != rank:
        return None
    copy = not node.attrs.get("allowzero", 0)

    def element(j: int) -> Dim:
        k = target[0][j]
        return _dim_at(x, j, depth) if k == 0 and copy else k

    k = element(i)
    if k != -1:
        return k if k is None or isinstance(k, str) or k >= 0 else None
    others = [element(j) for j in range(rank) if j != i]
    if None in others or -1 in others:
        return None
    numerator = _all_dims(x, depth)
    if numerator is None:
        return None
    num, den = _factors(numerator), _factors(others)
    for d in den[1]:
        if d not in num[1]:
            return None
        num[1].remove(d)
    return dim_product(num[0] // den[0], num[1]) if den[0] > 0 and num[0] % den[0] == 0 else None


def _all_dims(t: Tensor, depth: int) -> Optional[list[Dim]]:
    """:func:`tensor_dims` of ``t`` when no dim is None, else None: traced only up to the first None."""
    if t.shape is None:
        _read(t)
        return None
    dims = []
    for i in range(len(t.shape)):
        d = _dim_at(t, i, depth)
        if d is None:
            return None
        dims.append(d)
    return dims


def _factors(dims: Sequence[Dim]) -> tuple[int, list[str]]:
    """The product of known dims as (number, symbols): a product symbol (:func:`dim_product`) gives its
    factors, any other symbol (a name, a sum) is one factor."""
    number, symbols = 1, []
    for d in dims:
        if isinstance(d, int):
            number *= d
            continue
        for f in d.split(" * ") if " + " not in d else [d]:
            if f.isdigit():
                number *= int(f)
            else:
                symbols.append(f)
    return number, symbols


def dim_product(number: int, symbols: Sequence[str]) -> Dim:
    """``number`` times the sizes ``symbols`` name: a number, a symbol, or a symbol spelling the product
    (``batch * 5``; canonical: names sorted, the number last, as in :func:`dim_sum`); None for a sum
    times something.

    A Reshape's -1 of a flattened batch (``Reshape(Gemm(Reshape(x, [-1, C]), w), [-1, S, C'])``) is then
    the batch again, the flattened ``batch * S`` cancelling.
    """
    if not symbols or number == 0:
        return number
    if (len(symbols) > 1 or number != 1) and any(" + " in d for d in symbols):
        return None  # a sum times something: not spelled (dim_sum would read its terms apart)
    return " * ".join(sorted(symbols) + ([str(number)] if number != 1 else []))


#: Ops whose output has their first input's shape.
UNARY_SAME_SHAPE = frozenset({
    "Cast", "CastLike", "Neg", "Sigmoid", "Tanh", "Relu", "Gelu", "Erf", "Sqrt", "Reciprocal", "Exp", "Softmax",
    "Identity", "Cos", "Sin", "Abs", "Not", "IsNaN", "LeakyRelu", "HardSigmoid", "HardSwish", "LogSoftmax",
    "Elu", "Selu", "Softplus", "Mish", "Floor", "Ceil", "Round", "Sign", "Log", "BatchNormalization",
    "LayerNormalization", "RMSNormalization",
})
#: Ops whose output keeps the input's batch (dim 0) whatever their other dims do.
BATCH_KEEPING = frozenset({"Conv", "ConvTranspose", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool",
                           "LpPool", "InstanceNormalization"})
#: Elementwise ops with multidirectional broadcasting over all their inputs.
BROADCASTING = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Equal", "Less", "Greater", "And", "Or", "Where"})


def shape_dims(node: Node, depth: int = MAX_SHAPE_DEPTH) -> Optional[list[Dim]]:
    """The dims a ``Shape`` node returns, None for unknown ones; None when the rank is unknown."""
    axes = _shape_axes(node)
    return None if axes is None else [_dim_at(node.inputs[0], i, depth) for i in axes]


def _shape_axes(node: Node) -> Optional[range]:
    """The axes of its input a ``Shape`` node returns (``start``/``end`` clamped); None when the rank is unknown.

    Lets a reader trace only the dims it needs (a Gather of a Shape reads one)."""
    x = node.inputs[0]
    if x.shape is None:
        _read(x)
        return None
    n = len(x.shape)
    if not node.attrs:  # the usual Shape: every axis
        return range(n)
    start = int(node.attrs.get("start", 0))
    end = node.attrs.get("end")
    start = min(max(start + n if start < 0 else start, 0), n)
    end = n if end is None else min(max(int(end) + n if end < 0 else int(end), 0), n)
    return range(start, max(start, end))


def fold_shape_value(node: Node) -> Optional[np.ndarray]:
    """The constant value of a Shape/Size/Gather-of-Shape/Slice-of-Shape node (of the standard domain), if its
    dims are known."""
    if node.op in ("Shape", "Size"):
        x = node.inputs[0]
        axes = _shape_axes(node) if node.op == "Shape" else (None if x.shape is None else range(len(x.shape)))
        dims = _known_dims(x, axes)
        if dims is None:
            return None
        return np.array(dims if node.op == "Shape" else int(np.prod(dims, dtype=np.int64)), dtype=np.int64)
    if node.op in ("Gather", "Slice") and node.inputs:
        # _picked_dims(node) at full depth, as the output's elements one level up: remembered across sweeps
        picked = shape_elements(node.outputs[0], MAX_SHAPE_DEPTH + 1)
        if picked is None or not known(picked[0]):
            return None
        return np.array(picked[0], dtype=np.int64).reshape(picked[1])
    if node.op == "Equal" and len(node.inputs) == 2:
        return _fold_equal(node)
    return None


def _known_dims(x: Tensor, axes: Optional[Sequence[int]]) -> Optional[list[int]]:
    """``x``'s dims at ``axes`` when every one is a number (traced only up to the first that is not), else None."""
    if axes is None:
        return None
    dims = []
    for i in axes:
        d = _dim_at(x, i, MAX_SHAPE_DEPTH)
        if not isinstance(d, int):
            return None
        dims.append(d)
    return dims


def _picked_dims(node: Node, depth: int = MAX_SHAPE_DEPTH) -> Optional[Elements]:
    """The dims a Gather/Slice of a ``Shape`` picks and the result's shape (only those dims are traced)."""
    _read(node.inputs[0])
    src = producer(node.inputs[0])
    if src is None or src.op != "Shape":
        return None
    axes = _shape_axes(src)
    if axes is None:
        return None
    picked = _gather(node, len(axes)) if node.op == "Gather" else _slice(node, len(axes))
    if picked is None:
        return None
    return [_dim_at(src.inputs[0], axes[i], depth) for i in picked[0]], picked[1]


def inferred_picked(node: Node) -> Optional[list[Dim]]:
    """The dims a Gather/Slice of a ``Shape`` picks as shape inference gives them (nothing traced): what
    inference's data propagation knows of its value. None when it is no such pick."""
    src = producer(node.inputs[0]) if node.inputs else None
    axes = None if src is None or src.op != "Shape" else _shape_axes(src)
    picked = None if axes is None else _gather(node, len(axes)) if node.op == "Gather" else _slice(node, len(axes))
    return None if picked is None else [_dim(src.inputs[0].shape[axes[i]]) for i in picked[0]]


def shape_elements(t: Tensor, depth: int = MAX_SHAPE_DEPTH) -> Optional[Elements]:
    """What is known of a small integer tensor computed from shapes, element by element.

    Known elements are ints; a symbol or None marks a dim of some tensor,
    unknown but never negative. None as a whole when ``t`` is not such a
    computation. Callers must not modify the result (it may be remembered).
    """
    return _remembered(t, -1, depth, lambda: _shape_elements(t, depth))


def _shape_elements(t: Tensor, depth: int) -> Optional[Elements]:
    c = const_tensor(t)
    if c is not None and not _may_be_shape(c):
        return None  # told by its dtype and shape alone: a weight's data is never read here
    v = _const(t)
    if v is not None:
        v = np.asarray(v)
        if v.dtype.kind not in "iu" or v.ndim > 1 or v.size > MAX_SHAPE_ELEMENTS:
            return None
        return [int(x) for x in v.ravel()], v.shape
    node = producer(t)
    if node is not None:
        _depth_test(depth)
    if node is None or depth <= 0 or (node.domain or "") not in ("", "ai.onnx") or not node.inputs:
        return None
    if node.op == "Shape":
        dims = shape_dims(node, depth - 1)
        return None if dims is None else (dims, (len(dims),))
    if node.op in ("Gather", "Slice"):
        return _picked_dims(node, depth - 1) or _picked_elements(node, depth - 1)
    if node.op == "Unsqueeze":
        inner = shape_elements(node.inputs[0], depth - 1)
        for x in node.inputs[1:]:
            _read(x)  # the axes
        # the axes (attribute before opset 13), an axes input read through the remembered small values
        axes = ([int(a) for a in node.attrs["axes"]] if "axes" in node.attrs else
                None if len(node.inputs) < 2 else as_int_list(_const(node.inputs[1])))
        if inner is None or inner[1] != () or axes not in ([0], [-1]):
            return None
        return inner[0], (1,)
    if node.op == "Reshape" and len(node.inputs) == 2:
        return _reshaped_elements(node, depth)
    if node.op in _ARITHMETIC and len(node.inputs) == 2:
        return _arithmetic_elements(node, depth)
    if node.op == "Cast" and node.attrs.get("to") in _INTEGER_TYPES:
        return shape_elements(node.inputs[0], depth - 1)
    if node.op == "Squeeze":
        inner = shape_elements(node.inputs[0], depth - 1)
        return (inner[0], ()) if inner is not None and inner[1] == (1,) else None
    if node.op == "ReduceProd":
        return _product_elements(node, depth)
    if node.op == "Size":
        dims = _all_dims(node.inputs[0], depth - 1)
        product = None if dims is None else dim_product(*_factors(dims))
        return None if product is None else ([product], ())
    if node.op == "Concat" and int(node.attrs.get("axis", 0)) in (0, -1):
        parts = [shape_elements(x, depth - 1) for x in node.inputs]
        if any(p is None or len(p[1]) != 1 for p in parts):
            return None
        elements = [e for p in parts for e in p[0]]
        return elements, (len(elements),)
    return None


def _may_be_shape(c) -> bool:
    """Could constant ``c`` be a shape computation's elements (integer, rank <= 1, at most
    :data:`MAX_SHAPE_ELEMENTS`)? Asked of its metadata, before any data is read."""
    shape = c.shape
    if shape is None or len(shape) > 1 or (shape and not isinstance(shape[0], int)):
        return False
    if shape and shape[0] > MAX_SHAPE_ELEMENTS:
        return False
    try:
        return np.dtype(c.dtype).kind in "iu"
    except TypeError:  # None, or a type numpy lacks (bfloat16, 4-bit...): not a shape
        return False


def _reshaped_elements(node: Node, depth: int) -> Optional[Elements]:
    """A Reshape of a shape computation to one dim (``[-1]`` or its length) or to a scalar: same elements.

    TorchScript reshapes the pieces of an ``expand`` target so (``Reshape(Concat(...), [-1])``) before
    the ``Equal(shape, -1)``; without this the Equal folds only once remove-noop-ops has dropped the
    Reshape, a fixed-point round later.
    """
    inner = shape_elements(node.inputs[0], depth - 1)
    to = as_int_list(_const(node.inputs[1]))
    if inner is None or to is None:
        return None
    n = len(inner[0])
    if to in ([-1], [n]):
        return inner[0], (n,)
    if to == [] and n == 1:
        return inner[0], ()
    return None


#: ONNX integer element types (TensorProto codes): a Cast of a shape computation to one keeps its elements.
_INTEGER_TYPES = frozenset({2, 3, 4, 5, 6, 7, 12, 13})


def _picked_elements(node: Node, depth: int) -> Optional[Elements]:
    """A Gather/Slice of any 1-D shape computation (a ``Cast`` of a ``Shape``, a ``Concat``...): the picked
    elements. tf2onnx computes shapes in int32 and picks from the cast."""
    src = shape_elements(node.inputs[0], depth)
    if src is None or len(src[1]) != 1:
        return None
    picked = _gather(node, len(src[0])) if node.op == "Gather" else _slice(node, len(src[0]))
    return None if picked is None else ([src[0][i] for i in picked[0]], picked[1])


def _product_elements(node: Node, depth: int) -> Optional[Elements]:
    """``ReduceProd`` of a 1-D shape computation over its only axis: the product of the dims
    (:func:`dim_product`), when none is unknown or negative."""
    inner = shape_elements(node.inputs[0], depth - 1)
    if len(node.inputs) > 1 and node.inputs[1].name:
        axes = as_int_list(_const(node.inputs[1]))
    else:
        axes = node.attrs.get("axes")
        if axes is None and node.attrs.get("noop_with_empty_axes", 0):
            return None
    if inner is None or len(inner[1]) != 1 or (axes is not None and list(axes) not in ([0], [-1])):
        return None
    if any(d is None or (isinstance(d, int) and d < 0) for d in inner[0]):
        return None
    number, symbols = _factors(inner[0])
    product = dim_product(number, symbols)
    if product is None:
        return None
    return [product], ((1,) if node.attrs.get("keepdims", 1) else ())


#: Integer arithmetic on shape computations, element by element.
_ARITHMETIC = frozenset({"Add", "Sub", "Mul", "Div"})


def _arithmetic_elements(node: Node, depth: int) -> Optional[Elements]:
    """``Add``/``Sub``/``Mul``/``Div`` of two shape computations (a scalar or one element broadcast).

    Numbers compute (``Div`` only when exact and non-negative); with a dim (never negative): a dim plus a
    number of at least 0 is their sum (:func:`dim_sum`), a dim times a number of at least 0 or times a
    dim their product (:func:`dim_product`), a product divided by one of its factors the rest, a dim
    less itself 0. Anything else is not known."""
    a, b = (shape_elements(x, depth - 1) for x in node.inputs)
    if a is None or b is None:
        return None
    if len(a[0]) == 1 and len(b[1]) >= len(a[1]):
        a = (a[0] * len(b[0]), b[1])
    if len(b[0]) == 1 and len(a[1]) >= len(b[1]):
        b = (b[0] * len(a[0]), a[1])
    if a[1] != b[1]:
        return None
    out: list[Dim] = []
    for x, y in zip(a[0], b[0]):
        d = _ELEMENT_OPS[node.op](x, y)
        if d is _NOT_KNOWN:
            return None
        out.append(d)
    return out, a[1]


#: What an element op returns when the element is not known (None is an element: an unknown dim).
_NOT_KNOWN = object()


def _add(x: Dim, y: Dim) -> object:
    if isinstance(x, int) and isinstance(y, int):
        return x + y
    if any(isinstance(d, int) and d < 0 for d in (x, y)):
        return _NOT_KNOWN  # a dim minus something may be negative: not an element
    return dim_sum([x, y])


def _sub(x: Dim, y: Dim) -> object:
    if isinstance(x, int) and isinstance(y, int):
        return x - y
    return 0 if isinstance(x, str) and x == y else _NOT_KNOWN


def _mul(x: Dim, y: Dim) -> object:
    if isinstance(x, int) and isinstance(y, int):
        return x * y
    if x is None or y is None or any(isinstance(d, int) and d < 0 for d in (x, y)):
        return _NOT_KNOWN
    number, symbols = _factors([x, y])
    d = dim_product(number, symbols)
    return _NOT_KNOWN if d is None else d


def _div(x: Dim, y: Dim) -> object:
    if isinstance(x, int) and isinstance(y, int):
        return x // y if x >= 0 and y > 0 and x % y == 0 else _NOT_KNOWN
    if not isinstance(x, str) or y is None or (isinstance(y, int) and y <= 0) or (isinstance(x, str) and " + " in x):
        return _NOT_KNOWN
    num, den = _factors([x]), _factors([y])
    for f in den[1]:
        if f not in num[1]:
            return _NOT_KNOWN
        num[1].remove(f)
    if num[0] % den[0]:
        return _NOT_KNOWN
    d = dim_product(num[0] // den[0], num[1])
    return _NOT_KNOWN if d is None else d


_ELEMENT_OPS: dict[str, Callable[[Dim, Dim], object]] = {"Add": _add, "Sub": _sub, "Mul": _mul, "Div": _div}


def _fold_equal(node: Node) -> Optional[np.ndarray]:
    """``Equal`` of two same-shaped shape computations, when every element pair is decided."""
    a, b = (shape_elements(x) for x in node.inputs)
    if a is None or b is None or a[1] != b[1]:
        return None
    out = []
    for x, y in zip(a[0], b[0]):
        numbers = [d for d in (x, y) if isinstance(d, int)]
        if len(numbers) == 2 or (isinstance(x, str) and x == y):
            out.append(x == y)
        elif numbers and numbers[0] < 0:
            out.append(False)
        else:
            return None
    return np.array(out, dtype=bool).reshape(a[1])


def _gather(node: Node, n: int) -> Optional[tuple[list[int], tuple[int, ...]]]:
    """Positions (of ``n``) a Gather on axis 0 picks, flat, and the result's shape; None if not constant or out of range."""
    idx = _const(node.inputs[1]) if len(node.inputs) > 1 else None
    if idx is None or int(node.attrs.get("axis", 0)) not in (0, -1):
        return None
    idx = np.asarray(idx).astype(np.int64)
    flat = idx.ravel().tolist()  # plain ints: numpy is slow on these few elements
    if any(i < -n or i >= n for i in flat):
        return None
    return [i + n if i < 0 else i for i in flat], idx.shape


def _slice(node: Node, n: int) -> Optional[tuple[list[int], tuple[int, ...]]]:
    """Positions (of ``n``) a one-axis Slice on axis 0 takes and the result's shape; None if not constant."""
    if len(node.inputs) < 3:
        return None
    vals = [_const(t) for t in node.inputs[1:]]
    if any(v is None for v in vals[:2]) or any(
        v is None and t.name for v, t in zip(vals[2:], node.inputs[3:])
    ):
        return None
    starts, ends = (np.asarray(v).ravel() for v in vals[:2])
    axes = np.asarray(vals[2]).ravel() if len(vals) > 2 and vals[2] is not None else np.array([0])
    steps = np.asarray(vals[3]).ravel() if len(vals) > 3 and vals[3] is not None else np.ones(1, np.int64)
    if starts.size != 1 or ends.size != 1 or axes.size != 1 or steps.size != 1 or int(axes[0]) not in (0, -1):
        return None
    step = int(steps[0])
    if step == 0:
        return None
    start, end = _clamp(int(starts[0]), n, step), _clamp(int(ends[0]), n, step)
    taken = list(range(n))[slice(start, end if end >= 0 else None, step)]
    return taken, (len(taken),)


def _clamp(v: int, n: int, step: int) -> int:
    """ONNX Slice index clamping (INT64 min/max sentinels included)."""
    if v < 0:
        v += n
    if step > 0:
        return min(max(v, 0), n)
    return min(max(v, -1), n - 1)


def is_shape_consumer(node: Node) -> bool:
    """Ops that read only the shape of their input (their results ignore the data)."""
    return node.op in ("Shape", "Size")


def shape_only_uses(t: Tensor) -> bool:
    """True when every consumer of ``t`` reads only its shape."""
    return bool(t.outputs) and all(is_shape_consumer(n) for n in t.outputs)
