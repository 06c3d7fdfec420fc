"""The manifest of a serving pair (``manifest.json``): how to drive it and how ATC should compile it.

Read by ``k3opt generate`` (names, cache layout, lengths), ``k3opt compile``
and ``k3opt check`` (ATC input shapes and ``--dynamic_dims`` gears). Layout::

    {"format": "k3opt-llm-pair/1", "target": "onnx"|"cann", "max_seq": L, "max_batch": B,
     "weights": "weights.bin", "dtype": "float32", "vocab": V,
     "names": {"ids": ..., "mask": ..., "position": ..., "logits": ...},
     "cache": {"layout": "BNSD", "entries": [{"past": ..., "present": ..., "heads": Hkv, "dim": D}, ...]},
     "prefill": {"file": "prefill.onnx", "inputs": {name: [dims with -1 for a gear dim]},
                 "gears": {"batch": [...], "sequence": [...]}, "dynamic_dims": [[b, t, b, t], ...]},
     "decode": {"<b>": {"file": "decode_b<b>.onnx", "inputs": {name: [static dims]}}, ...},
     "verification": {"status": "passed", "graphs": {"prefill.onnx": "passed (...)", ...},
                      "tokens": "identical to ..."}}

``verification``: each graph's check against its rewrite (k3opt's verification line, and the lowered
graph's under the reference NPU ops for cann) and the token check; ``{"status": "skipped", "reason":
"--no-verify"}`` without them.

Decode: one static graph per batch size (powers of two up to ``max_batch``,
and ``max_batch``): ATC compiles each without gears, and a runtime pads a
batch up to the next size. Prefill: batch and prompt length are gear dims,
``--dynamic_dims`` lists every (batch, length bucket) pair, within ATC's
100-profile limit (lengths are powers of two from 16, and ``max_seq``).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ..errors import InputError

FORMAT = "k3opt-llm-pair/1"
MANIFEST = "manifest.json"
#: ATC's --dynamic_dims takes 2 to 100 profiles (docs: /work/shared/docs/atc-reference.md, "Dynamic options").
MAX_PROFILES = 100
_MIN_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class Entry:
    past: str
    present: str
    heads: int
    dim: int


def batch_sizes(max_batch: int) -> list[int]:
    """The decode graphs' batch sizes: powers of two below ``max_batch``, and ``max_batch``."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


def length_buckets(max_seq: int, profiles: int) -> list[int]:
    """Prompt-length gears: powers of two from 16 below ``max_seq``, and ``max_seq``, at most ``profiles``."""
    sizes, t = [], _MIN_BUCKET
    while t < max_seq:
        sizes.append(t)
        t *= 2
    sizes = (sizes + [max_seq])[-profiles:]
    return sizes


def prefill_gears(max_seq: int, max_batch: int) -> dict[str, list[int]]:
    """Batch and length gears whose product stays within ATC's profile limit (2 profiles at least)."""
    batches = batch_sizes(max_batch)
    lengths = length_buckets(max_seq, max(1, MAX_PROFILES // len(batches)))
    if len(batches) * len(lengths) < 2:  # ATC wants 2..100 profiles: add the one-token prompt
        lengths = sorted({1, *lengths})
    return {"batch": batches, "sequence": lengths}


@dataclasses.dataclass
class Manifest:
    """A pair's manifest in memory (see the module doc for the JSON)."""

    target: str
    max_seq: int
    max_batch: int
    dtype: str
    vocab: Optional[int]
    names: dict[str, str]
    entries: list[Entry]
    prefill: str
    decode: dict[int, str]
    weights: Optional[str] = None
    verification: Optional[dict[str, Any]] = None
    folder: Optional[Path] = None

    ids = property(lambda self: self.names["ids"])
    mask = property(lambda self: self.names["mask"])
    position = property(lambda self: self.names["position"])
    logits = property(lambda self: self.names["logits"])

    @property
    def np_dtype(self) -> Any:
        return np.dtype(self.dtype)

    def decode_batch(self, batch: int) -> int:
        """The smallest decode graph batch size that holds ``batch`` rows."""
        fits = [b for b in self.decode if b >= batch]
        if not fits:
            raise InputError(f"{batch} prompts: the pair was built with --max-batch {self.max_batch}")
        return min(fits)

    def prefill_inputs(self) -> dict[str, list[int]]:
        return {self.ids: [-1, -1], self.mask: [-1, -1]}

    def decode_inputs(self, batch: int) -> dict[str, list[int]]:
        shapes = {self.ids: [batch, 1], self.mask: [batch, self.max_seq], self.position: [1]}
        shapes.update({e.past: [batch, e.heads, self.max_seq, e.dim] for e in self.entries})
        return shapes

    def to_json(self) -> dict[str, Any]:
        gears = prefill_gears(self.max_seq, self.max_batch)
        return {
            "format": FORMAT, "target": self.target, "max_seq": self.max_seq, "max_batch": self.max_batch,
            "weights": self.weights, "dtype": self.dtype, "vocab": self.vocab, "names": self.names,
            "cache": {"layout": "BNSD", "entries": [dataclasses.asdict(e) for e in self.entries]},
            "prefill": {"file": self.prefill, "inputs": self.prefill_inputs(), "gears": gears,
                        "dynamic_dims": [[b, t, b, t] for b in gears["batch"] for t in gears["sequence"]]},
            "decode": {str(b): {"file": f, "inputs": self.decode_inputs(b)} for b, f in sorted(self.decode.items())},
            **({"verification": dict(self.verification)} if self.verification is not None else {}),
        }

    def write(self, folder: Path) -> None:
        (Path(folder) / MANIFEST).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def read(cls, folder: Any) -> "Manifest":
        """The manifest of pair folder ``folder``; InputError when it is missing or not one."""
        path = Path(folder) / MANIFEST
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise InputError(f"{folder}: not a k3opt llm pair (no {MANIFEST}; write one with k3opt llm)") from None
        except (OSError, ValueError) as exc:
            raise InputError(f"{path}: unreadable manifest ({exc})") from None
        return cls.from_json(data, folder, path)

    @classmethod
    def from_json(cls, data: Any, folder: Any, path: Any) -> "Manifest":
        """The manifest in ``data`` (the JSON of :meth:`to_json`) of the pair in ``folder``; InputError naming
        ``path`` when it is not one."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise InputError(f"{path}: not a {FORMAT} manifest")
        try:
            return cls(target=data["target"], max_seq=int(data["max_seq"]), max_batch=int(data["max_batch"]),
                       dtype=data["dtype"], vocab=data.get("vocab"), names=dict(data["names"]),
                       entries=[Entry(**e) for e in data["cache"]["entries"]], prefill=data["prefill"]["file"],
                       decode={int(b): d["file"] for b, d in data["decode"].items()}, weights=data.get("weights"),
                       verification=data.get("verification"), folder=Path(folder))
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"{path}: malformed manifest ({exc})") from None

    def graphs(self) -> list[tuple[str, dict[str, list[int]], Optional[list[list[int]]]]]:
        """(file, ATC input shapes, --dynamic_dims profiles or None) of every graph of the pair."""
        data = self.to_json()
        out = [(self.prefill, data["prefill"]["inputs"], data["prefill"]["dynamic_dims"])]
        out += [(d["file"], d["inputs"], None) for d in data["decode"].values()]
        return out
