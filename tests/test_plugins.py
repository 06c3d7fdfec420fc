"""The plugin hook end to end: entry points, --plugin / plugins=[...] (files, modules, objects), direct
registration; placement and --skip; every broken-plugin case names the plugin (and rule) and leaves
nothing half-registered."""
from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto as TP
from onnx import helper

import k3opt
from k3opt import plugins
from k3opt.cli import main as cli
from k3opt.errors import PluginError, UsageError
from k3opt.pipeline import pass_base as base, registry as pass_registry
from k3opt.patterns import Rule, register_rules, rule
from tests.helpers import assert_equivalent, make_model, op_counts

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "plugin_example"

# A plugin file: relu(-x) written as -min(x, 0), a pass placed right after fold-constants.
NEG_RELU_PLUGIN = """
from k3opt.patterns import Rule, register_rules

def pattern(op, x):
    return op.Relu(op.Neg(x))

def rewrite(op, m):
    return op.Neg(op.Min(m["x"], 0.0))

register_rules(Rule("neg-relu", pattern, rewrite), name="{name}", after="fold-constants")
"""


@pytest.fixture(autouse=True)
def registry(monkeypatch):
    """Every test starts from the built-in registry and no loaded plugins, and leaves it so."""
    saved = plugins.process_registry().copy()
    yield
    pass_registry.PROCESS.replace_entries(saved)


