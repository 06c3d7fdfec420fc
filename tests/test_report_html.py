"""``--report F.html``: one self-contained page that lists what the JSON report lists (parsed, not grepped)."""
from __future__ import annotations

import json
from html.parser import HTMLParser

import onnx
from click.testing import CliRunner

import k3opt
from k3opt.cli import main
from k3opt.report import Report
from k3opt.report_html import write_report
from tests.cann_models import rms_model
from tests.test_layer_norm import ln_model


class Page(HTMLParser):
    """The tags of a page, with the ``data-*`` items it lists and any reference to something outside it."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.items: dict[str, list[dict[str, str]]] = {}
        self.tags: list[str] = []
        self.external: list[str] = []
        self.classes: dict[str, set[str]] = {}
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = {k: v or "" for k, v in attrs}
        self.tags.append(tag)
        for key, value in a.items():
            if key in ("src", "href", "srcset", "action") or (key == "style" and "url(" in value):
                self.external.append(f"{tag} {key}={value}")
        for key in ("data-op", "data-pass", "data-site", "data-output", "data-lowering", "data-finding",
                    "data-note"):
            if key in a and not (key == "data-pass" and "data-site" in a):
                self.items.setdefault(key, []).append(a)
                if "class" in a:
                    self.classes.setdefault(key, set())
                    if "changed" in a["class"].split():
                        self.classes[key].add(a[key])

    def values(self, key: str) -> list[str]:
        return [a[key] for a in self.items.get(key, [])]


def _run(model, tmp_path, **kw) -> tuple[dict, str]:
    src = tmp_path / "in.onnx"
    onnx.save(model, src)
    report = Report()
    k3opt.optimize_file(src, tmp_path / "out.onnx", report=report, **kw)
    write_report(report, tmp_path / "r.json")
    write_report(report, tmp_path / "r.html")
    return json.loads((tmp_path / "r.json").read_text()), (tmp_path / "r.html").read_text()


def test_page_is_self_contained_html(tiny_transformer, tmp_path):
    _, text = _run(onnx.load(tiny_transformer), tmp_path, verify=True)
    page = Page(text)
    assert text.startswith("<!DOCTYPE html>") and page.tags[:2] == ["html", "head"]
    assert "script" not in page.tags and "link" not in page.tags and "img" not in page.tags
    assert page.external == [] and "@import" not in text and "url(" not in text and "http" not in text


def test_page_lists_what_the_json_lists(tiny_transformer, tmp_path):
    data, text = _run(onnx.load(tiny_transformer), tmp_path, verify=True)
    page = Page(text)
    before, after = data["before"]["ops"], data["after"]["ops"]
    assert sorted(page.values("data-op")) == sorted(set(before) | set(after))
    assert page.classes["data-op"] == {op for op in set(before) | set(after) if before.get(op) != after.get(op)}
    assert page.values("data-pass") == [p["name"] for p in data["passes"]]
    listed = sorted((a["data-pass"], a["data-site"], a["data-status"]) for a in page.items["data-site"])
    assert listed == sorted((s["pass"], s["site"], s["status"]) for s in data["sites"] if s["status"] != "note")
    assert {s["status"] for s in data["sites"]} >= {"applied", "declined"}
    assert page.values("data-output") == [o["name"] for o in data["verification"]["outputs"]]
    assert "worst" in text and "of tolerance" in text


def test_a_declined_layernorm_says_why_in_json_and_on_the_page(tmp_path):
    data, text = _run(ln_model(axes=(1,)), tmp_path, verify=True)
    declined = [s for s in data["sites"] if s["status"] == "declined" and s["pass"] == "fuse-layernorm"]
    assert declined and all("not the trailing axes" in s["reason"] for s in declined)
    assert declined[0]["rule"].startswith("layernorm") and declined[0]["site"].startswith("node '")
    page = Page(text)
    assert {a["data-site"] for a in page.items["data-site"]} >= {s["site"] for s in declined}
    assert "not the trailing axes" in text


def test_notes_are_attributed_to_the_pass_that_made_them(tmp_path):
    data, text = _run(rms_model(eps=1e-5), tmp_path, verify=True)  # opset < 23: RMSNorm left decomposed
    notes = [s for s in data["sites"] if s["status"] == "note"]
    assert any(s["pass"] == "fuse-rmsnorm" and "RMSNorm found" in s["reason"] for s in notes)
    assert Page(text).values("data-note") == [s["reason"] for s in notes]


def test_cann_page_lists_each_lowering_and_the_check(tmp_path):
    src = tmp_path / "in.onnx"
    onnx.save(rms_model(), src)
    result = CliRunner().invoke(main, ["optimize", str(src), str(tmp_path / "o.onnx"), "--target", "cann", "-q",
                                       "--report", str(tmp_path / "r.html")])
    assert result.exit_code == 0, result.stderr
    page = Page((tmp_path / "r.html").read_text())
    result = CliRunner().invoke(main, ["optimize", str(src), str(tmp_path / "o.onnx"), "--target", "cann", "-q",
                                       "--report", str(tmp_path / "r.json"), "--overwrite"])
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["lowering"] and page.values("data-lowering") == data["lowering"]
    assert data["check"]["model"] == str(tmp_path / "o.onnx")
    assert page.values("data-finding") == data["check"]["findings"]
    assert "k3opt check" in (tmp_path / "r.html").read_text()


def test_verification_failure_still_writes_the_page(register, tmp_path):
    from onnx import TensorProto, helper

    from tests.conftest import ReluToSigmoid
    from tests.helpers import make_model

    register(ReluToSigmoid)
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [("x", TensorProto.FLOAT, [4])],
                       [("y", TensorProto.FLOAT, [4])])
    onnx.save(model, tmp_path / "m.onnx")
    result = CliRunner().invoke(main, ["optimize", str(tmp_path / "m.onnx"), "--passes", "test-relu-to-sigmoid",
                                       "--report", str(tmp_path / "r.html")])
    assert result.exit_code == 1
    page = Page((tmp_path / "r.html").read_text())
    assert page.values("data-output") == ["y"] and "test-relu-to-sigmoid" in (tmp_path / "r.html").read_text()


def test_compile_report_has_the_pre_flight_check(tmp_path, monkeypatch):
    from tests.fake_atc import write_fake_atc

    fake = write_fake_atc(tmp_path / "cann")
    monkeypatch.setenv("FAKE_ATC_UNSUPPORTED", "MatMul")  # ATC runs and fails: the report is still written
    onnx.save(rms_model(), tmp_path / "m.onnx")
    result = CliRunner().invoke(main, ["compile", str(tmp_path / "m.onnx"), "--soc-version", "Ascend910B3", "-q",
                                       "-o", str(tmp_path / "o"), "--atc", str(fake),
                                       "--report", str(tmp_path / "r.json")])
    assert result.exit_code == 1 and "E19010" in result.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["check"] == {"model": str(tmp_path / "o.onnx"), "findings": []} and data["lowering"]
