"""``k3opt compile`` and ``k3opt check`` of a serving pair folder: every graph with the manifest's ATC shapes.

The decode graphs are static (``--input_shape`` gives every dim); the
prefill graph's batch and prompt length are gear dims (``-1`` in
``--input_shape``, the manifest's profiles in ``--dynamic_dims``, within
ATC's 100). A pair is compiled as written: it must have been built with
``k3opt llm --target cann`` (its graphs already lowered and verified).

A pair split into stages (``k3opt split PAIR_DIR``) compiles the same way,
every graph of every stage into ``OUTPUT/stage<i>/<graph>.om``: the split
named the dims of the tensors the prefill stages hand on after the gear dims
they equal (``gear_dims`` in its manifest), so each stage's prefill takes
the unsplit prefill's gear profiles, its ``-1`` dims in input order.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import onnx

from ..blocks.split import read_manifest
from ..errors import CompileError, UsageError
from ..targets import get_target
from .manifest import Manifest


Graphs = list[tuple[str, dict[str, list[int]], Optional[list[list[int]]]]]


def pair_target(folder: Path) -> str:
    """The target the pair (or split pair) in ``folder`` was built for."""
    from .split_pair import is_split_pair

    return is_split_pair(folder) or Manifest.read(folder).target


def pair_graphs(folder: Path) -> Graphs:
    """(file, ATC input shapes, --dynamic_dims profiles or None) of every graph of the pair or split pair in
    ``folder``."""
    from .split_pair import is_split_pair

    if is_split_pair(folder) is None:
        return Manifest.read(folder).graphs()
    return _stage_graphs(folder, read_manifest(folder))


def _stage_graphs(folder: Path, data: dict) -> Graphs:
    """Every stage's graphs: a prefill's dims named after a gear are ``-1``, with the unsplit prefill's gear
    profiles; any other dim must be static (refused in one line otherwise)."""
    prefill = data["pair"]["prefill"]
    gears, named = prefill["gears"], data.get("gear_dims")
    if named is None:
        raise UsageError(f"{folder}: split before k3opt named the prefill stages' gear dims; split the pair again")
    profiles = [{"batch": b, "sequence": t} for b in gears["batch"] for t in gears["sequence"]]
    out: Graphs = []
    for stage in data["stages"]:
        for graph, entry in stage["graphs"].items():
            inputs, order = {}, []
            for t in entry["inputs"]:
                dims = []
                for d in t["shape"] if t["shape"] is not None else [None]:
                    if isinstance(d, int):
                        dims.append(d)
                    elif graph == prefill["file"] and d in named:
                        dims.append(-1)
                        order.append(named[d])
                    else:
                        raise UsageError(f"{folder}: {entry['file']} takes {t['name']} with a dim ({d}) that is "
                                         "neither static nor a prefill gear dim; ATC cannot compile it")
                inputs[t["name"]] = dims
            out.append((entry["file"], inputs, [[p[g] for g in order] for p in profiles] if order else None))
    return out


def atc_options(graphs: Graphs, soc_version: str, **extra: object) -> list[tuple[str, "object"]]:
    """(graph file, AtcOptions) for every graph of ``graphs`` (:func:`pair_graphs`)."""
    from ..cann_bridge.atc_command import AtcOptions

    out = []
    for file, inputs, profiles in graphs:
        shapes = tuple(f"{name}:{','.join(str(d) for d in dims)}" for name, dims in inputs.items())
        dims = ";".join(",".join(str(d) for d in p) for p in profiles) if profiles else None
        out.append((file, AtcOptions(soc_version=soc_version, input_shapes=shapes, dynamic_dims=dims, **extra)))
    return out


def check_pair(folder: Path) -> list[str]:
    """``k3opt check --target cann`` of every graph of the pair (or split pair): ``file: finding`` lines."""
    from ..cann_bridge.atc_command import parse_input_shape
    from ..targets.cann.compat import check_model

    lines = []
    for file, inputs, profiles in pair_graphs(folder):
        shapes = [parse_input_shape(f"{n}:{','.join(str(d) for d in dims)}") for n, dims in inputs.items()]
        model = onnx.load(str(Path(folder) / file), load_external_data=False)
        lines += [f"{file}: {f}" for f in check_model(model, shapes, "dynamic_dims" if profiles else None)]
    return lines


def compile_pair(folder: Path, output: Path, soc_version: str, *, atc: Optional[str] = None, dry_run: bool = False,
                 echo: Optional[Callable[[str], None]] = None, **atc_extra: object) -> list[Path]:
    """ATC on every graph of the pair in ``folder``: ``output/<graph>.om`` (``output/stage<i>/<graph>.om`` for a
    split pair); returns the .om paths (none on a dry run)."""
    from ..cann_bridge.atc_command import build_command, render, validate
    from ..cann_bridge.atc_run import raise_for_result, run_atc
    from ..cann_bridge.compile import AtcUnavailable, _locate

    say = echo or (lambda line: None)
    target = pair_target(folder)
    if get_target(target).compiler != "atc":
        raise UsageError(f"{folder}: a pair for target {target}; build it with k3opt llm --target cann "
                         "to compile it for Ascend")
    plans = atc_options(pair_graphs(folder), soc_version, **atc_extra)
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
        prefix = output / Path(file).with_suffix("")
        prefix.parent.mkdir(exist_ok=True)
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
