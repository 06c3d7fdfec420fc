"""Targets are objects found by name; the core asks their traits, never their names."""
import ast
import pathlib

import pytest

import k3opt
from k3opt.errors import UsageError
from k3opt.pipeline.pass_base import PassContext
from k3opt.pipeline.target_traits import TargetTraits
from k3opt.targets import Target, get_target, names

_ROOT = pathlib.Path(k3opt.__file__).parent
#: Where a target's name may decide something: the targets themselves.
_OWNERS = ("targets",)


def test_the_targets_are_found_by_name_the_default_first():
    assert names()[0] == "onnx" and "cann" in names()
    assert all(isinstance(get_target(n), Target) and get_target(n).name == n for n in names())
    assert get_target(get_target("cann")) is get_target("cann")
    with pytest.raises(UsageError, match="unknown target 'tpu'; choose one of onnx, cann"):
        get_target("tpu")


def test_a_target_equals_its_name_so_plugins_comparing_names_keep_working():
    cann = get_target("cann")
    assert cann == "cann" and cann != "onnx" and str(cann) == "cann" and cann in ("cann",)
    ctx = PassContext(opset=17, target=cann)
    assert ctx.target is cann and ctx.target == "cann"


def test_a_pass_context_without_a_target_has_standard_onnx_traits():
    """pipeline sits below the targets: a context made without one reads the base traits, standard ONNX's answers
    (the onnx target's), and a name is refused rather than looked up."""
    default, onnx_target = PassContext(opset=17).target, get_target("onnx")
    assert all(getattr(default, trait) == getattr(onnx_target, trait) for trait in vars(TargetTraits)
               if not trait.startswith("_") and trait != "name")
    with pytest.raises(TypeError, match="get_target"):
        PassContext(opset=17, target="cann")


def _strings(node: ast.AST) -> list[str]:
    """The string constants ``node`` is, or holds as a tuple/list/set literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [v for e in node.elts for v in _strings(e)]
    return []


def _name_tests(tree: ast.AST, targets: set[str]) -> list[ast.AST]:
    """The places in ``tree`` that decide by a target's name: a comparison with a name (``target == "cann"``,
    ``t in ("onnx", "cann")``), a ``case "cann":``, a dict keyed by names, a hard-coded list of names
    (``click.Choice(["onnx", "cann"])``: ``k3opt.targets.names()`` lists them)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            hit = any(v in targets for side in (node.left, *node.comparators) for v in _strings(side))
        elif isinstance(node, ast.MatchValue):
            hit = any(v in targets for v in _strings(node.value))
        elif isinstance(node, ast.Dict):
            hit = any(v in targets for k in node.keys if k is not None for v in _strings(k))
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            hit = sum(v in targets for v in _strings(node)) >= 2
        else:
            hit = False
        if hit:
            found.append(node)
    return found


def test_no_code_outside_the_targets_tests_a_target_by_name():
    """Outside k3opt/targets/ the code asks a Target's traits and hooks, never its name (issue #27): a new target
    is one new folder."""
    targets = set(names())
    found = [f"{p.relative_to(_ROOT)}:{node.lineno}: {ast.unparse(node)}" for p in sorted(_ROOT.rglob("*.py"))
             if p.relative_to(_ROOT).parts[0] not in _OWNERS
             for node in _name_tests(ast.parse(p.read_text()), targets)]
    assert found == []


@pytest.mark.parametrize("code", ['if target == "cann": pass', 'ok = "onnx" != t.name', 'x = t in ("cann",)',
                                  'match t:\n    case "cann": pass', 'choices = ["onnx", "cann"]',
                                  'opts = {"cann": 1}'])
def test_the_name_test_finder_finds_each_form(code: str):
    assert len(_name_tests(ast.parse(code), {"onnx", "cann"})) == 1
