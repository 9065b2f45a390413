"""`moedeploy all --out DIR`: every block and the decoder exported, compared and indexed."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

import pytest

from moedeploy.export import BLOCKS
from tests.compare.helpers import (
    chromium,
    distinct_colours,
    load_png,
    page_requests,
    run_cli,
    screenshot,
)

pytestmark = pytest.mark.slow
TARGETS = [*BLOCKS, "decoder"]


class Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self.hrefs.append(dict(attrs)["href"] or "")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, object]:
    out = tmp_path_factory.mktemp("all") / "out"
    return out, run_cli("all", "--out", out, timeout=900)


def test_exits_zero(run):
    _, result = run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert f"{len(TARGETS)}/{len(TARGETS)} match eager PyTorch" in result.stdout


def test_index_links_every_report(run):
    out, _ = run
    parser = Links()
    parser.feed((out / "index.html").read_text())
    assert sorted(parser.hrefs) == sorted(f"{t}/report/report.html" for t in TARGETS)
    for href in parser.hrefs:
        assert not href.startswith(("/", "http:", "https:")), href  # relative: the folder can move
        report = out / href
        assert report.is_file(), href
        assert "PASS" in report.read_text()
        verdict = json.loads((report.parent / "report.json").read_text())
        assert verdict["passed"] is True, href
        assert verdict["first_divergent_layer"] is None
        assert all(c["layerwise"] is not None for c in verdict["comparisons"])  # `all` localises


def test_summary_says_passed_for_each(run):
    out, _ = run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] is True
    rows = {r["name"]: r for r in summary["results"]}
    assert sorted(rows) == sorted(TARGETS)
    for name, row in rows.items():
        assert row["passed"] is True, (name, row.get("error"))
        assert "error" not in row
        assert (out / row["artifact"] / "manifest.json").is_file()
        report = json.loads((out / row["artifact"] / "report" / "report.json").read_text())
        first_output, stats = next(iter(report["comparisons"][0]["outputs"].items()))
        assert row["output"] == first_output and row["max_abs"] == stats["max_abs"]
    assert rows["decoder"]["kind"] == "decoder"
    assert "moe::MoE" in rows["moe"]["custom_ops"] and "moe::RMSNorm" in rows["rmsnorm"]["custom_ops"]


@pytest.mark.skipif(chromium() is None, reason="Chromium is not installed (/usr/bin/chromium); CI installs it")
def test_index_renders(run, tmp_path):
    out, _ = run
    png, netlog = tmp_path / "index.png", tmp_path / "net.json"
    screenshot(out / "index.html", png, tmp_path, netlog)
    pixels = load_png(png)
    assert distinct_colours(pixels) > 100
    assert (pixels < 128).any(axis=-1).sum() > 5000  # text on the page
    assert page_requests(netlog) == []
