"""``k3opt quantize IN OUT --weights int4|int8 --group-size N [--symmetric] [--target onnx|cann]``."""
from __future__ import annotations

import json
from typing import Optional

import click

from ..cli_options import check_outputs, run_options, target_option


@click.command("quantize")
@click.argument("model", type=click.Path())
@click.argument("output", type=click.Path())
@click.option("--weights", type=click.Choice(["int4", "int8"]), default="int4", show_default=True,
              help="int4 per-group or int8 per-channel weights (W4A16 / W8A16).")
@click.option("--group-size", type=click.IntRange(0), default=None,
              help="Rows of k per scale: 32, 64, 128 (int4 default 128); 0 or unset for int8: per-channel.")
@click.option("--symmetric", is_flag=True, help="No zero point (default: asymmetric, with a zero point).")
@target_option("onnx: DequantizeLinear -> MatMul; cann: then NPUWeightQuantBatchMatmulV2 via optimize --target cann.")
@click.option("--opset", type=click.IntRange(13), default=None,
              help="Output opset (--target onnx; int4 and groups need 21, int8 per-channel 13).")
@click.option("--no-clip-search", is_flag=True, help="Plain round-to-nearest over each group's full range.")
@click.option("--calibration-data", type=click.Path(dir_okay=False), metavar="F.npz", default=None,
              help="Inputs named like the graph's, samples along the first axis: GPTQ from the MatMuls' inputs.")
@click.option("--quantize-lm-head", is_flag=True, help="Quantize the lm_head too (kept float by default).")
@click.option("--quantize-embedding", is_flag=True, help="Quantize the embedding tables too (kept float by default).")
@click.option("--tokens", type=click.IntRange(0), default=16, show_default=True,
              help="Greedy tokens generated for the token-agreement check (0: none).")
@click.option("--no-measure", is_flag=True, help="Skip running both models for the logits error and token agreement.")
@click.option("--external-data/--no-external-data", default=None, help="Weights in OUT.data (default: as needed).")
@click.option("--overwrite", is_flag=True, help="Allow OUT to be the input model.")
@click.option("--report", "report_path", type=click.Path(), help="Write the run's figures as JSON here.")
@run_options
def quantize_cmd(model: str, output: str, weights: str, group_size: Optional[int], symmetric: bool, target: str,
                 opset: Optional[int], no_clip_search: bool, calibration_data: Optional[str], quantize_lm_head: bool, quantize_embedding: bool,
                 tokens: int, no_measure: bool, external_data: Optional[bool], overwrite: bool,
                 report_path: Optional[str], quiet: bool, debug: bool) -> None:
    """Quantize MODEL's MatMul/Gemm weights (weight-only) and write OUTPUT; prints errors, size and accuracy."""
    from . import quantize_file
    from ..modelio.output_paths import write_text

    check_outputs([output], [report_path], [model], overwrite=overwrite)
    report = quantize_file(model, output, weights=weights, group_size=group_size, symmetric=symmetric,
                           target=target, opset=opset, lm_head=quantize_lm_head, embedding=quantize_embedding,
                           clip=not no_clip_search, measure=not no_measure, tokens=tokens, overwrite=overwrite,
                           external_data=external_data, calibration=calibration_data)
    if report_path:
        write_text(report_path, json.dumps(report.__dict__, indent=2, default=str))
    if not quiet:
        click.echo("\n".join(report.lines()))
