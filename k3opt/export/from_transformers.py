"""``from_transformers``: export a transformers model (instance, config, JSON, checkpoint folder) and optimize it.

Per task it knows the model class, the example inputs, the graph input and
output names and the dynamic axes. The model is exported in eval mode with
the KV cache off unless asked, and MoE experts switched to transformers' ``batched_mm``
implementation: the default ``grouped_mm`` uses ops neither exporter
translates, and the eager loop would bake the example's routing into a
traced graph. The example attention mask pads the last position of the last
row: with an all-ones mask transformers skips masking, and a TorchScript
trace would then ignore the mask input for good.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from ..errors import InputError, UsageError
from ..report import Report
from .exporters import require_torch
from .from_torch import from_torch

TEXT_INPUTS = ("input_ids", "attention_mask")
IMAGE_INPUTS = ("pixel_values",)
_WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")


@dataclasses.dataclass(frozen=True)
class Task:
    """How to build, feed and name one kind of model."""

    auto_class: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    @property
    def is_image(self) -> bool:
        return self.inputs == IMAGE_INPUTS


TASKS: dict[str, Task] = {
    "text-generation": Task("AutoModelForCausalLM", TEXT_INPUTS, ("logits",)),
    "feature-extraction": Task("AutoModel", TEXT_INPUTS, ("last_hidden_state", "pooler_output")),
    "fill-mask": Task("AutoModelForMaskedLM", TEXT_INPUTS, ("logits",)),
    "text-classification": Task("AutoModelForSequenceClassification", TEXT_INPUTS, ("logits",)),
    "image-feature-extraction": Task("AutoModel", IMAGE_INPUTS, ("last_hidden_state", "pooler_output")),
    "image-classification": Task("AutoModelForImageClassification", IMAGE_INPUTS, ("logits",)),
}
_CLASS_SUFFIXES = (("ForCausalLM", "text-generation"), ("LMHeadModel", "text-generation"),
                   ("ForMaskedLM", "fill-mask"), ("ForSequenceClassification", "text-classification"),
                   ("ForImageClassification", "image-classification"))

ModelSource = Union[str, os.PathLike, Any]


def from_transformers(
    model_or_config: ModelSource,
    path: os.PathLike | str,
    *,
    task: Optional[str] = None,
    seq_len: int = 8,
    batch: int = 1,
    use_cache: bool = False,
    exporter: str = "torchscript",
    seed: int = 0,
    **options: Any,
) -> Report:
    """Export a transformers model for ``task`` and optimize it into ``path``; returns the Report.

    ``model_or_config``: a model instance, a ``PretrainedConfig`` or a config
    JSON file (random weights, seeded by ``seed``), or a local checkpoint
    folder (its weights when it has any, else random ones). ``task`` defaults
    to the one the architecture implies (see :data:`TASKS`). ``seq_len`` and
    ``batch`` size the example inputs only: batch and sequence are dynamic
    axes (at least 2 with the dynamo exporter, which would fix a size-1 dim).
    ``use_cache=True`` (text-generation only) exports one decoding step with
    the KV cache as inputs and outputs (see :func:`_with_cache`).
    ``options`` go to :func:`k3opt.export.from_torch` (opset, optimize,
    target, passes, verify...).
    """
    if task is not None and task not in TASKS:
        raise UsageError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    require_torch("transformers")
    if options.get("progress") is not None:
        options["progress"]("loading the transformers model")
    model = load_model(model_or_config, task, seed)
    task = task or infer_task(model)
    if use_cache and task != "text-generation":
        raise UsageError(f"use_cache=True exports a decoder's KV cache: task text-generation, not {task}")
    spec = TASKS[task]
    if exporter == "dynamo":  # torch.export specializes dims of size 1: they could not stay dynamic
        batch, seq_len = max(batch, 2), max(seq_len, 2)
    inputs = example_inputs(model.config, spec, batch, seq_len, seed)
    with exportable(model):
        module, inputs, names, outputs, axes = (_with_cache(model, inputs) if use_cache
                                                else _without_cache(model, spec, inputs))
        if use_cache:  # random inputs would not respect total = past + new: verify on the example instead
            options.setdefault("input_data", dict(zip(names, (t.numpy() for t in _flat(inputs)))))
        return from_torch(module, inputs, path, input_names=names, output_names=outputs, dynamic_axes=axes,
                          exporter=exporter, **options)


ExportPlan = tuple[Any, tuple, tuple[str, ...], tuple[str, ...], dict[str, dict[int, str]]]


def _without_cache(model: Any, spec: Task, inputs: tuple) -> ExportPlan:
    """(module, example inputs, input names, output names, dynamic axes) for the task's plain forward."""
    from .task_module import TaskModule

    module = TaskModule(model, spec.inputs, spec.outputs)
    module.outputs = module.present_outputs(inputs)
    axes = {0: "batch"} if spec.is_image else {0: "batch", 1: "sequence"}
    return module, inputs, spec.inputs, module.outputs, {n: axes for n in spec.inputs}


