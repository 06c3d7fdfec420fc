"""Building and validating the ATC command line for an ONNX model.

Every value ATC would reject is refused here, before minutes are spent in
ATC: soc versions not of the documented forms, malformed ``--input_shape``,
mutually exclusive dynamic options, dynamic profiles that do not fill the
``-1`` dims, both precision options, unknown enumeration values.
The facts come from docs/cann.md (which cites the ATC reference).
"""
from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path
from typing import Optional, Sequence

from ..errors import UsageError

#: The soc_version forms ATC documents: ``Ascend`` + the chip name from ``npu-smi info``.
SOC_VERSION_FORMS = (
    r"Ascend310", r"Ascend910A", r"Ascend310P[1-7]", r"Ascend310B[1-4]",
    r"Ascend910B[1-4]", r"Ascend910B2C", r"Ascend910B4_1", r"Ascend910_93\d\d",
)
_SOC_RE = re.compile("^(?:" + "|".join(SOC_VERSION_FORMS) + ")$")

PRECISION_MODES = (
    "force_fp16", "force_fp32", "cube_fp16in_fp32out", "allow_mix_precision", "allow_fp32_to_fp16",
    "must_keep_origin_dtype", "allow_mix_precision_fp16", "allow_mix_precision_bf16", "allow_fp32_to_bf16",
)
PRECISION_MODES_V2 = (
    "fp16", "origin", "cube_fp16in_fp32out", "mixed_float16", "mixed_bfloat16", "cube_hif8", "mixed_hif8",
)
LOG_LEVELS = ("debug", "info", "warning", "error", "null")
INPUT_FORMATS = ("ND", "NCHW", "NCDHW")
_DYNAMIC_FLAGS = ("dynamic_dims", "dynamic_batch_size", "dynamic_image_size")
_MIN_PROFILES, _MAX_PROFILES = 2, 100
_DIM_RE = re.compile(r"^(?:-1|[1-9]\d*|[1-9]\d*~[1-9]\d*)$")


@dataclasses.dataclass(frozen=True)
class InputShape:
    """One ``name:d1,d2`` entry of ``--input_shape``; dims are ints (``-1`` unknown) or ``a~b`` ranges."""

    name: str
    dims: tuple[str, ...]

    @property
    def unknown_dims(self) -> int:
        return sum(d == "-1" for d in self.dims)

    @property
    def static(self) -> Optional[tuple[int, ...]]:
        """The dims as ints when every one is a fixed size, else None."""
        if any(not d.isdigit() for d in self.dims):
            return None
        return tuple(int(d) for d in self.dims)

    def __str__(self) -> str:
        return f"{self.name}:{','.join(self.dims)}"


def parse_input_shape(spec: str) -> InputShape:
    """Parse ``name:1,128`` (``name:`` for a scalar, ``-1`` unknown, ``1~8`` a range)."""
    name, sep, dims = spec.rpartition(":")
    if not sep or not name:
        raise UsageError(f"--input-shape {spec!r}: expected NAME:D1,D2,... (e.g. input_ids:1,128)")
    parts = tuple(d.strip() for d in dims.split(",")) if dims.strip() else ()
    for d in parts:
        if not _DIM_RE.match(d) or ("~" in d and int(d.split("~")[0]) > int(d.split("~")[1])):
            raise UsageError(f"--input-shape {spec!r}: dim {d!r} is not a positive int, -1 or a range a~b")
    return InputShape(name, parts)


@dataclasses.dataclass(frozen=True)
class AtcOptions:
    """What the user asked of ATC; :func:`build_command` validates and renders it."""

    soc_version: str
    input_shapes: tuple[str, ...] = ()
    input_format: str = "ND"
    precision_mode: Optional[str] = None
    precision_mode_v2: Optional[str] = None
    dynamic_dims: Optional[str] = None
    dynamic_batch_size: Optional[str] = None
    dynamic_image_size: Optional[str] = None
    fusion_switch_file: Optional[str] = None
    log: str = "error"
    extra_args: tuple[str, ...] = ()

    def shapes(self) -> list[InputShape]:
        return [parse_input_shape(s) for s in self.input_shapes]

    def dynamic_option(self) -> Optional[str]:
        """The one dynamic option given (as ATC's flag name), or None."""
        given = [f for f in _DYNAMIC_FLAGS if getattr(self, f)]
        return given[0] if given else None


