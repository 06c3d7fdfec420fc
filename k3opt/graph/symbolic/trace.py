"""A dim from its producer: each op's output dims as exact consequences of the op's definition.

:func:`traced_dim` looks the producer's op up in :data:`TRACERS`; each tracer reads the dims it needs of the
op's inputs through the :class:`~k3opt.graph.symbolic.dims.Dims` it is given (which remembers them), and
returns a number, a symbol (:mod:`.algebra`) or None. Reshape targets are read element by element
(:meth:`Dims.elements`), the -1 as a quotient; Concat's axis is the sum of the parts'; Split's sizes are its
constant ``split`` or equal shares; a ``Slice(x, 0, S)`` of a static dim ``c`` is ``min(S, c)``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence

from ..ir import Node, Tensor, as_int_list, producer
from ..small_constants import small_const_value, small_int_list
from .algebra import Dim, broadcast_of, capped, dim_sum, quotient

if TYPE_CHECKING:
    from .dims import Dims

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

#: ``(dims, node, i, rank, depth) -> dim i`` of the node's first output (rank ``rank``), tracing inputs at ``depth``.
Tracer = Callable[["Dims", Node, int, int, int], Dim]


def traced_dim(dims: Dims, t: Tensor, i: int, rank: int, depth: int) -> Dim:
    """Dim ``i`` of ``t`` (rank ``rank``) from its producer (standard domain), else None."""
    node = producer(t)
    if node is None or (node.domain or "") not in ("", "ai.onnx") or not node.inputs:
        return None
    if node.op == "Split":  # the only op traced for its every output
        return _split_dim(dims, node, t, i, rank, depth)
    tracer = TRACERS.get(node.op)
    return None if tracer is None or t is not node.outputs[0] else tracer(dims, node, i, rank, depth)


def _same_dim(dims: Dims, node: Node, i: int, rank: int, depth: int) -> Dim:
    """An op whose output has its input's shape."""
    return dims.at(node.inputs[0], i, depth)


def _batch_dim(dims: Dims, node: Node, i: int, rank: int, depth: int) -> Dim:
    """An op that keeps its input's batch (dim 0)."""
    return dims.at(node.inputs[0], i, depth) if i == 0 else None


def _transposed_dim(dims: Dims, node: Node, i: int, rank: int, depth: int) -> Dim:
    perm = node.attrs.get("perm")
    perm = list(range(rank))[::-1] if perm is None else [int(p) for p in perm]
    return dims.at(node.inputs[0], perm[i], depth) if len(perm) == rank else None


def _reshaped_dim(dims: Dims, node: Node, i: int, rank: int, depth: int) -> Dim:
    """Dim ``i`` of a Reshape: the target's element, the input's dim for a 0, and for the -1 the quotient
    of the input's dims by the target's others, when their symbols cancel and numbers remain."""
    if len(node.inputs) < 2:
        return None
    x = node.inputs[0]
    target = dims.elements(node.inputs[1], depth)
    if target is None or len(target[0]) != rank:
        return None
    copy = not node.attrs.get("allowzero", 0)

    def element(j: int) -> Dim:
        k = target[0][j]
        return dims.at(x, j, depth) if k == 0 and copy else k

    k = element(i)
    if k != -1:
        return k if k is None or isinstance(k, str) or k >= 0 else None
    others = [element(j) for j in range(rank) if j != i]
    if None in others or -1 in others:
        return None
    numerator = dims.complete(x, depth)
    return None if numerator is None else quotient(numerator, others)


def _concat_dim(dims: Dims, node: Node, i: int, rank: int, depth: int) -> Dim:
    """Dim ``i`` of a Concat: the sum of the parts' along the axis (a KV cache's past + new), else any part's."""
    axis = int(node.attrs.get("axis", 0))
    if any(x.shape is None or len(x.shape) != rank for x in node.inputs) or not -rank <= axis < rank:
        for x in node.inputs:
            dims.read(x)
        return None
    if i != axis % rank:
        found = [dims.at(x, i, depth) for x in node.inputs]
        return next((d for d in found if isinstance(d, int)), next((d for d in found if d is not None), None))
    return dim_sum([dims.at(x, i, depth) for x in node.inputs])


