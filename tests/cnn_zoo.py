"""The non-transformer test corpus: tiny torch CNN, OCR, detector, recurrent and audio models exported to ONNX.

``cnn_model(name, exporter)`` returns the path of a cached ``.onnx``; ``cnn_inputs(name)`` seeded numpy
inputs for it (batch 2). Names:

* ``mobilenet``: a MobileNetV3/ResNet-like CNN (Conv+BN+Hardswish, a depthwise block with
  squeeze-excite, a residual Add, a ZeroPad2d before a Conv, Linear+BatchNorm1d head);
* ``crnn``: a CRNN-like text recognizer (Conv+BN+ReLU+MaxPool, height squeezed, BiLSTM, Linear);
* ``yolo``: a YOLO-like detector head (Conv+BN+SiLU, nearest Upsample, Concat, a 1x1 head,
  Sigmoid and the box/objectness Slices of the decode);
* ``gru``: a two-layer GRU over audio features with a Linear+BatchNorm1d head;
* ``audio``: a Conv1d audio classifier (Conv1d+BN+ReLU, ConstantPad1d, dilation, pooling, Linear);
* ``gru-if`` / ``audio-if``: the same exports wrapped in an ``If``: ``gru-if``'s condition is a
  constant (the branch can be inlined), ``audio-if``'s depends on the input (its branches stay bodies).

Exporters: ``torchscript`` (opset 14) and ``dynamo`` (opset 18). TorchScript folds an eval-mode
BatchNorm into the Conv before it; dynamo keeps every BatchNormalization. Every BatchNorm gets seeded
running statistics (mean, var, affine parameters), so a lost term changes the outputs.

The cache is ``tests/zoo.py``'s (same folder, lock and versions), keyed by a hash of this file too.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from .zoo import EXPORTERS, _require, build_cached, cache_dir, cache_key

BASE_NAMES = ("mobilenet", "crnn", "yolo", "gru", "audio")
IF_NAMES = ("gru-if", "audio-if")
NAMES = BASE_NAMES + IF_NAMES
BATCH, SEED = 2, 0
#: name -> (input name, shape without the batch axis)
INPUTS = {"mobilenet": ("image", (3, 32, 32)), "crnn": ("image", (1, 16, 48)), "yolo": ("image", (3, 32, 32)),
          "gru": ("features", (20, 16)), "audio": ("wave", (1, 400))}


def cnn_params() -> list:
    """``pytest.param(name, exporter)`` for every corpus pair (ids ``mobilenet-torchscript``...); dynamo slow."""
    import pytest

    return [pytest.param(n, e, marks=[pytest.mark.slow] if e == "dynamo" else [], id=f"{n}-{e}")
            for n in NAMES for e in EXPORTERS]


def base_name(name: str) -> str:
    """The export an ``-if`` model wraps (``gru-if`` -> ``gru``)."""
    return name[:-3] if name.endswith("-if") else name


def cnn_inputs(name: str, batch: int = BATCH, seed: int = SEED) -> dict[str, np.ndarray]:
    """Seeded float32 inputs for corpus model ``name``."""
    input_name, shape = INPUTS[base_name(name)]
    rng = np.random.default_rng(seed)
    return {input_name: rng.standard_normal((batch, *shape)).astype(np.float32)}


def cnn_torch_model(name: str) -> Any:
    """The eval-mode torch module of corpus model ``name`` (seeded weights and BatchNorm statistics)."""
    _require()
    import torch
    from torch import nn

    def bn_conv(cin: int, cout: int, k: int = 3, stride: int = 1, groups: int = 1, act: Any = nn.ReLU) -> nn.Module:
        return nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False),
                             nn.BatchNorm2d(cout), act())

    class SqueezeExcite(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.fc1, self.fc2 = nn.Conv2d(c, c // 4, 1), nn.Conv2d(c // 4, c, 1)

        def forward(self, x):
            return x * nn.functional.hardsigmoid(self.fc2(torch.relu(self.fc1(self.pool(x)))))

    class MobileNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = bn_conv(3, 16, stride=2, act=nn.Hardswish)
            self.dw = bn_conv(16, 16, groups=16, act=nn.Hardswish)
            self.se = SqueezeExcite(16)
            self.project = nn.Sequential(nn.Conv2d(16, 16, 1, bias=False), nn.BatchNorm2d(16))
            self.pad = nn.ZeroPad2d((1, 1, 1, 1))
            self.down = nn.Sequential(nn.Conv2d(16, 24, 3, 2, bias=True), nn.BatchNorm2d(24), nn.Hardswish())
            self.head = nn.Sequential(nn.Linear(24, 32), nn.BatchNorm1d(32), nn.Hardswish(), nn.Linear(32, 10))

        def forward(self, x):
            x = self.stem(x)
            x = x + self.project(self.se(self.dw(x)))
            x = self.down(self.pad(x))
            return self.head(x.mean((2, 3)))

    class CRNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cnn = nn.Sequential(bn_conv(1, 16), nn.MaxPool2d(2), bn_conv(16, 32), nn.MaxPool2d((2, 1)),
                                     bn_conv(32, 32), nn.MaxPool2d((4, 1)))
            self.rnn = nn.LSTM(32, 24, bidirectional=True, batch_first=True)
            self.fc = nn.Linear(48, 12)

        def forward(self, x):
            f = self.cnn(x).squeeze(2).permute(0, 2, 1)  # (B, W, C)
            return self.fc(self.rnn(f)[0]).log_softmax(-1)

    class Yolo(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c1, self.c2 = bn_conv(3, 16, stride=2, act=nn.SiLU), bn_conv(16, 32, stride=2, act=nn.SiLU)
            self.up = nn.Upsample(scale_factor=2, mode="nearest")
            self.fuse = bn_conv(48, 32, k=1, act=nn.SiLU)
            self.head = nn.Conv2d(32, 3 * 7, 1)

        def forward(self, x):
            a = self.c1(x)
            b = self.c2(a)
            y = self.head(self.fuse(torch.cat([self.up(b), a], 1)))
            n, _, h, w = y.shape
            y = y.view(n, 3, 7, h, w).permute(0, 1, 3, 4, 2).sigmoid()
            xy, wh, rest = y[..., 0:2] * 2 - 0.5, (y[..., 2:4] * 2) ** 2, y[..., 4:]
            return torch.cat([xy, wh, rest], -1).reshape(n, -1, 7)

    class GRUNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.GRU(16, 24, num_layers=2, batch_first=True)
            self.head = nn.Sequential(nn.Linear(24, 24), nn.BatchNorm1d(24), nn.ReLU(), nn.Linear(24, 5))

        def forward(self, x):
            return self.head(self.rnn(x)[0][:, -1])

    class Audio(nn.Module):
        def __init__(self) -> None:
            super().__init__()

            def block(cin: int, cout: int, k: int, stride: int = 1, dilation: int = 1) -> nn.Module:
                return nn.Sequential(nn.Conv1d(cin, cout, k, stride, dilation=dilation, bias=False),
                                     nn.BatchNorm1d(cout), nn.ReLU())

            self.front = block(1, 16, 10, stride=5)
            self.pad = nn.ConstantPad1d((2, 2), 0.0)
            self.mid = block(16, 24, 5, dilation=1)
            self.deep = nn.Sequential(nn.ConstantPad1d((2, 2), 0.0), block(24, 24, 3, dilation=2))
            self.fc = nn.Linear(24, 6)

        def forward(self, x):
            x = self.deep(self.mid(self.pad(self.front(x))))
            return self.fc(x.amax(-1))

    builders = {"mobilenet": MobileNet, "crnn": CRNN, "yolo": Yolo, "gru": GRUNet, "audio": Audio}
    torch.manual_seed(SEED)
    model = builders[base_name(name)]()
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                c = module.num_features
                module.running_mean.copy_(0.5 * torch.randn(c, generator=gen))
                module.running_var.copy_(0.5 + torch.rand(c, generator=gen))
                module.weight.copy_(1 + 0.3 * torch.randn(c, generator=gen))
                module.bias.copy_(0.3 * torch.randn(c, generator=gen))
    return model.eval()


def _hash() -> str:
    """The zoo's key plus this file's bytes: a changed model here rebuilds."""
    h = hashlib.sha256(cache_key().encode())
    h.update(Path(__file__).read_bytes())
    return h.hexdigest()[:16]


def cnn_model(name: str, exporter: str = "torchscript") -> Path:
    """Path of the cached ONNX export of corpus model ``name`` with ``exporter`` (exported on first use)."""
    _require()
    if name not in NAMES or exporter not in EXPORTERS:
        raise KeyError(f"no corpus model {name!r}/{exporter!r}; names {NAMES}, exporters {EXPORTERS}")
    return build_cached(cache_dir() / f"cnn-{name}-{exporter}-{_hash()}.onnx", lambda tmp: _build(name, exporter, tmp))


def _build(name: str, exporter: str, path: str) -> None:
    """Export to ``path``, or wrap the cached base export in an If."""
    import onnx

    if name in IF_NAMES:
        model = onnx.load(str(cnn_model(base_name(name), exporter)))
        onnx.save(wrap_in_if(model, constant=name == "gru-if"), path)
    else:
        _export(name, exporter, path)


def _export(name: str, exporter: str, path: str) -> None:
    import torch

    from k3opt.export import from_torch

    input_name, shape = INPUTS[name]
    example = torch.from_numpy(cnn_inputs(name)[input_name])
    from_torch(cnn_torch_model(name), (example,), path, input_names=[input_name], output_names=["output"],
               dynamic_axes={input_name: {0: "batch"}, "output": {0: "batch"}}, exporter=exporter, optimize=False)


def wrap_in_if(model: Any, constant: bool) -> Any:
    """``model`` as the then-branch of an If; the else-branch is the same graph with its output halved.

    ``constant``: the condition is a ``Constant`` true; otherwise ``ReduceSum(input) > 0`` (run-time).
    Both branches read the outer graph's input and initializers (outer-scope references).
    """
    import onnx
    from onnx import TensorProto, helper

    g = model.graph
    (x,), (y,) = [i for i in g.input if i.name not in {t.name for t in g.initializer}], g.output

    def branch(prefix: str, scale: float) -> onnx.GraphProto:
        nodes = []
        rename = {}
        for node in g.node:
            new = onnx.NodeProto()
            new.CopyFrom(node)
            new.name = prefix + node.name
            for i, o in enumerate(new.output):
                rename[o] = new.output[i] = prefix + o
            for i, v in enumerate(new.input):
                new.input[i] = rename.get(v, v)
            nodes.append(new)
        out = rename[y.name]
        if scale != 1.0:
            half = helper.make_node("Constant", [], [prefix + "half"], value=helper.make_tensor(
                prefix + "half_value", TensorProto.FLOAT, [], [scale]))
            nodes += [half, helper.make_node("Mul", [out, prefix + "half"], [prefix + "scaled"])]
            out = prefix + "scaled"
        result = helper.make_tensor_value_info(prefix + "result", y.type.tensor_type.elem_type, None)
        nodes.append(helper.make_node("Identity", [out], [prefix + "result"]))
        return helper.make_graph(nodes, prefix + "branch", [], [result])

    if constant:
        cond = [helper.make_node("Constant", [], ["cond"], value=helper.make_tensor("cond_value", TensorProto.BOOL,
                                                                                   [], [True]))]
    else:
        cond = [helper.make_node("ReduceSum", [x.name], ["total"], keepdims=0),
                helper.make_node("Constant", [], ["zero"], value=helper.make_tensor("zero_value", TensorProto.FLOAT,
                                                                                   [], [0.0])),
                helper.make_node("Greater", ["total", "zero"], ["cond"])]
    wrapped = helper.make_node("If", ["cond"], [y.name], then_branch=branch("then_", 1.0),
                               else_branch=branch("else_", 0.5))
    graph = helper.make_graph(cond + [wrapped], g.name, [x], [y], list(g.initializer))
    out = helper.make_model(graph, opset_imports=list(model.opset_import))
    out.ir_version = model.ir_version
    onnx.checker.check_model(out)
    return out
