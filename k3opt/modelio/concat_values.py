"""Weights computed from other weights, materialised only when the model is saved.

A merged sibling projection's weight is the concatenation of its siblings'
weights. For a model whose weights live in external data, computing it at
merge time would hold every merged weight in memory at once; a 3.3 GB model
must be optimized in a tenth of that. :func:`concat_last_axis` then returns a
:class:`ConcatValues`: an onnx-graphsurgeon ``LazyValues`` that knows its
shape, dtype and sources. gs's exporter asks a ``LazyValues`` for its
``.tensor`` one constant at a time; that reserves a region of a spill file
and returns an external-data ``TensorProto`` pointing there by absolute
path. The bytes are written later, a block of rows at a time: by
``k3opt.modelio.save`` straight into the model's data file, or into the spill
file when something reads the region first (``k3opt.modelio.defer_spill``). Spill
files follow ``k3opt.modelio``'s convention (``k3opt-spill-*`` in the system temp
folder). Weights already in memory are simply concatenated.
"""
from __future__ import annotations

from typing import BinaryIO, Optional, Sequence, Union

import numpy as np
import onnx
from ..graph import LazyValues, dtypes
from .external import external_tensor, read_external_bytes
from .spill import SpillFile
from .spill_regions import defer_spill

Source = Union[np.ndarray, LazyValues]

#: Bytes of merged rows written at a time.
_BLOCK = 16 * 2**20


def is_external(source: Source) -> bool:
    """True when ``source`` is a not-yet-loaded weight stored in external data."""
    return isinstance(source, LazyValues) and onnx.external_data_helper.uses_external_data(source.tensor)


def read(source: Source) -> np.ndarray:
    """The array of ``source`` without caching it anywhere (the caller drops it when done)."""
    return source.load() if isinstance(source, LazyValues) else np.asarray(source)


def concat_last_axis(sources: Sequence[Source]) -> Union[np.ndarray, "ConcatValues"]:
    """2-D weights concatenated on the last axis: lazily when a source is in external data, else now."""
    if any(is_external(s) for s in sources):
        return ConcatValues(sources)
    return np.concatenate([read(s) for s in sources], axis=-1)


class ConcatValues(LazyValues):
    """The concatenation of 2-D weights on their last axis, computed when first needed.

    Sources are the siblings' own ``LazyValues`` or arrays (never a copy), so
    merging costs no memory; ``load()`` (a pass reading ``Constant.values``)
    returns the array, ``tensor`` (gs export, or a pass looking at the proto)
    reserves its spill region once and returns the external-data ``TensorProto``.
    """

    def __init__(self, sources: Sequence[Source]):
        shapes = [tuple(int(d) for d in s.shape) for s in sources]
        if not shapes or any(len(s) != 2 or s[0] != shapes[0][0] for s in shapes):
            raise ValueError(f"ConcatValues needs 2-D sources with equal rows, got {shapes}")
        self.sources = list(sources)
        self.dtype = sources[0].dtype
        self.shape = (shapes[0][0], sum(s[1] for s in shapes))
        self._spilled: Optional[onnx.TensorProto] = None
        itemsize = dtypes.numpy_dtype(dtypes.onnx_type(self.dtype)).itemsize
        self.nbytes = self.shape[0] * self.shape[1] * itemsize

    def load(self) -> np.ndarray:
        return np.concatenate([read(s) for s in self.sources], axis=-1)

    @property
    def tensor(self) -> onnx.TensorProto:
        """The weight as an external-data ``TensorProto`` in the spill file (written on first use)."""
        if self._spilled is None:
            self._spilled = self._spill()
        return self._spilled

    def _spill(self) -> onnx.TensorProto:
        """Reserve the concatenation's region in the spill file; its bytes are written on demand.

        ``k3opt.modelio.save`` has :meth:`write_to` produce them straight into the
        output's data file; a reader of the region writes them into the spill
        file first (see ``k3opt.modelio.defer_spill``).
        """
        spill = SpillFile.get()
        offset = spill.allocate(self.nbytes)
        defer_spill(spill.path, offset, self.write_to)
        return external_tensor("", dtypes.onnx_type(self.dtype), self.shape, spill.path, offset, self.nbytes)

    def write_to(self, f: BinaryIO) -> None:
        """Write the concatenation's bytes at ``f``'s position, a block of rows at a time (flat memory)."""
        rows = self.shape[0]
        itemsize = self.nbytes // (rows * self.shape[1]) if self.nbytes else 1
        raw = np.dtype((np.void, itemsize))
        widths = [int(s.shape[1]) for s in self.sources]
        step = max(1, _BLOCK // max(1, self.shape[1] * itemsize))
        in_memory = {i: np.ascontiguousarray(read(s)).view(raw) for i, s in enumerate(self.sources)
                     if not is_external(s)}
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            block = np.empty((r1 - r0, self.shape[1]), dtype=raw)
            col = 0
            for i, (source, width) in enumerate(zip(self.sources, widths)):
                if i in in_memory:
                    block[:, col : col + width] = in_memory[i][r0:r1]
                else:
                    data = read_external_bytes(source.tensor, r0 * width * itemsize, (r1 - r0) * width * itemsize)
                    block[:, col : col + width] = np.frombuffer(data, dtype=raw).reshape(r1 - r0, width)
                    del data
                col += width
            f.write(block.data)
            del block

    def __str__(self) -> str:
        return f"ConcatValues (shape={self.shape}, dtype={self.dtype}, sources={len(self.sources)})"