def _with_cache(model: Any, inputs: tuple) -> ExportPlan:
    """The same for a decoder step with a KV cache: past of ``seq_len`` tokens in, present out.

    Names follow the usual convention: ``past_key_values.{layer}.key|value``
    in, ``present.{layer}.key|value`` out; the mask covers past + new tokens.
    """
    import torch

    from .task_module import CachedCausalLM, prefix_cache

    ids, mask = inputs
    past = prefix_cache(model, ids)
    kv = [f"{layer}.{part}" for layer in range(len(past) // 2) for part in ("key", "value")]
    names = ("input_ids", "attention_mask", *(f"past_key_values.{k}" for k in kv))
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "total_sequence"}}
    axes.update({n: {0: "batch", 2: "past_sequence"} for n in names[2:]})
    example = (ids, torch.cat([torch.ones_like(mask), mask], dim=1), tuple(past))
    return CachedCausalLM(model), example, names, ("logits", *(f"present.{k}" for k in kv)), axes


def _flat(values: Any) -> list[Any]:
    return [t for v in values for t in (_flat(v) if isinstance(v, (tuple, list)) else [v])]


def load_model(source: ModelSource, task: Optional[str], seed: int) -> Any:
    """A transformers model from an instance, a config, a config JSON or a local checkpoint folder (``task`` known)."""
    import torch
    import transformers as tf

    if isinstance(source, tf.PreTrainedModel):
        return source
    config, weights = source, None
    if isinstance(source, (str, os.PathLike)):
        config, weights = _read_source(Path(source))
    if not isinstance(config, tf.PretrainedConfig):
        raise InputError(f"cannot export a {type(source).__name__}: give a model, a config, a config JSON or a folder")
    auto = getattr(tf, TASKS[task or infer_task(config)].auto_class)
    if weights is not None:
        with _no_progress_bars(tf):
            return auto.from_pretrained(weights, config=config, local_files_only=True)
    torch.manual_seed(seed)
    return auto.from_config(config)


@contextlib.contextmanager
def _no_progress_bars(tf: Any) -> Iterator[None]:
    """transformers' "Loading weights" bars would break ``k3opt export -q`` (and library callers' logs)."""
    enabled = tf.utils.logging.is_progress_bar_enabled()
    tf.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            tf.utils.logging.enable_progress_bar()


def _read_source(path: Path) -> tuple[Any, Optional[Path]]:
    """(config, checkpoint folder or None) for a config JSON file or a local checkpoint folder."""
    import transformers as tf

    if path.is_dir():
        if not (path / "config.json").is_file():
            raise InputError(f"{path}: no config.json in this folder")
        config = tf.AutoConfig.from_pretrained(path, local_files_only=True)
        has_weights = any(next(path.glob(g), None) for g in _WEIGHT_GLOBS)
        return config, path if has_weights else None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: not a readable config JSON ({exc})") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise InputError(f"{path}: a transformers config JSON needs a 'model_type'")
    try:
        return tf.AutoConfig.for_model(data.pop("model_type"), **data), None
    except ValueError as exc:
        raise InputError(f"{path}: {exc}") from None


def infer_task(model_or_config: Any) -> str:
    """The task a model class or config's architecture implies (decoder LM, encoder, image encoder...)."""
    from transformers.models.auto import modeling_auto as auto

    config = getattr(model_or_config, "config", model_or_config)
    names = [type(model_or_config).__name__] if hasattr(model_or_config, "config") else []
    names += list(getattr(config, "architectures", None) or [])
    for name in names:
        for suffix, task in _CLASS_SUFFIXES:
            if name.endswith(suffix):
                return task
    kind = getattr(config, "model_type", "")
    if kind in auto.MODEL_FOR_IMAGE_MAPPING_NAMES:
        return "image-feature-extraction"
    if kind in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and kind not in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "text-generation"
    return "feature-extraction"


def example_inputs(config: Any, spec: Task, batch: int, seq_len: int, seed: int) -> tuple[Any, ...]:
    """Seeded example tensors for ``spec``; the mask pads the last token of the last row (see module doc)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    if spec.is_image:
        size, channels = config.image_size, getattr(config, "num_channels", 3)
        return (torch.randn(batch, channels, size, size, generator=gen),)
    ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=gen)
    mask = torch.ones(batch, seq_len, dtype=torch.int64)
    if seq_len > 1:
        mask[-1, -1] = 0
    return ids, mask


@contextlib.contextmanager
def exportable(model: Any) -> Iterator[None]:
    """Eval mode, no KV cache, exportable MoE experts; the model's settings are restored afterwards."""
    config, training = model.config, model.training
    saved = {k: getattr(config, k) for k in ("use_cache", "_experts_implementation") if hasattr(config, k)}
    model.eval()
    if "use_cache" in saved:
        config.use_cache = False
    if "_experts_implementation" in saved:
        config._experts_implementation = "batched_mm"
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(config, key, value)
        model.train(training)
