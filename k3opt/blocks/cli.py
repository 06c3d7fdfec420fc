"""``k3opt split MODEL --stages N -o OUT_DIR``: pipeline stages cut on the residual stream (docs/split.md); MODEL
may be a ``k3opt llm`` serving-pair folder (k3opt.llm.split_pair)."""
from __future__ import annotations

from typing import Any, Optional

import click

from ..cli_options import progress_for, run_options, target_option
from ..errors import UsageError
from ..targets import get_target
from .run_hook import parse_size
from .split import DEFAULT_BALANCE, parse_layers, split_model


def _size(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> Optional[int]:
    return None if value is None else parse_size(value, option=f"--{param.name.replace('_', '-')}")


@click.command("split")
@click.argument("model", type=click.Path())
@click.option("--stages", type=click.IntRange(1), help="Number of stages (one per card), balanced by bytes.")
@click.option("--layers", metavar="A-B,C-D", help="The stages' decoder-layer ranges by hand, e.g. 0-7,8-15.")
@click.option("-o", "--output", required=True, type=click.Path(), help="Output folder (stages + manifest.json).")
@target_option("cann: optimize and lower for Ascend first, then cut the lowered model.")
@click.option("--balance", type=click.FloatRange(1.0), default=DEFAULT_BALANCE, show_default=True, metavar="RATIO",
              help="Largest / smallest stage to aim for: cuts that hand on an activation besides the residual "
                   "stream are used only when the stream cuts cannot reach it.")
@click.option("--input-shape", "input_shapes", multiple=True, metavar="NAME:D1,D2",
              help="Fix an input's dimensions, e.g. input_ids:1,128 (repeatable): with all fixed, the manifest "
                   "gives every handed tensor's shape.")
@click.option("--max-stage-bytes", callback=_size, metavar="SIZE", help="Refuse a stage over this (per-card memory).")
@click.option("--verify/--no-verify", default=True, show_default=True,
              help="Chain the stages in onnxruntime against the whole model.")
@click.option("--verify-memory", callback=_size, metavar="SIZE",
              help="Over a third of it the whole model is run block by block (default 1GB).")
@click.option("--input-data", type=click.Path(dir_okay=False), metavar="F.npz", help="Inputs for verification.")
@click.option("--rtol", type=click.FloatRange(0), help="Relative tolerance.")
@click.option("--atol", type=click.FloatRange(0), help="Absolute tolerance.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
@run_options
def split_cmd(model: str, stages: Optional[int], layers: Optional[str], output: str, target: str,
              max_stage_bytes: Optional[int], input_shapes: tuple[str, ...], quiet: bool, debug: bool,
              **kw: Any) -> None:
    """Cut MODEL into pipeline stages (at layer boundaries, or inside layers for balance), one ONNX model per card.

    MODEL may be a `k3opt llm` pair folder: its prefill and decode graphs are cut at the same places, one folder
    per stage with its graphs and their weights file (docs/split.md)."""
    progress = progress_for({"quiet": quiet})
    ranges = parse_layers(layers) if layers else None
    from ..llm.split_pair import is_pair, split_pair

    if is_pair(model):
        asked = (("target", not get_target(target).default), ("input_shape", input_shapes),
                 ("input_data", kw["input_data"]), ("rtol", kw["rtol"]), ("atol", kw["atol"]),
                 ("verify_memory", kw["verify_memory"]))
        given = [f"--{k.replace('_', '-')}" for k, v in asked if v]
        if given:
            raise UsageError(f"{', '.join(given)}: not for a serving pair (its graphs keep the target and shapes "
                             "they were built with; the check is the pair's generated tokens)")
        manifest = split_pair(model, output, stages, layers=ranges, balance=kw["balance"],
                              max_stage_bytes=max_stage_bytes, verify=kw["verify"], overwrite=kw["overwrite"],
                              progress=progress)
    else:
        manifest = split_model(model, output, stages, layers=ranges, max_stage_bytes=max_stage_bytes, target=target,
                               input_shapes=list(input_shapes), progress=progress, **kw)
    if quiet:
        return
    for s in manifest["stages"]:
        where = f"{s['nodes']} nodes, {len(s['inputs'])} inputs, {len(s['outputs'])} outputs -> {s['file']}" \
            if "file" in s else f"{len(s['graphs'])} graphs -> {s['folder']}/"
        click.echo(f"stage {s['index']}: layers {s['layers'][0]}-{s['layers'][1]}, {s['bytes'] / 2**20:.1f} MB, "
                   f"{where}")
    v = manifest["verification"]
    for c in manifest["cuts"]:
        if c["kind"] != "layer":
            where = "after" if c["kind"] == "sublayer" else "inside"
            hands = f": hands on {', '.join(c['hands'])}" if "hands" in c else ""
            click.echo(f"cut {where} layer {c['layer']}'s {c['part']}{hands}")
    click.echo(f"balance (largest / smallest stage): {manifest['balance']:.3f}")
    click.echo(f"verification: {v['status']}" + (f" ({v['reason']})" if v.get("reason") else ""))
    click.echo(f"wrote {output}/manifest.json")
