"""Targets are objects found by name; the core asks their traits, never their names."""
import pathlib
import re

import pytest

import k3opt
from k3opt.errors import UsageError
from k3opt.pipeline.pass_base import PassContext
from k3opt.targets import Target, get_target, names

_ROOT = pathlib.Path(k3opt.__file__).parent
_NAME_TEST = re.compile(r"""(==|!=)\s*["'](onnx|cann)["']|["'](onnx|cann)["']\s*(==|!=)""")
#: The layers below the targets, and the run: none of them may test a target by name.
_CORE = ("graph", "modelio", "pipeline", "patterns", "passes", "api.py", "cli_options.py")


def test_the_targets_are_found_by_name_the_default_first():
    assert names()[0] == "onnx" and "cann" in names()
    assert all(isinstance(get_target(n), Target) and get_target(n).name == n for n in names())
    assert get_target(get_target("cann")) is get_target("cann")
    with pytest.raises(UsageError, match="unknown target 'tpu'; choose one of onnx, cann"):
        get_target("tpu")


def test_a_target_equals_its_name_so_plugins_comparing_names_keep_working():
    cann = get_target("cann")
    assert cann == "cann" and cann != "onnx" and str(cann) == "cann" and cann in ("cann",)
    ctx = PassContext(opset=17, target="cann")
    assert ctx.target is cann and ctx.target == "cann"
    assert PassContext(opset=17).target is get_target("onnx")


def test_no_core_module_tests_a_target_by_name():
    files = [p for part in _CORE for p in (sorted((_ROOT / part).rglob("*.py")) if (_ROOT / part).is_dir()
                                           else [_ROOT / part])]
    found = [f"{p.relative_to(_ROOT)}:{i}: {line.strip()}" for p in files
             for i, line in enumerate(p.read_text().splitlines(), 1) if _NAME_TEST.search(line)]
    assert found == []