def _split_dim(dims: Dims, node: Node, t: Tensor, i: int, rank: int, depth: int) -> Dim:
    """Dim ``i`` of the Split output ``t``: the input's off the split axis; on it, ``t``'s entry of the
    constant ``split`` (input or attribute), else its share of the input's known dim: equal shares
    (an uneven dim is invalid there), or with ``num_outputs`` (opset 18) ``ceil(dim / n)`` each and
    the rest in the last."""
    x = node.inputs[0]
    axis = int(node.attrs.get("axis", 0))
    if x.shape is None or len(x.shape) != rank or not -rank <= axis < rank:
        dims.read(x)
        return None
    if i != axis % rank:
        return dims.at(x, i, depth)
    n, k = len(node.outputs), next(j for j, o in enumerate(node.outputs) if o is t)
    if "split" in node.attrs:  # opset < 13
        sizes = [int(s) for s in node.attrs["split"]]
    elif len(node.inputs) > 1 and node.inputs[1].name:
        sizes = as_int_list(dims.const(node.inputs[1]))
    else:
        sizes = _equal_shares(dims.at(x, i, depth), n, node.attrs.get("num_outputs"))
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


def _sliced_dim(dims: Dims, node: Node, i: int, rank: int, depth: int) -> Dim:
    """A Slice: the input's dim on an axis it does not slice, else :func:`_capped_dim`."""
    if _keeps_axis(node, i, rank):
        return dims.at(node.inputs[0], i, depth)
    return _capped_dim(dims, node, i, rank, depth)


def _resized_dim(dims: Dims, node: Node, i: int, rank: int, depth: int) -> Dim:
    """A Resize/Upsample: the input's dim where its constant scale is 1."""
    return dims.at(node.inputs[0], i, depth) if _keeps_axis(node, i, rank) else None


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


def _capped_dim(dims: Dims, node: Node, i: int, rank: int, depth: int) -> Dim:
    """Dim ``i`` of ``Slice(x, 0, E, [i], 1)`` (opset >= 10) where ``E`` is a dim named by a plain symbol and
    x's dim a number ``c >= 1``: ``min(E, c)`` (an end at least 0 is clamped to ``c``), spelled so for
    :func:`~.algebra.broadcast_of` (an embedding table's rows sliced to the sequence: ``position_ids[:, :S]``)."""
    x = node.inputs[0]
    if "starts" in node.attrs or len(node.inputs) < 4 or x.shape is None or len(x.shape) != rank:
        return None
    starts, axes = small_int_list(node.inputs[1]), small_int_list(node.inputs[3])
    steps = small_int_list(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4].name else [1]
    ends = dims.elements(node.inputs[2], depth)
    if starts != [0] or steps != [1] or axes is None or len(axes) != 1 or axes[0] % rank != i or ends is None \
            or len(ends[0]) != 1:
        return None
    end, c = ends[0][0], dims.at(x, i, depth)
    if not isinstance(end, str) or not isinstance(c, int) or c < 1 or " " in end:
        return None
    return capped(end, c)


def _expanded_dim(dims: Dims, node: Node, i: int, rank: int, depth: int) -> Dim:
    """Dim ``i`` of ``Expand(x, shape)``: x's dim broadcast with the target's element (:func:`~.algebra.broadcast_of`)."""
    if len(node.inputs) != 2:
        return None
    x = node.inputs[0]
    target = dims.elements(node.inputs[1], depth)
    if x.shape is None or target is None or len(target[0]) != rank or len(x.shape) > rank \
            or (isinstance(target[0][i], int) and target[0][i] < 0):
        dims.read(x)
        return None
    j = i - (rank - len(x.shape))
    return broadcast_of([1 if j < 0 else dims.at(x, j, depth), target[0][i]])


def _gathered_elements_dim(dims: Dims, node: Node, i: int, rank: int, depth: int) -> Dim:
    """GatherElements: the output has the indices' shape."""
    return dims.at(node.inputs[1], i, depth) if len(node.inputs) == 2 else None


