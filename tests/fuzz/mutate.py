"""Mutators: each takes a seeded ``random.Random`` and returns what it broke, in words (for the report of a
violation), so that a case is reproduced from its seed alone.

- :func:`protobuf`: bytes of a serialized model: bit flips, truncation, overwritten, inserted, deleted or
  repeated runs, a length prefix made huge;
- :func:`graph`: the ModelProto: node inputs rewired, nodes dropped, doubled or reordered, op types and
  domains swapped, attributes set to hostile values, initializer dims/types/bytes changed, graph inputs and
  outputs retyped or reshaped, opset and IR versions, name collisions, the same inside bodies;
- :func:`external`: a model keeping its weights in ``w.bin``: locations outside the folder, through links,
  onto devices, FIFOs, folders or missing files; offsets and lengths negative, huge, non-numeric or short.
"""
from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper

#: Bytes of a file outside the model's folder: never to be found in anything k3opt writes.
SECRET = b"K3OPT-FUZZ-SECRET-" * 16

HOSTILE_INTS = [-(2**63), -(2**31), -2, -1, 0, 1, 2, 3, 7, 64, 2**31, 2**40, 2**62, 2**63 - 1]
HOSTILE_DIMS = [0, 1, 2, 3, 5, -1, -7, 2**40, 2**62]
OPS = ["Relu", "Add", "MatMul", "Reshape", "Gather", "Concat", "Transpose", "Softmax", "LayerNormalization",
       "Attention", "If", "Loop", "Scan", "Identity", "Dropout", "Cast", "Foo", "", "Constant", "RandomNormalLike",
       "Split", "Slice", "Expand", "Where", "ReduceMean", "Gemm", "Conv", "Einsum"]


# --------------------------------------------------------------------------- protobuf level