def model() -> onnx.ModelProto:
    return make_model([helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Relu", ["n"], ["y"])],
                      [("x", TP.FLOAT, [2, 4])], [("y", TP.FLOAT, [2, 4])])


def write(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    return path


def assert_fused(out: onnx.ModelProto) -> None:
    assert op_counts(out) == {"Neg": 1, "Min": 1}
    assert_equivalent(model(), out)


# --- route 2: --plugin / plugins=[...] --------------------------------------------------------------

def test_file_plugin_through_api_placed_after_named_pass(tmp_path):
    path = write(tmp_path, "negrelu_file", NEG_RELU_PLUGIN.format(name="t-negrelu"))
    assert_fused(k3opt.optimize(model(), plugins=[str(path)]))
    with plugins.run_plugins([str(path)]):  # the registry a run with the plugin sees
        names = list(plugins.registered_passes())
        assert names[names.index("fold-constants") + 1] == "t-negrelu"
        assert plugins.registered_passes()["t-negrelu"].plugin == "negrelu_file"
    assert "t-negrelu" not in plugins.registered_passes()
    assert op_counts(k3opt.optimize(model(), plugins=[str(path)], skip=["t-negrelu"])) == {"Neg": 1, "Relu": 1}


def test_a_run_registers_its_plugins_into_its_own_copy_of_the_registry(tmp_path):
    """The process registry never holds a run's plugin, even while the run is going (nothing to put back)."""
    path = write(tmp_path, "negrelu_own", NEG_RELU_PLUGIN.format(name="t-own"))
    before = pass_registry.PROCESS.entries()
    with plugins.run_plugins([str(path)]) as run_registry:
        assert run_registry is not pass_registry.PROCESS and "t-own" in run_registry.entries()
        assert pass_registry.PROCESS.entries() == before
        with plugins.run_plugins([]) as other:  # a second run started meanwhile does not see it either
            assert "t-own" not in other.entries()
    with plugins.run_plugins([str(path)]) as again:  # executed again for this run: its own class
        assert again.entries()["t-own"] is not run_registry.entries()["t-own"]
        assert again.entries()["t-own"].plugin == "negrelu_own"
    assert pass_registry.PROCESS.entries() == before


def test_module_and_attribute_specs(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    write(tmp_path, "negrelu_mod_a", NEG_RELU_PLUGIN.format(name="t-mod-a"))
    write(tmp_path, "negrelu_mod_b", """
        from k3opt.patterns import Rule

        def make():
            return [Rule("neg-relu-b", lambda op, x: op.Relu(op.Neg(x)),
                         lambda op, m: op.Neg(op.Min(m["x"], 0.0)))]
        """)
    k3opt.optimize(model(), plugins=["negrelu_mod_a", "negrelu_mod_b:make"], passes=[])
    with plugins.run_plugins(["negrelu_mod_a", "negrelu_mod_b:make"]):
        passes = plugins.registered_passes()
        assert passes["t-mod-a"].plugin == "negrelu_mod_a"
        assert passes["negrelu_mod_b:make"].plugin == "negrelu_mod_b:make"  # a list of rules: one pass, plugin's name
    assert_fused(k3opt.optimize(model(), plugins=["negrelu_mod_b:make"], passes=["negrelu_mod_b:make"]))


class NegReluPass(base.Pass):
    name = "t-obj-pass"

    def run(self, graph, ctx):
        return 0


def test_object_specs_rule_pass_class_and_callable():
    single = Rule("t-obj-rule", lambda op, x: op.Relu(op.Neg(x)), lambda op, m: op.Neg(op.Min(m["x"], 0.0)))
    k3opt.plugins.load_plugins([single, NegReluPass, lambda: None])
    passes = plugins.registered_passes()
    assert passes["t-obj-rule"].plugin == "t-obj-rule" and passes["t-obj-pass"].plugin == "NegReluPass"
    assert_fused(k3opt.optimize(model(), passes=["t-obj-rule"]))
    k3opt.plugins.load_plugins([single])  # loading the same plugin again is a no-op


def test_cli_optimize_and_passes_with_plugin(tmp_path):
    path = write(tmp_path, "negrelu_cli", NEG_RELU_PLUGIN.format(name="t-cli"))
    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(model(), src)
    res = CliRunner().invoke(cli, ["optimize", str(src), "-o", str(dst), "--plugin", str(path), "-q"])
    assert res.exit_code == 0, res.output
    assert_fused(onnx.load(dst))
    res = CliRunner().invoke(cli, ["passes", "--plugin", str(path)])
    assert res.exit_code == 0 and "plugin negrelu_cli" in next(line for line in res.output.splitlines()
                                                               if "t-cli" in line)
    res = CliRunner().invoke(cli, ["optimize", str(src), "-o", str(dst), "--plugin", str(path), "--skip", "t-cli",
                                   "--overwrite", "-q"])
    assert res.exit_code == 0 and op_counts(onnx.load(dst)) == {"Neg": 1, "Relu": 1}


# --- a run's plugins and options are the run's own ------------------------------------------------------

def test_two_runs_in_one_process_with_different_plugins_are_independent(tmp_path, monkeypatch):
    """A plugin asked for by run 1 is not in run 2 unless run 2 asks again; asked again, it is there again,
    also when its module registered at import (executed for each run that asks, into that run's registry)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    imports = tmp_path / "imports.log"
    write(tmp_path, "negrelu_once", NEG_RELU_PLUGIN.format(name="t-once")
          + f"\nopen({str(imports)!r}, 'a').write('x')\n")
    plain = k3opt.optimize(model())
    assert op_counts(plain) == {"Neg": 1, "Relu": 1}
    for run in range(2):
        assert_fused(k3opt.optimize(model(), plugins=["negrelu_once"]))
        assert k3opt.optimize(model()) == plain, f"run {run}: the plugin of the run before leaked"
        assert "t-once" not in plugins.registered_passes()
    assert imports.read_text() == "xx"  # executed for each run that asked: nothing recorded, nothing replayed
    assert "negrelu_once" not in sys.modules  # a run's plugin module is the run's own


def test_a_failed_run_leaves_no_plugin_behind(tmp_path):
    path = write(tmp_path, "negrelu_fail", NEG_RELU_PLUGIN.format(name="t-fail-run"))
    with pytest.raises(UsageError):
        k3opt.optimize(model(), plugins=[str(path)], passes=["no-such-pass"])
    assert "t-fail-run" not in plugins.registered_passes()


def test_two_runs_with_different_pass_options_are_independent():
    """A pass option of run 1 (MatMul+Add to Gemm on rank-3 input) does not reach run 2."""
    m = make_model([helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Add", ["mm", "b"], ["y"])],
                   [("x", TP.FLOAT, [2, 5, 4])], [("y", TP.FLOAT, [2, 5, 3])],
                   {"w": np.arange(12, dtype=np.float32).reshape(4, 3), "b": np.float32([1, 2, 3])})
    plain = k3opt.optimize(m)
    assert "Gemm" not in op_counts(plain)
    assert "Gemm" in op_counts(k3opt.optimize(m, matmul_add_nd="flatten"))
    assert k3opt.optimize(m) == plain


def test_an_open_rule_set_grown_by_a_run_plugin_shrinks_back(tmp_path):
    """Rules a run's plugin adds to a rule set registered in code are gone after the run (a new class grew)."""
    first = register_rules(Rule("t-grow-a", lambda op, x: op.Relu(op.Neg(x)),
                                                lambda op, m: op.Neg(op.Min(m["x"], 0.0))), name="t-grow")
    grow = write(tmp_path, "grow", f"""
        from k3opt.patterns import Rule, register_rules
        register_rules(Rule("t-grow-b", lambda op, x: op.Neg(op.Neg(x)), lambda op, m: op.Identity(m["x"])),
                       name="t-grow")
        """)
    with plugins.run_plugins([str(grow)]):
        assert [r.name for r in plugins.registered_passes()["t-grow"].rules] == ["t-grow-a", "t-grow-b"]
    assert plugins.registered_passes()["t-grow"] is first and [r.name for r in first.rules] == ["t-grow-a"]


# --- route 3: direct registration ------------------------------------------------------------------

def test_direct_registration_with_rule_decorator():
    @rule(before="fold-constants")
    class TDirectNegRelu:
        """relu(-x) as -min(x, 0)."""

        def pattern(op, x):
            return op.Relu(op.Neg(x))

        def rewrite(op, m):
            return op.Neg(op.Min(m["x"], 0.0))

    assert list(plugins.registered_passes())[0] == "t-direct-neg-relu"
    assert_fused(k3opt.optimize(model()))


# --- route 1: entry points ------------------------------------------------------------------------

def _fake_entry_points(monkeypatch, *specs: tuple[str, str]):
    eps = [importlib.metadata.EntryPoint(name, value, plugins.ENTRY_POINT_GROUP) for name, value in specs]
    monkeypatch.setattr(plugins.importlib.metadata, "entry_points",
                        lambda group: [e for e in eps if e.group == group])
    monkeypatch.setattr(plugins, "_entry_points_done", False)
    monkeypatch.setattr(plugins, "_entry_point_error", None)


def test_entry_point_discovered_with_example_plugin(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    _fake_entry_points(monkeypatch, ("gelu", "k3opt_gelu.rules:register"))
    with plugins.run_plugins([]) as run_registry:  # installed plugins join every run's registry
        passes = run_registry.ordered()
    assert passes["fuse-gelu"].plugin == "gelu"
    k3opt.plugins.load_plugins(["k3opt_gelu.rules:register"])  # same hook by a second route: loaded once


def test_broken_entry_point_fails_every_time_unless_disabled(monkeypatch, tmp_path):
    _fake_entry_points(monkeypatch, ("bad", "no_such_module_k3opt:register"))
    for _ in range(2):
        with pytest.raises(PluginError, match=f"plugin 'bad' failed to load.*{plugins.DISABLE_ENV}=1"):
            with plugins.run_plugins([]):
                pass
    _fake_entry_points(monkeypatch, ("bad", "no_such_module_k3opt:register"))
    monkeypatch.setenv(plugins.DISABLE_ENV, "1")
    with plugins.run_plugins([]) as run_registry:
        assert "fold-constants" in run_registry.entries()


def _env_with(*paths: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), str(REPO), env.get("PYTHONPATH", "")])
    env.pop(plugins.DISABLE_ENV, None)
    return env


def test_entry_point_from_dist_info_in_a_fresh_process(tmp_path):
    """Real discovery through importlib.metadata: a dist-info with entry_points.txt, as pip writes it."""
    info = tmp_path / "k3opt_gelu-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: k3opt-gelu\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[k3opt.plugins]\ngelu = k3opt_gelu.rules:register\n")
    env = _env_with(tmp_path, EXAMPLE)
    res = subprocess.run([sys.executable, "-m", "k3opt", "passes"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert "plugin gelu" in next(line for line in res.stdout.splitlines() if "fuse-gelu" in line)
    src, dst = tmp_path / "gelu.onnx", tmp_path / "out.onnx"
    onnx.save(_erf_gelu_model(), src)
    res = subprocess.run([sys.executable, "-m", "k3opt", "optimize", str(src), "-o", str(dst), "-q"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert op_counts(onnx.load(dst)) == {"Gelu": 1}


def _erf_gelu_model() -> onnx.ModelProto:
    """x * 0.5 * (1 + erf(x / sqrt 2)) as torch.onnx writes it, at opset 20 (where Gelu exists)."""
    nodes = [helper.make_node("Div", ["x", "sqrt2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["a"]), helper.make_node("Mul", ["x", "a"], ["m"]),
             helper.make_node("Mul", ["m", "half"], ["y"])]
    consts = {"sqrt2": np.array(2 ** 0.5, np.float32), "one": np.array(1.0, np.float32),
              "half": np.array(0.5, np.float32)}
    return make_model(nodes, [("x", TP.FLOAT, [2, 4])], [("y", TP.FLOAT, [2, 4])], consts, opset=20)


@pytest.mark.slow
def test_example_package_pip_installs_and_its_tests_pass(tmp_path):
    """The example is a real package: pip builds and installs it (into a private dir) and k3opt finds it."""
    target, src = tmp_path / "site", tmp_path / "src"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(src)], check=True, timeout=300)
    env = _env_with(target)
    res = subprocess.run([sys.executable, "-m", "k3opt", "passes"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0 and "fuse-gelu" in res.stdout, res.stderr
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(src / "tests")],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:]


# --- broken plugins --------------------------------------------------------------------------------

@pytest.mark.parametrize("name,source,message", [
    ("bad_import", "import no_such_module_k3opt\n", "plugin 'bad_import' failed to load: ModuleNotFoundError"),
    ("bad_syntax", "def f(:\n", "plugin 'bad_syntax' failed to load: SyntaxError"),
    ("bad_hook", "def register():\n    raise RuntimeError('no GPU')\n",
     "plugin 'bad_hook' failed to load: RuntimeError: no GPU"),
    ("bad_anchor", NEG_RELU_PLUGIN.format(name="t-anchor").replace("fold-constants", "no-such-pass"),
     "plugin 'bad_anchor' failed to load: pass 't-anchor' asks to run next to unknown pass 'no-such-pass'"),
    ("bad_type", "def register():\n    return 42\n", "plugin 'bad_type' provides int"),
    ("bad_pattern", "from k3opt.patterns import Rule\nRULE = Rule('r', lambda op, x: x, lambda op, m: None)\n",
     "plugin 'bad_pattern' failed to load: PatternError"),
])
def test_broken_plugin_load_names_plugin(tmp_path, name, source, message):
    path = write(tmp_path, name, source)
    with pytest.raises(PluginError, match=message.replace("(", r"\(").replace(")", r"\)")):
        k3opt.optimize(model(), plugins=[str(path)])


def test_missing_file_and_unknown_module():
    with pytest.raises(PluginError, match="plugin 'nowhere/rules.py': no such file"):
        plugins.load_plugins(["nowhere/rules.py"])
    with pytest.raises(PluginError, match="plugin 'no_such_module_k3opt' failed to load: ModuleNotFoundError"):
        plugins.load_plugins(["no_such_module_k3opt"])


def test_failed_plugin_leaves_nothing_registered(tmp_path):
    path = write(tmp_path, "half", NEG_RELU_PLUGIN.format(name="t-half") + "raise ValueError('late')\n")
    with pytest.raises(PluginError, match="plugin 'half'"):
        plugins.load_plugins([str(path)])
    assert "t-half" not in plugins.registered_passes()


RULE_FAILURES = {  # where -> (extra plugin code, the Rule(...) expression using it)
    "check": ("def check(m):\n    return m['y']\n", "Rule('neg-relu', pattern, rewrite, check)"),
    "rewrite": ("def bad(op, m):\n    return op.Frobnicate(m['x'])\n", "Rule('neg-relu', pattern, bad)"),
}


@pytest.mark.parametrize("where,message", [
    ("check", r"plugin 'rule_fail_check', pass 't-fail', rule 'neg-relu': check raised KeyError"),
    ("rewrite", r"plugin 'rule_fail_rewrite', pass 't-fail', rule 'neg-relu': invalid rewrite: .*Frobnicate"),
])
def test_rule_failure_during_optimize_names_plugin_and_rule(tmp_path, where, message):
    extra, rule_expr = RULE_FAILURES[where]
    source = NEG_RELU_PLUGIN.format(name="t-fail").replace('Rule("neg-relu", pattern, rewrite)', rule_expr)
    source = source.replace("register_rules(", extra + "\nregister_rules(", 1)
    path = write(tmp_path, f"rule_fail_{where}", source)
    original = model()
    with pytest.raises(PluginError, match=message):
        k3opt.optimize(original, plugins=[str(path)])
    assert original == model()


def test_plugin_pass_exception_names_plugin_and_pass(tmp_path):
    path = write(tmp_path, "crashy", """
        from k3opt import Pass, register_pass

        @register_pass
        class Crashy(Pass):
            name = "t-crashy"

            def run(self, graph, ctx):
                raise ZeroDivisionError("oops")
        """)
    with pytest.raises(PluginError, match="plugin 'crashy', pass 't-crashy' failed: ZeroDivisionError: oops"):
        k3opt.optimize(model(), plugins=[str(path)])


def test_cli_broken_plugin_is_one_line_exit_2(tmp_path):
    path = write(tmp_path, "cli_bad", "import no_such_module_k3opt\n")
    src = tmp_path / "m.onnx"
    onnx.save(model(), src)
    res = CliRunner().invoke(cli, ["optimize", str(src), "--plugin", str(path), "-q"])
    assert res.exit_code == 2 and "plugin 'cli_bad' failed to load" in res.output
    assert not (tmp_path / "m.k3opt.onnx").exists()
