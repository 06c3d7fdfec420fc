"""A stand-in ``atc`` for tests: strict about ATC's argument grammar, scriptable failures.

:func:`write_fake_atc` writes an executable Python script named ``atc``. It
accepts ``--key=value`` and ``--key value``, needs ``--framework=5``,
``--model`` (an existing file), ``--output`` and a known ``--soc_version``
form, checks ``--input_shape`` syntax, the mutually exclusive dynamic
options and their profiles, and prints ``ATC start working now...`` then
either the success line (writing ``<output>.om``) or the failure line and
error-code lines. Every run's argv is appended to ``argv.jsonl`` beside it.

Selecting behaviour (env var, or a file of the same name beside the script):
- ``FAKE_ATC_MODE``: ``success`` (default), ``E19999`` (inner error),
  ``silent`` (exit 0 without the success line), ``success-but-exit-1``,
  ``libhal`` (the missing-driver loader error).
- ``FAKE_ATC_UNSUPPORTED``: comma-separated op types that fail with E19010 (keyed as ATC keys them:
  ``<domain>::<that domain's opset import>::<Op>``, e.g. ``npu::1::NPUPromptFlashAttention``).
- ``FAKE_ATC_FUSION``: non-empty -> write ``fusion_result.json`` in the cwd.
"""
from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

_SCRIPT = r'''
import json, os, re, sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
KNOWN = {"model", "framework", "output", "soc_version", "input_shape", "input_format", "log", "precision_mode",
         "precision_mode_v2", "dynamic_dims", "dynamic_batch_size", "dynamic_image_size", "fusion_switch_file",
         "insert_op_conf", "op_select_implmode", "optypelist_for_implmode", "out_nodes", "input_fp16_nodes",
         "output_type", "external_weight", "keep_dtype", "customize_dtypes", "weight", "mode"}
SOC = re.compile(r"^Ascend(310|910A|310P[1-7]|310B[1-4]|910B[1-4]|910B2C|910B4_1|910_93\d\d)$")
DIM = re.compile(r"^(-1|[1-9]\d*|[1-9]\d*~[1-9]\d*)$")


def setting(name):
    flag = HERE / name
    return os.environ.get(name) or (flag.read_text().strip() if flag.is_file() else "")


def fail(*lines, status=255):
    print("ATC run failed, Please check the detail log, Try 'atc --help' for more information")
    for line in lines:
        print(line)
    sys.exit(status)


def bad(param, value, reason):
    fail(f"E10001: Value [{value}] for parameter [--{param}] is invalid. Reason: {reason}")


def parse(argv):
    args, i = {}, 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) < 3:
            bad("", arg, "arguments must be --key=value or --key value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                bad(key, "", "missing value")
            i += 1
            value = argv[i]
        if key not in KNOWN:
            bad(key, value, "unknown parameter")
        if key in args:
            bad(key, value, "given twice")
        args[key] = value
        i += 1
    return args


def check_shapes(args):
    unknown = 0
    for entry in filter(None, args.get("input_shape", "").split(";")):
        name, sep, dims = entry.rpartition(":")
        if not sep or not name:
            bad("input_shape", entry, "expected name:d1,d2")
        for d in filter(None, dims.split(",")):
            if not DIM.match(d):
                bad("input_shape", entry, f"dim {d} invalid")
            unknown += d == "-1"
    dynamic = [k for k in ("dynamic_dims", "dynamic_batch_size", "dynamic_image_size") if k in args]
    if len(dynamic) > 1:
        bad(dynamic[1], args[dynamic[1]], f"cannot be used with --{dynamic[0]}")
    if unknown and not dynamic:
        bad("input_shape", args["input_shape"], "-1 dims need a dynamic option")
    if dynamic and not unknown:
        bad(dynamic[0], args[dynamic[0]], "input_shape has no -1 dim")
    if "dynamic_dims" in args:
        profiles = args["dynamic_dims"].split(";")
        if not 2 <= len(profiles) <= 100 or any(len(p.split(",")) != unknown for p in profiles):
            bad("dynamic_dims", args["dynamic_dims"], f"profiles must have {unknown} values, 2 to 100 profiles")


def main():
    print("ATC start working now, please wait for a moment.", flush=True)
    with open(HERE / "argv.jsonl", "a") as f:
        f.write(json.dumps(sys.argv[1:]) + "\n")
    mode = setting("FAKE_ATC_MODE") or "success"
    if mode == "libhal":
        print("atc.bin: error while loading shared libraries: libascend_hal.so: cannot open shared object file")
        sys.exit(127)
    args = parse(sys.argv[1:])
    if "framework" not in args:
        fail("E10007: [--framework] is required. The value must be [0(Caffe) or 1(MindSpore) or 3(TensorFlow) or 5(Onnx)].")
    if args["framework"] != "5":
        bad("framework", args["framework"], "k3opt's stand-in only knows ONNX (5)")
    for key in ("model", "output", "soc_version"):
        if not args.get(key):
            fail(f"E10054: The required parameter [--{key}] for ATC is empty.")
    if not SOC.match(args["soc_version"]):
        bad("soc_version", args["soc_version"], "unsupported soc version")
    if not Path(args["model"]).is_file():
        bad("model", args["model"], "file does not exist")
    if "precision_mode" in args and "precision_mode_v2" in args:
        bad("precision_mode_v2", args["precision_mode_v2"], "cannot be used with --precision_mode")
    check_shapes(args)
    unsupported = set(filter(None, setting("FAKE_ATC_UNSUPPORTED").split(",")))
    if unsupported:
        import onnx
        model = onnx.load(args["model"], load_external_data=False)
        opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
        bad_nodes = [n for n in model.graph.node if n.op_type in unsupported]
        if bad_nodes:
            versions = {o.domain or "ai.onnx": o.version for o in model.opset_import}
            fail(*[f"E19010: No parser is registered for Op [{n.name}, optype "
                   f"[{n.domain or 'ai.onnx'}::{versions.get(n.domain or 'ai.onnx', opset)}::{n.op_type}]]."
                   for n in bad_nodes])
    if mode == "E19999":
        fail("E19999: Inner Error!", "        [GraphOpt][Prepare] failed")
    if setting("FAKE_ATC_FUSION"):
        result = {"session_and_graph_id_0_0": {
            "graph_fusion": {"MatMulBiasAddFusionPass": {"effect_times": "2", "match_times": "3"},
                             "SoftmaxFusionPass": {"effect_times": "0", "match_times": "1"}},
            "ub_fusion": {"AutomaticUbFusion": {"effect_times": "4", "match_times": "4"}}}}
        Path("fusion_result.json").write_text(json.dumps(result))
    if mode == "silent":
        sys.exit(0)
    Path(args["output"] + ".om").write_bytes(b"fake om")
    print("ATC run success, welcome to the next use.")
    sys.exit(1 if mode == "success-but-exit-1" else 0)


main()
'''


def write_fake_atc(folder: Path, name: str = "atc") -> Path:
    """Write the stand-in ATC into ``folder`` (created if needed); returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"#!{sys.executable}\n{_SCRIPT}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def recorded_argv(atc: Path) -> list[list[str]]:
    """The argv of every run of the stand-in at ``atc`` so far."""
    log = atc.parent / "argv.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []

