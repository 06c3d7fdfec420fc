"""``--report F.html``: the report as one self-contained HTML page.

No script, no font, no request leaves the page: the CSS is inline and the bar
charts are plain ``<div>`` bars sized in percent. Every listed item carries a
``data-*`` attribute naming it (``data-op``, ``data-pass``, ``data-site``,
``data-output``, ``data-lowering``, ``data-finding``), which is what the
tests parse to check that the page lists what the JSON report lists.
"""
from __future__ import annotations

import html
import math
from itertools import groupby
from pathlib import Path
from typing import Any, Iterable, Sequence

from .report import Report, size_text, write_report_text
from .pipeline.verify import summary_line
from .targets import get_target

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;background:#f4f5f7;color:#1d2330}
main{max-width:1100px;margin:0 auto;padding:20px 24px 40px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #d5d9e0;padding-bottom:4px}
h3{font-size:14px;margin:14px 0 6px}
.meta{color:#555f70;margin:0 0 10px}.meta code{background:#e7eaf0;padding:1px 5px;border-radius:3px}
table{border-collapse:collapse;background:#fff;box-shadow:0 1px 2px rgba(0,0,0,.08);margin:4px 0 8px}
th,td{padding:4px 10px;text-align:left;border-bottom:1px solid #eceef2;vertical-align:top}
th{background:#eef0f4;font-weight:600}td:first-child{white-space:nowrap}td.n,th.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
tr.changed td{background:#fff6d6}tr.changed td:first-child{border-left:3px solid #e0a800;font-weight:600}
.cols{display:grid;grid-template-columns:auto 1fr;gap:28px;align-items:start}
@media (max-width:960px){.cols{grid-template-columns:1fr}}
.bar{background:#e7eaf0;width:220px;height:12px;border-radius:2px;display:inline-block;vertical-align:middle}
.bar span{display:block;height:12px;border-radius:2px;background:#3b6fd4}
.bar.time span{background:#8a63c9}.bar.tol span{background:#17803d}.bar.tol.over span{background:#b3261e}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;font-weight:600;font-size:12px;color:#fff}
.passed,.applied,.clean{background:#17803d}.failed,.problems{background:#b3261e}
.skipped,.declined,.warning{background:#9a6700}.note{background:#555f70}
ul{margin:4px 0 8px;padding-left:22px}li{margin:1px 0}
details{margin:2px 0 6px}summary{cursor:pointer}
.reason{color:#3a4252}.site{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12.5px}
.empty{color:#777}
"""


def write_report(report: Report, path: str | Path) -> None:
    """``--report F``: an HTML page for ``.html``/``.htm``, JSON otherwise (OutputError when it cannot be written)."""
    if Path(path).suffix.lower() in (".html", ".htm"):
        write_report_text(path, render(report))
    else:
        report.write_json(path)


def render(report: Report) -> str:
    """The whole page for ``report`` (a str of HTML5)."""
    columns = f'<div class="cols"><section>{_ops(report)}</section><section>{_passes(report)}</section></div>'
    parts = [_header(report), _verification(report), columns, _sites(report)]
    target = get_target(report.target)
    if target.lowers or report.lowering or report.check:
        parts.append(_lowering(report, target.name.upper()))
    parts.append(_notes(report))
    title = f"k3opt report: {report.input or 'model'}"
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e(title)}</title><style>{_CSS}</style></head>\n<body><main>\n"
            + "\n".join(p for p in parts if p) + "\n</main></body></html>\n")


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _badge(status: str) -> str:
    return f'<span class="badge {_e(status)}">{_e(status)}</span>'


def _bar(value: float, scale: float, kind: str = "", title: str = "", px: int = 220) -> str:
    width = 100.0 if not math.isfinite(value) else 0.0 if scale <= 0 else min(100.0, 100.0 * value / scale)
    return (f'<span class="bar {kind}" title="{_e(title)}" style="width:{px}px">'
            f'<span style="width:{width:.1f}%"></span></span>')


def _seconds(t: float) -> str:
    return f"{t * 1000:.1f} ms" if t < 1 else f"{t:.2f} s"


def _table(head: Sequence[str], rows: Iterable[str]) -> str:
    cells = "".join(f"<th>{_e(h)}</th>" for h in head)
    return f"<table><thead><tr>{cells}</tr></thead><tbody>\n" + "\n".join(rows) + "\n</tbody></table>"


def _header(r: Report) -> str:
    total = sum(r.timings.values())
    facts = [f"input <code>{_e(r.input or '(in memory)')}</code>"]
    if r.output:
        facts.append(f"output <code>{_e(r.output)}</code>")
    facts += [f"target <code>{_e(r.target)}</code>", f"{r.rounds} round(s)", f"{total:.2f} s"]
    lines = ["<h1>k3opt report</h1>", f'<p class="meta">{" · ".join(facts)}</p>']
    if r.before and r.after:
        lines.append(f'<p class="meta">nodes {r.before.nodes} → {r.after.nodes} · size '
                     f'{_e(size_text(r.before.size_bytes))} → {_e(size_text(r.after.size_bytes))} · opset '
                     f'{r.before.opset} → {r.after.opset}'
                     + (f" · verification {_badge(r.verification['status'])}" if r.verification else "") + "</p>")
    return "\n".join(lines)


def _ops(r: Report) -> str:
    if not (r.before and r.after):
        return ""
    b, a = r.before.ops, r.after.ops
    rows = []
    for op in sorted(set(b) | set(a)):
        before, after = b.get(op, 0), a.get(op, 0)
        delta = after - before
        cls = ' class="changed"' if delta else ""
        sign = f"{delta:+d}" if delta else ""
        rows.append(f'<tr{cls} data-op="{_e(op)}"><td>{_e(op)}</td><td class="n">{before}</td>'
                    f'<td class="n">{after}</td><td class="n">{sign}</td></tr>')
    rows.append(f'<tr><th>all nodes</th><th class="n">{r.before.nodes}</th><th class="n">{r.after.nodes}</th>'
                f'<th class="n">{r.after.nodes - r.before.nodes:+d}</th></tr>')
    return ("<h2>Op types before and after</h2><p class=\"meta\">Highlighted: the op types whose count changed.</p>"
            + _table(["op type", "before", "after", "change"], rows))


def _passes(r: Report) -> str:
    if not r.passes:
        return ""
    most = max((p["rewrites"] for p in r.passes), default=0)
    slowest = max((p["time_s"] for p in r.passes), default=0.0)
    rows = []
    for p in r.passes:
        label = _e(p["name"]) + (f" <small>[{_e(p['plugin'])}]</small>" if p.get("plugin") else "")
        counters = "".join(f"<br><small>{_e(k)}: {v}</small>" for k, v in sorted(p.get("counters", {}).items()))
        if p["skipped"]:
            cells = f'<td colspan="4">{_badge("skipped")} <span class="reason">{_e(p["skipped"])}</span></td>'
        else:
            cells = (f'<td class="n">{p["rewrites"]}</td><td>{_bar(p["rewrites"], most, "", "rewrites", 120)}</td>'
                     f'<td class="n">{_seconds(p["time_s"])}</td><td>{_bar(p["time_s"], slowest, "time", "time", 120)}</td>')
        rows.append(f'<tr data-pass="{_e(p["name"])}"><td>{label}{counters}</td>{cells}</tr>')
    phases = ""
    if r.timings:
        longest = max(r.timings.values())
        phases = "<h3>Phases</h3>" + _table(["phase", "time", ""], (
            f'<tr data-phase="{_e(k)}"><td>{_e(k)}</td><td class="n">{_seconds(v)}</td>'
            f'<td>{_bar(v, longest, "time")}</td></tr>' for k, v in r.timings.items()))
    return ("<h2>Passes</h2>" + _table(["pass", "rewrites", "", "time", ""], rows) + phases)


def _sites(r: Report) -> str:
    """Applied fusions and declined candidates, grouped by pass, rule and reason, each site listed."""
    records = [s for s in r.sites if s["status"] in ("applied", "declined")]
    out = ["<h2>Fusion sites</h2>"]
    if not records:
        out.append('<p class="empty">No fusion candidate was found.</p>')
    applied = [s for s in records if s["status"] == "applied"]
    declined = [s for s in records if s["status"] == "declined"]
    out.append(f'<p class="meta">{len(applied)} applied, {len(declined)} declined '
               "(a candidate is a full structural match of a rule's pattern; the reason is the check's).</p>")
    for status, group in (("applied", applied), ("declined", declined)):
        key = (lambda s: (s["pass"], s["rule"], s["reason"]))
        for (pass_name, rule, reason), items in groupby(sorted(group, key=key), key=key):
            items = list(items)
            what = f"{_e(pass_name)}" + (f" · rule <code>{_e(rule)}</code>" if rule else "")
            why = f' <span class="reason">{_e(reason)}</span>' if reason else ""
            sites = "".join(f'<li class="site" data-site="{_e(s["site"])}" data-status="{status}" '
                            f'data-pass="{_e(pass_name)}">{_e(s["site"])}</li>' for s in items)
            out.append(f"<details{' open' if status == 'declined' and len(items) <= 12 else ''}><summary>"
                       f"{_badge(status)} {what}: {len(items)} site(s){why}</summary><ul>{sites}</ul></details>")
    notes = [s for s in r.sites if s["status"] == "note"]
    if notes:
        out.append("<h3>What the passes said</h3><ul>" + "".join(
            f'<li data-note="{_e(s["reason"])}">{_badge("note")} <b>{_e(s["pass"])}</b>: {_e(s["reason"])}</li>'
            for s in notes) + "</ul>")
    return "\n".join(out)


def _verification(r: Report) -> str:
    v = r.verification
    if not v:
        return "<h2>Verification</h2><p class=\"empty\">Not run (--no-verify).</p>"
    lines = ["<h2>Verification</h2>", f"<p>{_badge(v['status'])} {_e(_without_status(summary_line(v), v))}</p>"]
    if v.get("first_diverging_pass"):
        lines.append(f"<p>First diverging pass: <b>{_e(v['first_diverging_pass'])}</b></p>")
    if v["outputs"]:
        lines.append('<p class="meta">An element passes when |optimized − original| ≤ atol + rtol·|original|; '
                     "the bar is the worst element's error as a fraction of what it was allowed (full = 1).</p>")
        rows = []
        for o in v["outputs"]:
            fraction = o["tol_fraction"]
            kind = "tol" if fraction <= 1 else "tol over"
            rows.append(f'<tr data-output="{_e(o["name"])}"><td>{_e(o["name"])}</td><td>{_e(o["dtype"])}</td>'
                        f'<td>{_badge("passed" if o["passed"] else "failed")}</td>'
                        f'<td class="n">{fraction:.2g}</td><td>{_bar(fraction, 1.0, kind, "of tolerance")}</td>'
                        f'<td class="n">{o["max_abs"]:.3g}</td><td class="n">{o["rtol"]:g}</td>'
                        f'<td class="n">{o["atol"]:g}</td></tr>')
        lines.append(_table(["output", "dtype", "", "worst / tolerance", "", "max abs err", "rtol", "atol"], rows))
    return "\n".join(lines)


def _without_status(line: str, v: dict[str, Any]) -> str:
    """The summary line without its leading status word (the badge says it)."""
    return line[len(v["status"]):].strip(" ()") if line.startswith(v["status"]) else line


def _lowering(r: Report, title: str) -> str:
    """The target's lowering and the check of the written file (``k3opt check``'s findings)."""
    lines = [f"<h2>{_e(title)} lowering</h2>"]
    if r.lowering:
        lines.append("<ul>" + "".join(f'<li data-lowering="{_e(x)}">{_e(x)}</li>' for x in r.lowering) + "</ul>")
    else:
        lines.append('<p class="empty">Nothing was lowered.</p>')
    if r.check is not None:
        findings = r.check["findings"]
        status = "problems" if findings else "clean"
        lines.append(f"<h3>k3opt check</h3><p>{_badge(status)} "
                     + (f"{len(findings)} problem(s): ATC will refuse the model" if findings
                        else "ATC can parse every node (opset, inputs and dtypes OK)") + "</p>")
        if findings:
            lines.append("<ul>" + "".join(f'<li data-finding="{_e(f)}">{_e(f)}</li>' for f in findings) + "</ul>")
    return "\n".join(lines)


def _notes(r: Report) -> str:
    if not (r.notes or r.warnings or r.files):
        return ""
    lines = ["<h2>Notes</h2>"]
    lines += [f"<p>{_badge('warning')} {_e(w)}</p>" for w in r.warnings]
    if r.notes:
        lines.append("<ul>" + "".join(f"<li>{_e(n)}</li>" for n in r.notes) + "</ul>")
    if r.files:
        lines.append("<p>Files written: " + ", ".join(f"<code>{_e(f)}</code>" for f in r.files) + "</p>")
    return "\n".join(lines)
