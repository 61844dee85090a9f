"""The curves Dagster draws on the asset page without "Show Markdown": an SVG chart short enough
for the UI's inline limit (markdown under 1000 characters), whatever the number of points."""

from __future__ import annotations

import urllib.parse
import xml.etree.ElementTree as ET

import pytest

from speech_assets.stats.plots import INLINE_MARKDOWN_LIMIT, inline_chart


@pytest.mark.parametrize("points", [1, 3, 30, 300])
def test_the_inline_chart_fits_the_ui_limit_and_is_an_svg(points: int) -> None:
    series = {
        "held-out": [(step * 10, 0.1 + step / (points + 1) * 0.4) for step in range(1, points + 1)],
        "training": [(step * 10, 0.2 + step / (points + 1) * 0.5) for step in range(1, points + 1)],
        "majority class": [(step * 10, 0.115) for step in range(1, points + 1)],
    }
    text = inline_chart("held-out accuracy by step", series)
    assert len(text) < INLINE_MARKDOWN_LIMIT == 1000
    assert text.startswith("![held-out accuracy by step](data:image/svg+xml,") and text.endswith(")")
    # one markdown image: nothing in the URI ends it early or breaks the markdown
    uri = text[len("![held-out accuracy by step](") : -1]
    assert not set(uri) & set(' ()<>#"')
    svg = ET.fromstring(urllib.parse.unquote(uri.removeprefix("data:image/svg+xml,")))
    lines = svg.findall("{http://www.w3.org/2000/svg}polyline")
    assert len(lines) == 3 and all(len(line.get("points").split(",")) >= 2 for line in lines)
    # the baseline is dashed; the legend gives each series' last value
    assert [line.get("stroke-dasharray") for line in lines] == [None, None, "4"]
    legend = "".join(svg.itertext())
    assert f"held-out {series['held-out'][-1][1]:.3g}" in legend
    assert "majority class 0.115" in legend


def test_nothing_measured_says_so() -> None:
    assert (
        inline_chart("held-out accuracy by round", {"held-out": []})
        == "*held-out accuracy by round: nothing measured yet*"
    )