def _gathered_dim(dims: Dims, node: Node, i: int, rank: int, depth: int) -> Dim:
    """Dim ``i`` of ``Gather(data, indices, axis)``: data's dims before and after the axis around the indices'."""
    if len(node.inputs) != 2:
        return None
    data, indices = node.inputs
    if data.shape is None or indices.shape is None or len(data.shape) + len(indices.shape) - 1 != rank:
        dims.read(data)
        dims.read(indices)
        return None
    axis = int(node.attrs.get("axis", 0)) % len(data.shape)
    if i < axis:
        return dims.at(data, i, depth)
    if i < axis + len(indices.shape):
        return dims.at(indices, i - axis, depth)
    return dims.at(data, i - len(indices.shape) + 1, depth)


def _broadcasting_dim(dims: Dims, node: Node, i: int, rank: int, depth: int) -> Dim:
    return broadcast_dim(dims, node.inputs, i, rank, depth) if len(node.inputs) >= 2 else None


def broadcast_dim(dims: Dims, operands: Sequence[Tensor], i: int, rank: int, depth: int) -> Dim:
    """Dim ``i`` of a broadcast of ``operands`` (:func:`~.algebra.broadcast_of` of their dims, aligned right).

    The dims are traced in order up to the first number other than 1, which is the broadcast's (the later
    operands' dims are not needed)."""
    unknown = next((x for x in operands if x.shape is None), None)
    if unknown is not None:
        dims.read(unknown)
        return None
    found = []
    for x in operands:
        j = i - (rank - len(x.shape))
        d = 1 if j < 0 else dims.at(x, j, depth)
        if isinstance(d, int) and d != 1:
            return d
        found.append(d)
    return broadcast_of(found)


def _gemm_dim(dims: Dims, node: Node, i: int, rank: int, depth: int) -> Dim:
    """A' @ B' (+ C, broadcast to it): the rows are A''s, the columns B''s."""
    if len(node.inputs) < 2 or rank != 2:
        return None
    src, trans = (node.inputs[0], "transA") if i == 0 else (node.inputs[1], "transB")
    return dims.at(src, i ^ int(bool(node.attrs.get(trans, 0))), depth)


def _matmul_dim(dims: Dims, node: Node, i: int, rank: int, depth: int) -> Dim:
    """Dim ``i`` of ``[..., M, K] @ [..., K, N]`` with both operands of rank >= 2 (a 1-D one drops an axis):
    the rows come from the first operand, the columns from the second, the batch dims are the operands'
    batch dims broadcast (aligned right, as numpy's matmul does)."""
    if len(node.inputs) != 2 or rank < 2:
        return None
    if any(x.shape is None or len(x.shape) < 2 for x in node.inputs) \
            or rank != max(len(x.shape) for x in node.inputs):
        for x in node.inputs:  # a 1-D operand drops an axis of the output: not claimed
            dims.read(x)
        return None
    if i < rank - 2:
        return broadcast_dim(dims, node.inputs, i, rank, depth)
    src = node.inputs[0] if i == rank - 2 else node.inputs[1]
    return dims.at(src, len(src.shape) - (rank - i), depth)


def _attention_dim(dims: Dims, node: Node, i: int, rank: int, depth: int) -> Dim:
    """Attention-23 on 4-D (B, heads, seq, head size) inputs: Y is (B, q heads, q seq) of Q, v's head size."""
    if len(node.inputs) < 3 or rank != 4:
        return None
    src = node.inputs[2] if i == 3 else node.inputs[0]
    if src.shape is None or len(src.shape) != 4:
        dims.read(src)
        return None
    return dims.at(src, i, depth)


#: The tracer of each op's first output (Split's are all traced: :func:`traced_dim`).
TRACERS: dict[str, Tracer] = {
    **dict.fromkeys(UNARY_SAME_SHAPE, _same_dim),
    **dict.fromkeys(BATCH_KEEPING, _batch_dim),
    **dict.fromkeys(BROADCASTING, _broadcasting_dim),
    **dict.fromkeys(("Resize", "Upsample"), _resized_dim),
    "Reshape": _reshaped_dim,
    "Transpose": _transposed_dim,
    "Concat": _concat_dim,
    "Slice": _sliced_dim,
    "Expand": _expanded_dim,
    "GatherElements": _gathered_elements_dim,
    "Gather": _gathered_dim,
    "Gemm": _gemm_dim,
    "MatMul": _matmul_dim,
    "Attention": _attention_dim,
}
