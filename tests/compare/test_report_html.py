"""report.html is one self-contained page: inline PNG plots, no URL that could reach the
network, and it renders with its plots in headless Chromium."""

from __future__ import annotations

import base64
import io
import re
from html.parser import HTMLParser
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from tests.compare.helpers import (
    chromium,
    count_colour,
    distinct_colours,
    load_png,
    page_requests,
    screenshot,
)

PNG_URI = "data:image/png;base64,"
HISTOGRAM_BLUE = (0x44, 0x77, 0xAA)  # the histogram bars' colour in compare/plots.py
PASS_GREEN = (0x22, 0x88, 0x33)  # the layer plot's passing points (the CSS "pass" green is 8 off)
URL_ATTRS = {"src", "href", "srcset", "action", "poster", "data", "background", "formaction"}

needs_chromium = pytest.mark.skipif(chromium() is None, reason="Chromium is not installed (/usr/bin/chromium); CI installs it")


class Collector(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def parse(html: str) -> list[tuple[str, dict[str, str | None]]]:
    parser = Collector()
    parser.feed(html)
    parser.close()
    return parser.tags


def is_external(url: str) -> bool:
    url = url.strip().lower()
    return url.startswith(("http:", "https:", "//", "ftp:", "ws:", "wss:"))


@pytest.fixture(scope="module")
def report_html(compared_decoder) -> Path:
    folder, _ = compared_decoder
    return folder / "report" / "report.html"


def test_every_image_is_an_inline_png(report_html):
    tags = parse(report_html.read_text())
    images = [attrs for tag, attrs in tags if tag == "img"]
    assert len(images) == 2  # the error histograms and the layer-wise plot
    for attrs in images:
        src = attrs["src"] or ""
        assert src.startswith(PNG_URI), src[:60]
        data = base64.b64decode(src[len(PNG_URI):], validate=True)
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        pixels = matplotlib.image.imread(io.BytesIO(data), format="png")
        assert pixels.shape[0] > 100 and pixels.shape[1] > 200
        assert distinct_colours(np.round(pixels[..., :3] * 255).astype(np.uint8)) > 20


def test_no_reference_can_reach_the_network(report_html):
    html = report_html.read_text()
    tags = parse(html)
    for tag, attrs in tags:
        for name, value in attrs.items():
            if name in URL_ATTRS and value:
                assert not is_external(value), (tag, name, value)
        assert tag not in {"script", "iframe", "object", "embed"}, tag
        if tag == "link":
            assert not is_external(attrs.get("href") or ""), attrs
    # not in CSS (url(...), @import) either, nor anywhere in the text
    assert "@import" not in html
    for url in re.findall(r"url\(\s*['\"]?([^'\")]+)", html):
        assert not is_external(url), url
    assert not re.search(r"(?i)\b(https?|ftp)://", html)


def test_the_url_checks_catch_external_references():
    """The checks above would see an external image, stylesheet or protocol-relative URL."""
    page = '<link rel="stylesheet" href="//cdn.example/x.css"><img src="https://example.com/a.png">'
    externals = [v for _, attrs in parse(page) for k, v in attrs.items() if k in URL_ATTRS and is_external(v or "")]
    assert externals == ["//cdn.example/x.css", "https://example.com/a.png"]


@needs_chromium
def test_report_renders_with_its_plots_and_no_network_requests(report_html, tmp_path):
    png, netlog = tmp_path / "report.png", tmp_path / "net.json"
    screenshot(report_html, png, tmp_path, netlog)
    assert png.stat().st_size > 20_000
    pixels = load_png(png)
    assert pixels.shape[0] >= 1500 and pixels.shape[1] >= 1000  # --window-size=1280,2000
    assert distinct_colours(pixels) > 200  # not blank: text, tables and plots
    assert count_colour(pixels, HISTOGRAM_BLUE) > 1000  # the histogram bars are on screen
    assert count_colour(pixels, PASS_GREEN, tol=4) > 30  # and the layer plot's points
    assert page_requests(netlog) == []

    # control: the same page without its images shows none of the plots' colours
    stripped = tmp_path / "stripped.html"
    stripped.write_text(re.sub(r"<img[^>]*>", "", report_html.read_text()))
    screenshot(stripped, tmp_path / "stripped.png", tmp_path)
    bare = load_png(tmp_path / "stripped.png")
    assert count_colour(bare, HISTOGRAM_BLUE) < 20
    assert count_colour(bare, PASS_GREEN, tol=4) < 5


@needs_chromium
def test_network_log_sees_a_pages_external_request(tmp_path):
    """Control for the no-requests assertion: an external image is logged as a page request."""
    page = tmp_path / "external.html"
    page.write_text('<html><body><img src="http://127.0.0.1:9/x.png"><p>x</p></body></html>')
    screenshot(page, tmp_path / "external.png", tmp_path, tmp_path / "net.json")
    assert page_requests(tmp_path / "net.json") == ["http://127.0.0.1:9/x.png"]
