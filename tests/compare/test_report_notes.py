"""A comparison whose outputs pass while layer-wise names a module says what that means, the
same way in report.md, report.html, `moedeploy compare` and `moedeploy all`.

The reports here are built by hand (the tiny fp16 decoder's measured case: outputs within
5e-2, the final `norm` 1.95e-1 off on the one token that took another expert in
`layers.1.ffn`), so the rendering is tested without depending on one CPU's fp16 rounding.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from typer.testing import CliRunner

from moedeploy.cli import _print_report, app
from moedeploy.compare import suite
from moedeploy.compare.metrics import error_stats
from moedeploy.compare.report import render_html, render_markdown
from moedeploy.export import ExportError

ATOL = RTOL = 5e-2


def _module(name: str, error: float, **extra) -> dict:
    eager = np.linspace(-1.0, 1.0, 64)
    return {"module": name, "layer": name.rsplit(".", 1)[0] if name.count(".") > 1 else name,
            **error_stats(eager, eager + error, ATOL, RTOL), **extra}


def make_report(passed: bool, module: str = "norm", layer: str = "norm", flips: int | None = 1,
                moes: list[str] | None = None) -> dict:
    eager = np.linspace(-3.0, 3.0, 256)
    output_error = 4.7e-2 if passed else 1.5
    modules = [
        _module("layers.1.ffn", 5.3e-3, routing_flips=1, routed_tokens=128, router_logits_passed=True, flipped_tokens=[59]),
        _module(module, 1.95e-1),
        _module("lm_head", output_error),
    ]
    outputs = {"logits": error_stats(eager, eager + output_error, ATOL, RTOL)}
    return {
        "artifact": {"name": "decoder", "kind": "decoder", "dtype": "fp16", "opset": 23},
        "reference": "torch-eager", "reference_checkpoint": None, "backends": ["ort"], "iterations": 3, "seed": 0,
        "passed": passed,
        "comparisons": [{"reference": "torch-eager", "backend": "onnxrt", "passed": passed, "outputs": outputs,
                         "layerwise": {"modules": modules}}],
        "first_divergent_layer": layer, "first_divergent_module": module,
        "first_divergent_routing_flips": flips, "first_divergent_routing_modules": moes or ["layers.1.ffn"],
        "polygraphy": {"run_results": "run_results.json", "accuracy": "accuracy.json"},
        "versions": {"moedeploy": "test"}, "created": "now",
    }


def _words(text: str) -> str:
    return re.sub(r"\s+", " ", text)


class Paragraphs(HTMLParser):
    """Text of each <p>, with its class."""

    def __init__(self) -> None:
        super().__init__()
        self.paragraphs: list[tuple[str, str]] = []
        self._current: list[str] | None = None
        self._class = ""

    def handle_starttag(self, tag, attrs):
        if tag == "p":
            self._current, self._class = [], dict(attrs).get("class") or ""

    def handle_endtag(self, tag):
        if tag == "p" and self._current is not None:
            self.paragraphs.append((self._class, _words("".join(self._current)).strip()))
            self._current = None

    def handle_data(self, data):
        if self._current is not None:
            self._current.append(data)


def paragraphs(html: str) -> list[tuple[str, str]]:
    parser = Paragraphs()
    parser.feed(html)
    return parser.paragraphs


def test_markdown_explains_a_pass_with_a_divergent_module():
    markdown = render_markdown(make_report(passed=True))
    assert markdown.splitlines()[0].endswith("PASS")
    assert "First divergent layer" not in markdown
    assert ("Outputs within tolerance. Inside the network, `norm` is the first module out of its own tolerance "
            "on the first input (max abs 1.95e-01 with atol 5e-02, rtol 5e-02)") in markdown
    assert "The 1 token(s) out of tolerance in `norm` took a different top-k expert set upstream, in `layers.1.ffn`" in markdown


def test_markdown_still_names_the_first_divergent_layer_of_a_failure():
    markdown = render_markdown(make_report(passed=False, module="layers.0.ffn", layer="layers.0"))
    assert "First divergent layer: `layers.0` (module `layers.0.ffn`)" in markdown
    assert "Outputs within tolerance" not in markdown


def test_html_shows_the_note_not_a_red_layer_under_a_pass_badge():
    html = render_html(make_report(passed=True), {})
    found = paragraphs(html)
    notes = [text for cls, text in found if cls == "note"]
    assert len(notes) == 1 and notes[0].startswith("Outputs within tolerance. Inside the network, norm is the first")
    assert not [text for cls, text in found if cls == "fail"]
    assert "<code>norm</code>" in html and "<code>layers.1.ffn</code>" in html
    assert any("took a different top-k expert set upstream, in layers.1.ffn" in text for _, text in found)


def test_html_of_a_failure_is_red():
    html = render_html(make_report(passed=False, module="layers.0.ffn", layer="layers.0"), {})
    fails = [text for cls, text in paragraphs(html) if cls == "fail"]
    assert fails == ["First divergent layer: layers.0 (module layers.0.ffn)"]


def test_compare_cli_prints_the_note_for_a_pass(capsys):
    _print_report(make_report(passed=True))
    printed = _words(capsys.readouterr().out)
    assert "note: Outputs within tolerance. Inside the network, norm is the first module out of its own tolerance" in printed
    assert "first divergent layer" not in printed
    assert "upstream, in layers.1.ffn" in printed


def test_compare_cli_names_the_layer_of_a_failure(capsys):
    _print_report(make_report(passed=False, module="layers.0.ffn", layer="layers.0", moes=["layers.0.ffn"]))
    printed = _words(capsys.readouterr().out)
    assert "first divergent layer: layers.0 (module layers.0.ffn)" in printed
    assert "note:" not in printed
    assert "took a different top-k expert set there" in printed


@pytest.fixture
def fake_all(monkeypatch):
    """run_all over two targets without exporting: rmsnorm passes with an inner divergence,
    decoder's export fails."""

    def export(target, out, **_):
        if target == "decoder":
            raise ExportError("could not trace the decoder")
        Path(out).mkdir(parents=True)
        return SimpleNamespace(kind="block", manifest={"custom_ops": []})

    monkeypatch.setattr(suite, "export", export)
    monkeypatch.setattr(suite, "compare", lambda *a, **k: make_report(passed=True))


def test_all_notes_the_pass_and_links_only_written_reports(fake_all, tmp_path):
    summary = suite.run_all(tmp_path / "out", ["ort"], targets=["rmsnorm", "decoder"])
    rows = {r["name"]: r for r in summary["results"]}
    assert rows["rmsnorm"]["note"].startswith("Outputs within tolerance. Inside the network, norm is the first")
    assert rows["rmsnorm"]["report"] == "rmsnorm/report/report.html"
    assert rows["decoder"]["report"] is None and rows["decoder"]["passed"] is False
    index = (tmp_path / "out" / "index.html").read_text()
    assert 'href="rmsnorm/report/report.html"' in index
    assert "decoder/report" not in index  # never written: not linked
    assert "Outputs within tolerance" in index


def test_all_cli_prints_the_note(fake_all, tmp_path):
    result = CliRunner().invoke(app, ["all", "--out", str(tmp_path / "out"), "--backend", "ort"])
    printed = _words(result.output)
    assert result.exit_code == 1  # the decoder's export failed
    assert "note: rmsnorm: Outputs within tolerance. Inside the network, norm is the first" in printed
    report = tmp_path / "out" / "rmsnorm" / "report" / "report.html"
    assert f"See{report}." in re.sub(r"\s+", "", result.output)  # a long path may wrap
