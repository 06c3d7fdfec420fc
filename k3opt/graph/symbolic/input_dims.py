"""The graph inputs' symbols written, for the duration of a block, into the shapes of the tensors whose dims
tracing proves to be them.

Shape inference loses the batch of a dynamo BERT's or ViT's residual stream at its first broadcast (the
embeddings plus the position embeddings, ``position_ids[:, :S]``), and every layer's q/k/v then has a batch
and sequence that only tracing through every earlier layer recovers: more than the tracing depth
(:data:`~k3opt.graph.symbolic.dims.MAX_SHAPE_DEPTH`) past the first layers. Walking the nodes in
order and writing each proven ``batch``/``sequence`` into the tensor's shape makes it a declared symbol,
which tracing takes as it is: a dim read in any layer is then found a few producers up, in linear time.

Exact: a written dim is what :meth:`Dims.at <k3opt.graph.symbolic.dims.Dims.at>` proves, the size the graph's
input declares. The shapes are restored when the block ends (the optimizer's output keeps inference's).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from ..ir import Graph
from .dims import Dims


@contextmanager
def input_dims_written(graph: Graph) -> Iterator[int]:
    """Within the block, each dim of a node output that inference left unknown (or named apart) and tracing
    proves to be a number or a graph input's symbol carries it; yields how many tensors changed."""
    dims = Dims(graph)  # its own: the shapes it writes would make a kept one's results stale
    declared = dims.declared
    saved = []
    try:
        if declared:
            for node in graph.nodes:
                for t in node.outputs:
                    shape = t.shape
                    if shape is None or all(isinstance(d, int) or d in declared for d in shape):
                        continue
                    proven = [d if isinstance(d, int) or d in declared else dims.at(t, i) for i, d in enumerate(shape)]
                    proven = [d if isinstance(d, int) or d in declared else shape[i] for i, d in enumerate(proven)]
                    if proven != list(shape):
                        saved.append((t, shape))
                        t.shape = type(shape)(proven)
        yield len(saved)
    finally:
        for t, shape in reversed(saved):
            t.shape = shape
