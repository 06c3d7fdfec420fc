"""``k3opt compile`` and ``k3opt check`` of a serving pair folder: every graph with the manifest's ATC shapes.

The decode graphs are static (``--input_shape`` gives every dim); the
prefill graph's batch and prompt length are gear dims (``-1`` in
``--input_shape``, the manifest's profiles in ``--dynamic_dims``, within
ATC's 100). A pair is compiled as written: it must have been built with
``k3opt llm --target cann`` (its graphs already lowered and verified).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import onnx

from ..errors import CompileError, UsageError
from ..targets import get_target
from .manifest import Manifest


def atc_options(manifest: Manifest, soc_version: str, **extra: object) -> list[tuple[str, "object"]]:
    """(graph file, AtcOptions) for every graph of ``manifest``."""
    from ..cann_bridge.atc_command import AtcOptions

    out = []
    for file, inputs, profiles in manifest.graphs():
        shapes = tuple(f"{name}:{','.join(str(d) for d in dims)}" for name, dims in inputs.items())
        dims = ";".join(",".join(str(d) for d in p) for p in profiles) if profiles else None
        out.append((file, AtcOptions(soc_version=soc_version, input_shapes=shapes, dynamic_dims=dims, **extra)))
    return out


def check_pair(folder: Path) -> list[str]:
    """``k3opt check --target cann`` of every graph of the pair: findings as ``file: finding`` lines."""
    from ..cann_bridge.atc_command import parse_input_shape
    from ..targets.cann.compat import check_model

    manifest = Manifest.read(folder)
    lines = []
    for file, inputs, profiles in manifest.graphs():
        shapes = [parse_input_shape(f"{n}:{','.join(str(d) for d in dims)}") for n, dims in inputs.items()]
        model = onnx.load(str(Path(folder) / file), load_external_data=False)
        lines += [f"{file}: {f}" for f in check_model(model, shapes, "dynamic_dims" if profiles else None)]
    return lines


def compile_pair(folder: Path, output: Path, soc_version: str, *, atc: Optional[str] = None, dry_run: bool = False,
                 echo: Optional[Callable[[str], None]] = None, **atc_extra: object) -> list[Path]:
    """ATC on every graph of the pair in ``folder``: ``output/<graph>.om``; returns the .om paths (none on a dry run)."""
    from ..cann_bridge.atc_command import build_command, render, validate
    from ..cann_bridge.atc_run import raise_for_result, run_atc
    from ..cann_bridge.compile import AtcUnavailable, _locate

    say = echo or (lambda line: None)
    manifest = Manifest.read(folder)
    if get_target(manifest.target).compiler != "atc":
        raise UsageError(f"{folder}: a pair for target {manifest.target}; build it with k3opt llm --target cann "
                         "to compile it for Ascend")
    plans = atc_options(manifest, soc_version, **atc_extra)
    for _, opts in plans:
        validate(opts)
    findings = check_pair(folder)
    if findings and not dry_run:
        raise CompileError("ATC would refuse the pair (nothing was run):\n" + "\n".join(f"  {f}" for f in findings))
    tool = _locate(atc, dry_run)
    output = Path(output).absolute()
    output.mkdir(parents=True, exist_ok=True)
    written = []
    for file, opts in plans:
        prefix = output / Path(file).stem
        cmd = build_command(tool, str((Path(folder) / file).absolute()), str(prefix), opts)
        say(render(cmd))
        if dry_run:
            continue
        try:
            result = run_atc(cmd, cwd=output, echo=say)
        except CompileError as exc:  # the executable could not be started
            raise AtcUnavailable(str(exc)) from None
        raise_for_result(result)
        om = prefix.with_name(prefix.name + ".om")
        if not om.is_file():
            raise CompileError(f"ATC reported success but {om} was not written")
        written.append(om)
    return written