def protobuf(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """``data`` broken at the byte level; (new bytes, what was done)."""
    b = bytearray(data)
    n = len(b)
    kind = rng.choice(["flip", "flips", "truncate", "overwrite", "insert", "delete", "repeat", "length"])
    at = rng.randrange(max(n, 1))
    if kind == "flip":
        b[at] ^= 1 << rng.randrange(8)
    elif kind == "flips":
        for _ in range(rng.randint(2, 32)):
            b[rng.randrange(n)] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        del b[at:]
    elif kind == "overwrite":
        b[at:at + 8] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    elif kind == "insert":
        b[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    elif kind == "delete":
        del b[at:at + rng.randint(1, 64)]
    elif kind == "repeat":
        size = rng.randint(1, 256)
        b[at:at] = b[rng.randrange(n):][:size]
    else:  # a varint (a length or a field tag) made as big as a varint goes
        b[at:at + 1] = b"\xff" * rng.randint(1, 10) + b"\x7f"
    return bytes(b), f"protobuf {kind} at {at} of {n}"


# --------------------------------------------------------------------------- graph level


def _names(graph: onnx.GraphProto) -> list[str]:
    return ([i.name for i in graph.input] + [t.name for t in graph.initializer]
            + [o for n in graph.node for o in n.output] + ["ghost", ""])


def _rewire(graph, rng):
    node = rng.choice(graph.node)
    if not node.input:
        node.input.append(rng.choice(_names(graph)))
        return f"input added to {node.op_type}"
    i = rng.randrange(len(node.input))
    node.input[i] = rng.choice(_names(graph))
    return f"{node.op_type} input {i} -> '{node.input[i]}'"


def _drop(graph, rng):
    i = rng.randrange(len(graph.node))
    op = graph.node[i].op_type
    del graph.node[i]
    return f"dropped {op}"


def _double(graph, rng):
    node = rng.choice(graph.node)
    graph.node.append(node)
    return f"doubled {node.op_type}"


def _reorder(graph, rng):
    nodes = list(graph.node)
    rng.shuffle(nodes)
    del graph.node[:]
    graph.node.extend(nodes)
    return "nodes shuffled"


def _op_type(graph, rng):
    node = rng.choice(graph.node)
    old, node.op_type = node.op_type, rng.choice(OPS)
    return f"{old} -> {node.op_type}"


def _domain(graph, rng):
    node = rng.choice(graph.node)
    node.domain = rng.choice(["com.microsoft", "bogus", "ai.onnx", "ai.onnx.ml", "com.k3opt"])
    return f"{node.op_type} domain -> {node.domain}"


def _attribute(graph, rng):
    node = rng.choice(graph.node)
    choice = rng.randrange(4)
    if choice == 0 or not node.attribute:
        name = rng.choice(["axis", "perm", "to", "axes", "epsilon", "keepdims", "seed", "bogus"])
        value = rng.choice([rng.choice(HOSTILE_INTS), [rng.choice(HOSTILE_INTS)] * rng.randint(1, 4),
                            float(rng.choice([float("nan"), float("inf"), -1e30, 0.0])), "text"])
        node.attribute.append(helper.make_attribute(name, value))
        return f"{node.op_type} attribute {name}={value!r} added"
    attr = rng.choice(node.attribute)
    if choice == 1:
        node.attribute.remove(attr)
        return f"{node.op_type} attribute {attr.name} removed"
    if choice == 2:
        attr.type = rng.choice([t for t in AttributeProto.AttributeType.values() if t != attr.type])
        return f"{node.op_type} attribute {attr.name} retyped {attr.type}"
    if attr.type == AttributeProto.INT:
        attr.i = rng.choice(HOSTILE_INTS)
    elif attr.type == AttributeProto.INTS:
        attr.ints[:] = [rng.choice(HOSTILE_INTS) for _ in range(rng.randint(0, 5))]
    elif attr.type == AttributeProto.FLOAT:
        attr.f = rng.choice([float("nan"), float("inf"), -1.0, 0.0, 1e38])
    elif attr.type == AttributeProto.TENSOR:
        _tensor(attr.t, rng)
    elif attr.type == AttributeProto.GRAPH and attr.g.node:
        return "in a body: " + rng.choice(GRAPH_MUTATIONS[:-1])(attr.g, rng)
    return f"{node.op_type} attribute {attr.name} set"


def _tensor(t: TensorProto, rng) -> str:
    kind = rng.randrange(5)
    if kind == 0:
        t.dims[:] = [rng.choice(HOSTILE_DIMS) for _ in range(rng.randint(0, 4))]
    elif kind == 1:
        t.data_type = rng.choice([v for v in TensorProto.DataType.values()] + [99])
    elif kind == 2 and t.raw_data:
        t.raw_data = t.raw_data[: rng.randrange(len(t.raw_data))]
    elif kind == 3:
        t.raw_data = t.raw_data + bytes(rng.randint(1, 16))
    else:
        values = np.frombuffer(t.raw_data, np.uint8).copy() if t.raw_data else np.zeros(0, np.uint8)
        if values.size:
            values[rng.randrange(values.size)] = 0xFF  # a float turned NaN-ish, an index huge
        t.raw_data = values.tobytes()
    return f"tensor {t.name} mutation {kind}"


def _initializer(graph, rng):
    if not graph.initializer:
        return _rewire(graph, rng)
    return _tensor(rng.choice(graph.initializer), rng)


def _value_info(graph, rng):
    vi = rng.choice(list(graph.input) + list(graph.output))
    kind = rng.randrange(4)
    tt = vi.type.tensor_type
    if kind == 0:
        tt.elem_type = rng.choice([v for v in TensorProto.DataType.values()])
    elif kind == 1:
        tt.shape.Clear()
        for _ in range(rng.randint(0, 4)):
            d = tt.shape.dim.add()
            if rng.random() < 0.3:
                d.dim_param = rng.choice(["n", "batch", ""])
            else:
                d.dim_value = rng.choice(HOSTILE_DIMS)
    elif kind == 2:
        vi.ClearField("type")
    else:
        vi.name = rng.choice(_names(graph))
    return f"{vi.name} type/shape mutation {kind}"


def _outputs(graph, rng):
    kind = rng.randrange(3)
    if kind == 0 and graph.output:
        graph.output.append(rng.choice(graph.output))
        return "an output listed twice"
    if kind == 1:
        del graph.output[:]
        return "no outputs"
    names = [o for n in graph.node for o in n.output if o] + [i.name for i in graph.input]
    graph.output.append(helper.make_tensor_value_info(rng.choice(names), TensorProto.FLOAT, None))
    return "an intermediate made an output"


def _collide(graph, rng):
    node = rng.choice(graph.node)
    taken = [i.name for i in graph.input] + [t.name for t in graph.initializer]
    if not taken or not node.output:
        return _rewire(graph, rng)
    node.output[0] = rng.choice(taken)
    return f"{node.op_type} output named '{node.output[0]}' (an input's name)"


def _init_as_input(graph, rng):
    if not graph.initializer:
        return _rewire(graph, rng)
    t = rng.choice(graph.initializer)
    graph.input.append(helper.make_tensor_value_info(t.name, rng.choice([TensorProto.FLOAT, TensorProto.INT64]),
                                                     [rng.choice(HOSTILE_DIMS)]))
    return f"initializer {t.name} also a graph input"


GRAPH_MUTATIONS: list[Callable] = [_rewire, _drop, _double, _reorder, _op_type, _domain, _attribute,
                                   _initializer, _value_info, _outputs, _collide, _init_as_input]


def graph(model: onnx.ModelProto, rng: random.Random) -> str:
    """Break ``model`` in place at the graph level (1 to 3 mutations, or a version); what was done."""
    if rng.random() < 0.1:
        model.ir_version = rng.choice([0, 1, 3, 4, 7, 11, 13, 99])
        return f"ir_version {model.ir_version}"
    if rng.random() < 0.1:
        model.opset_import[0].version = rng.choice([1, 6, 7, 9, 11, 13, 18, 21, 22, 24, 28, 99])
        return f"opset {model.opset_import[0].version}"
    done = []
    for _ in range(rng.randint(1, 3)):
        if not model.graph.node:
            break
        done.append(rng.choice(GRAPH_MUTATIONS)(model.graph, rng))
    return "; ".join(done) or "nothing"


# --------------------------------------------------------------------------- external data


def _secret(root: Path) -> Path:
    path = root / "secret.bin"
    if not path.exists():
        path.write_bytes(SECRET)
    return path


def external(folder: Path, model: onnx.ModelProto, rng: random.Random) -> str:
    """Save ``model`` as ``folder/m.onnx`` with its weights in ``w.bin``, then break the external data; the
    secret file lives in ``folder``'s parent. Returns what was done."""
    onnx.save(model, folder / "m.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location="w.bin", size_threshold=0)
    secret = _secret(folder.parent)
    saved = onnx.load(folder / "m.onnx", load_external_data=False)
    tensors = [t for t in saved.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    if not tensors:
        return "no external tensor"
    t = rng.choice(tensors)
    entries = {e.key: e for e in t.external_data}
    kind = rng.choice(["absolute", "dotdot", "symlink", "symlink-dir", "hardlink", "fifo", "device", "folder",
                       "missing", "empty-name", "offset", "length", "short-file", "keys"])
    if kind == "absolute":
        entries["location"].value = str(secret)
    elif kind == "dotdot":
        entries["location"].value = rng.choice(["../secret.bin", "sub/../../secret.bin", "./../secret.bin"])
    elif kind == "symlink":
        os.symlink(secret, folder / "link.bin")
        entries["location"].value = "link.bin"
    elif kind == "symlink-dir":
        os.symlink(folder.parent, folder / "up")
        entries["location"].value = "up/secret.bin"
    elif kind == "hardlink":
        os.link(secret, folder / "hard.bin")
        entries["location"].value = "hard.bin"
    elif kind == "fifo":
        os.mkfifo(folder / "fifo.bin")
        entries["location"].value = "fifo.bin"
    elif kind == "device":
        try:
            os.mknod(folder / "zero.bin", 0o600 | 0o020000, os.makedev(1, 5))  # /dev/zero's numbers
        except PermissionError:
            os.mkfifo(folder / "zero.bin")
        entries["location"].value = "zero.bin"
    elif kind == "folder":
        (folder / "dir.bin").mkdir()
        entries["location"].value = "dir.bin"
    elif kind == "missing":
        entries["location"].value = "gone.bin"
    elif kind == "empty-name":
        entries["location"].value = rng.choice(["", ".", "/", "w.bin\x00x"])
    elif kind in ("offset", "length"):
        entry = entries.get(kind) or t.external_data.add(key=kind)
        entry.value = rng.choice(["-8", "1.5", "0x10", "", "abc", str(2**63), str(2**64 + 4), "4", "99999999"])
    elif kind == "short-file":
        data = (folder / "w.bin").read_bytes()
        (folder / "w.bin").write_bytes(data[: rng.randrange(len(data))])
    else:
        t.external_data.add(key=rng.choice(["location", "checksum", "bogus", "offset"]), value="0")
    onnx.save(saved, folder / "m.onnx")
    return f"external {kind} on {t.name}"
