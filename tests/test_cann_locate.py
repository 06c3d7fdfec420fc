"""Finding ATC: --atc, PATH, the CANN variables, the default install prefixes, and the not-found line."""
from __future__ import annotations

from pathlib import Path

import pytest

from k3opt.cann_bridge import atc_locate
from k3opt.cann_bridge.atc_locate import find_atc
from k3opt.errors import CompileError, UsageError
from tests.fake_atc import write_fake_atc


@pytest.fixture
def no_defaults(monkeypatch, tmp_path):
    """Point the fixed install prefixes into tmp_path so the host's own CANN (if any) never interferes."""
    roots = [tmp_path / "usr-local-toolkit", tmp_path / "home" / "Ascend/ascend-toolkit/latest",
             tmp_path / "usr-local-cann"]
    monkeypatch.setattr(atc_locate, "default_roots", lambda home: [roots[0], home / "Ascend/ascend-toolkit/latest",
                                                                   roots[2]])
    return roots


def test_explicit_wins(tmp_path, no_defaults):
    atc = write_fake_atc(tmp_path / "mine")
    write_fake_atc(tmp_path / "onpath")
    assert find_atc(str(atc), {"PATH": str(tmp_path / "onpath")}, tmp_path) == atc


def test_explicit_must_be_executable(tmp_path):
    (tmp_path / "atc").write_text("not executable")
    with pytest.raises(UsageError, match="not an executable"):
        find_atc(str(tmp_path / "atc"), {}, tmp_path)


def test_path_before_env(tmp_path, no_defaults):
    onpath = write_fake_atc(tmp_path / "onpath")
    write_fake_atc(tmp_path / "tk" / "bin")
    env = {"PATH": f"/nonexistent:{onpath.parent}", "ASCEND_TOOLKIT_HOME": str(tmp_path / "tk")}
    assert find_atc(None, env, tmp_path) == onpath


@pytest.mark.parametrize("var", ["ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH"])
@pytest.mark.parametrize("sub", ["bin", "compiler/bin", "atc/bin"])
def test_env_roots(tmp_path, no_defaults, var, sub):
    atc = write_fake_atc(tmp_path / "tk" / sub)
    assert find_atc(None, {"PATH": "", var: str(tmp_path / "tk")}, tmp_path) == atc


@pytest.mark.parametrize("which", [0, 1, 2])
def test_default_prefixes(tmp_path, no_defaults, which):
    home = tmp_path / "home"
    atc = write_fake_atc(no_defaults[which] / "bin")
    assert find_atc(None, {"PATH": "", "HOME": str(home)}) == atc


def test_real_default_prefixes_are_the_documented_ones():
    home = Path("/home/u")
    assert atc_locate.default_roots(home) == [Path("/usr/local/Ascend/ascend-toolkit/latest"),
                                              home / "Ascend/ascend-toolkit/latest", Path("/usr/local/Ascend/cann")]


def test_not_found_is_one_line_naming_places_and_set_env(tmp_path, no_defaults):
    with pytest.raises(CompileError) as err:
        find_atc(None, {"PATH": "", "ASCEND_HOME_PATH": str(tmp_path / "empty")}, tmp_path)
    text = str(err.value)
    assert "\n" not in text
    for part in ("PATH", "$ASCEND_HOME_PATH", "$ASCEND_TOOLKIT_HOME unset", str(no_defaults[0]), "set_env.sh",
                 "--atc"):
        assert part in text
    assert err.value.exit_code == 1
