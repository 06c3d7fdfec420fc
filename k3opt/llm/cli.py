"""CLI commands of k3opt.llm, listed in k3opt.cli.COMMANDS (imported when run).

``k3opt llm MODEL --max-seq L [--max-batch B] [--target onnx|cann] -o OUT_DIR``: write a serving pair.
``k3opt generate PAIR_DIR --prompt 1,2,3 [--prompt ...] --steps N``: greedy (or top-k) tokens through it.
"""
from __future__ import annotations

from typing import Any, Optional

import click
import numpy as np

from ..cli_options import progress_for, run_options, target_option
from ..errors import UsageError


@click.command("llm")
@click.argument("model", type=click.Path())
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False), metavar="OUT_DIR",
              help="Folder to write: prefill.onnx, decode_b<B>.onnx, weights.bin, manifest.json.")
@click.option("--max-seq", type=click.IntRange(2), required=True, help="Cache length L: prompt + new tokens.")
@click.option("--max-batch", type=click.IntRange(1), default=1, show_default=True,
              help="Largest batch; one static decode graph per power of two below it, and it.")
@target_option("cann: lower attention, RMSNorm and RoPE to Ascend ops (flash attention with the valid length).")
@click.option("--exporter", type=click.Choice(["torchscript", "dynamo"]), default="torchscript", show_default=True,
              help="For a checkpoint folder or config JSON: how to export its decode step first.")
@click.option("--no-verify", is_flag=True, help="Skip the check that the pair generates the original's tokens.")
@click.option("--overwrite", is_flag=True, help="Replace a non-empty OUT_DIR.")
@run_options
def llm_cmd(model: str, output: str, max_seq: int, max_batch: int, target: str, exporter: str, no_verify: bool,
            overwrite: bool, quiet: bool, debug: bool) -> None:
    """Write the serving pair of MODEL: a prefill graph and static decode graphs over a fixed KV cache.

    MODEL is a decode-step ONNX export (past_key_values.* in, present.* out, as
    `k3opt export --use-cache` writes) or a transformers checkpoint folder /
    config JSON. The pair must generate the original step's greedy tokens
    (checked before anything is written, unless --no-verify).
    """
    from .pair import build_pair

    manifest = build_pair(model, output, max_seq=max_seq, max_batch=max_batch, target=target, exporter=exporter,
                          overwrite=overwrite, verify=not no_verify, progress=progress_for({"quiet": quiet}))
    if not quiet:
        files = [manifest.prefill, *manifest.decode.values(), manifest.weights, "manifest.json"]
        click.echo(f"wrote {output}: {', '.join(files)}")
        click.echo(f"cache: {len(manifest.entries)} tensors [B, Hkv, {max_seq}, D]; "
                   f"decode batch sizes {sorted(manifest.decode)}; target {target}; "
                   + ("tokens verified against the original decode step" if not no_verify else "not verified"))
        checked = manifest.verification or {}
        lines = {**checked.get("graphs", {}), **({"tokens": checked["tokens"]} if "tokens" in checked else {})}
        for what, line in lines.items():
            click.echo(f"verification: {what}: {line}")


def _prompt(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> list[list[int]]:
    prompts = []
    for text in values:
        try:
            prompts.append([int(t) for t in text.replace(" ", ",").split(",") if t])
        except ValueError:
            raise click.BadParameter(f"{text!r}: token ids separated by commas, e.g. 1,15,42") from None
        if not prompts[-1]:
            raise click.BadParameter("an empty prompt")
    return prompts


@click.command("generate")
@click.argument("pair", type=click.Path(exists=True, file_okay=False))
@click.option("--prompt", "prompts", multiple=True, required=True, callback=_prompt, metavar="IDS",
              help="Prompt token ids, comma-separated; repeat for a batch (left-padded).")
@click.option("--steps", type=click.IntRange(1), default=32, show_default=True, help="New tokens per prompt.")
@click.option("--top-k", type=click.IntRange(1), default=1, show_default=True, help="1 = greedy; else sample.")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed (with --top-k > 1).")
@click.option("--threads", type=click.IntRange(1), default=1, show_default=True, help="onnxruntime threads.")
@click.option("--pad-id", type=click.IntRange(0), default=0, show_default=True, help="Token id of left padding.")
@run_options
def generate_cmd(pair: str, prompts: list[list[int]], steps: int, top_k: int, seed: int, threads: int, pad_id: int,
                 quiet: bool, debug: bool) -> None:
    """Generate tokens through the serving pair in PAIR (a `k3opt llm` folder, or one `k3opt split` cut into
    pipeline stages: the stages chained) and print them with step times.

    An onnx pair runs in onnxruntime; a cann pair runs its NPU ops through
    k3opt's reference ops (onnx's ReferenceEvaluator: slow, for checking).
    """
    from .generate import PairRunner, check_prompt, left_pad

    runner = _runner(pair, threads)
    ids, mask = left_pad(prompts, pad_id)
    check_prompt(ids, runner.manifest.vocab)
    tokens = runner.generate(ids, mask, steps, top_k=top_k, seed=seed)
    for row in tokens:
        click.echo(",".join(str(int(t)) for t in row))
    if not quiet:
        times = np.array(runner.step_times) * 1e3
        decode = f"; decode {times[1:].mean():.2f} ms/step (min {times[1:].min():.2f})" if len(times) > 1 else ""
        click.echo(f"prefill {times[0]:.2f} ms{decode}; {len(prompts)} x {steps} tokens", err=True)


def _runner(pair: str, threads: int) -> Any:
    from .generate import PairRunner
    from .manifest import Manifest
    from .split_pair import is_split_pair, staged_runner

    from ..api import reference_evaluator

    if is_split_pair(pair):  # a pair split into pipeline stages: the stages chained
        return staged_runner(pair, threads=threads, evaluator=reference_evaluator(is_split_pair(pair)))
    evaluator: Optional[Any] = reference_evaluator(Manifest.read(pair).target)  # None: onnxruntime runs it
    return PairRunner(pair, threads=threads, evaluator=evaluator)