def _check_choice(flag: str, value: Optional[str], choices: Sequence[str]) -> None:
    if value is not None and value not in choices:
        raise UsageError(f"--{flag} {value!r} is not one of: {', '.join(choices)}")


def check_soc_version(soc: str) -> None:
    """Refuse a soc version ATC would reject (it must be ``Ascend`` + the chip name)."""
    if _SOC_RE.match(soc):
        return
    fixed = next((f for f in (soc[:1].upper() + soc[1:], "Ascend" + soc.upper().removeprefix("ASCEND"))
                  if _SOC_RE.match(f)), None)
    hint = f" (did you mean {fixed}?)" if fixed else ""
    raise UsageError(f"--soc-version {soc!r} is not a known Ascend SoC form{hint}: use 'Ascend' + the chip "
                     "name from `npu-smi info`, e.g. Ascend910B3, Ascend310P3, Ascend910_9392")


def _int_list(flag: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise UsageError(f"--{flag} {text!r}: expected comma-separated positive integers")
    return values


def _profiles(flag: str, text: str, width: Optional[int]) -> list[list[int]]:
    """Split ``a,b;c,d`` into profiles, checking their count and (when known) their width."""
    profiles = [_int_list(flag, p) for p in text.strip(";").split(";")]
    if not _MIN_PROFILES <= len(profiles) <= _MAX_PROFILES:
        raise UsageError(f"--{flag}: {len(profiles)} profile(s); ATC needs {_MIN_PROFILES} to {_MAX_PROFILES}")
    for p in profiles:
        if width is not None and len(p) != width:
            raise UsageError(f"--{flag}: profile {','.join(map(str, p))} has {len(p)} value(s), "
                             f"but the input shapes have {width} -1 dim(s) to fill")
    return profiles


def check_dynamic(opts: AtcOptions, shapes: Sequence[InputShape]) -> None:
    """Refuse dynamic options ATC rejects: more than one, no ``-1`` dims to fill, wrong profile sizes."""
    given = [f for f in _DYNAMIC_FLAGS if getattr(opts, f)]
    unknown = sum(s.unknown_dims for s in shapes)
    ranged = [str(s) for s in shapes if any("~" in d for d in s.dims)]
    if len(given) > 1:
        raise UsageError("--" + " and --".join(f.replace("_", "-") for f in given) + " are mutually exclusive")
    if not given:
        if unknown:
            raise UsageError("--input-shape has -1 dims: give --dynamic-dims, --dynamic-batch-size or "
                             "--dynamic-image-size (or a range a~b, or a fixed size)")
        return
    flag = given[0]
    cli_flag = flag.replace("_", "-")
    if ranged:
        raise UsageError(f"--{cli_flag} cannot be combined with shape ranges ({'; '.join(ranged)})")
    if not unknown:
        raise UsageError(f"--{cli_flag} needs -1 dims in --input-shape for its profiles to fill")
    if flag == "dynamic_dims":
        _profiles(cli_flag, opts.dynamic_dims or "", unknown)
        if any(a.split("=")[0] == "--insert_op_conf" for a in opts.extra_args):
            raise UsageError("--dynamic-dims cannot be combined with AIPP (--insert_op_conf)")
    elif flag == "dynamic_batch_size":
        if any("-1" in s.dims[1:] for s in shapes) or any(s.dims[:1] != ("-1",) for s in shapes if s.unknown_dims):
            raise UsageError("--dynamic-batch-size: only the first (batch) dim of an input may be -1")
        sizes = _int_list(cli_flag, opts.dynamic_batch_size or "")
        if not _MIN_PROFILES <= len(sizes) <= _MAX_PROFILES:
            raise UsageError(f"--{cli_flag}: {len(sizes)} size(s); ATC needs {_MIN_PROFILES} to {_MAX_PROFILES}")
    else:
        if unknown % 2:
            raise UsageError(f"--{cli_flag} fills -1 pairs (H,W), but the input shapes have {unknown} -1 dim(s)")
        _profiles(cli_flag, opts.dynamic_image_size or "", 2)


def _own_flags() -> set[str]:
    return {"model", "framework", "output", "soc_version", "input_shape", "input_format", "log",
            "precision_mode", "precision_mode_v2", "fusion_switch_file", *_DYNAMIC_FLAGS}


def check_extra_args(extra: Sequence[str]) -> None:
    """Extra arguments pass through to ATC, but must be ``--key=value`` / ``--key value`` flags
    and must not repeat one k3opt sets."""
    own = _own_flags()
    takes_value = False
    for arg in extra:
        if not arg.startswith("--"):
            if not takes_value:
                raise UsageError(f"extra ATC argument {arg!r} is not a --flag (ATC flags go after `--`)")
            takes_value = False
            continue
        key, eq, _ = arg[2:].partition("=")
        takes_value = not eq
        if key in own:
            raise UsageError(f"extra ATC flag {arg!r} repeats --{key}, which k3opt sets from its own options")
        if key == "weight":
            raise UsageError("extra ATC flag --weight is ignored for ONNX models: drop it")


def validate(opts: AtcOptions) -> list[InputShape]:
    """Every check ATC would otherwise fail on; returns the parsed input shapes."""
    check_soc_version(opts.soc_version)
    shapes = opts.shapes()
    names = [s.name for s in shapes]
    if len(set(names)) != len(names):
        raise UsageError(f"--input-shape names an input twice: {', '.join(sorted({n for n in names if names.count(n) > 1}))}")
    if opts.precision_mode and opts.precision_mode_v2:
        raise UsageError("--precision-mode and --precision-mode-v2 are mutually exclusive")
    _check_choice("precision-mode", opts.precision_mode, PRECISION_MODES)
    _check_choice("precision-mode-v2", opts.precision_mode_v2, PRECISION_MODES_V2)
    _check_choice("log", opts.log, LOG_LEVELS)
    _check_choice("input-format", opts.input_format, INPUT_FORMATS)
    check_dynamic(opts, shapes)
    if opts.fusion_switch_file and not Path(opts.fusion_switch_file).is_file():
        raise UsageError(f"--fusion-switch-file {opts.fusion_switch_file}: no such file")
    check_extra_args(opts.extra_args)
    return shapes


def check_output_prefix(output: str) -> None:
    """ATC's ``--output`` is a prefix: it appends ``.om`` itself."""
    if str(output).endswith(".om"):
        raise UsageError(f"output prefix {str(output)!r} must not end in .om: ATC appends it")


def build_command(atc: str, model: str, output: str, opts: AtcOptions) -> list[str]:
    """The ATC argv for ``model`` -> ``<output>.om`` (``output`` has no suffix), after :func:`validate`."""
    shapes = validate(opts)
    check_output_prefix(output)
    cmd = [atc, "--framework=5", f"--model={model}", f"--output={output}", f"--soc_version={opts.soc_version}"]
    if shapes:
        cmd.append("--input_shape=" + ";".join(str(s) for s in shapes))
    cmd.append(f"--input_format={opts.input_format}")
    for flag in _DYNAMIC_FLAGS + ("precision_mode", "precision_mode_v2", "fusion_switch_file"):
        value = getattr(opts, flag)
        if value:
            cmd.append(f"--{flag}={value}")
    cmd.append(f"--log={opts.log}")
    cmd.extend(opts.extra_args)
    return cmd


def render(cmd: Sequence[str]) -> str:
    """The command as one shell line, quoted so it can be pasted into a terminal."""
    return shlex.join(cmd)
