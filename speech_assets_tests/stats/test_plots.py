"""Plots are looked up by their inputs before they are drawn: same bytes, drawn once."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from speech_assets.stats import plots


def new_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """No plot remembered in this process, as a new process starts."""
    monkeypatch.setattr(plots, "_memory", OrderedDict())


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``[n]``: the plots drawn (not found by their inputs) in the test, by the real drawing, counted."""
    count, draw = [0], plots._draw
    monkeypatch.setattr(plots, "_draw", lambda *args: count.__setitem__(0, count[0] + 1) or draw(*args))
    new_process(monkeypatch)
    return count


def test_a_plot_of_the_same_inputs_is_drawn_once(drawn: list[int]) -> None:
    """Kills: the key without the inputs (a changed value reuses the old PNG), no memory lookup."""
    values = np.random.default_rng(0).gamma(4.0, 3.0, 500)
    first = plots.histogram(values, "durations", "seconds")
    assert plots.histogram(list(values), "durations", "seconds") == first and drawn[0] == 1
    assert plots.histogram(values, "durations", "minutes") != first and drawn[0] == 2  # any input counts
    changed = values.copy()
    changed[7] += 1e-9
    plots.histogram(changed, "durations", "seconds")
    assert drawn[0] == 3


def test_a_cache_folder_keeps_the_last_blocks_plots(
    tmp_path: Path, drawn: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kills: no lookup in the folder (a new process redraws), stale PNGs kept."""
    folder = tmp_path / ".plots"
    with plots.cached_in(folder):
        bars = plots.bars(["a", "b"], [1.0, 2.0], "hours", "h")
        sizes = plots.cluster_sizes({"client_00": np.array([5, 3, 1])})
    assert drawn[0] == 2 and len(list(folder.glob("*.png"))) == 2

    new_process(monkeypatch)
    with plots.cached_in(folder):
        assert plots.bars(["a", "b"], [1.0, 2.0], "hours", "h") == bars
        assert plots.cluster_sizes({"client_00": np.array([5, 3, 2])}) != sizes
    assert drawn[0] == 3
    assert len(list(folder.glob("*.png"))) == 2  # the old cluster sizes are gone


def covered_points(figure) -> list[tuple[str, float, float]]:
    """Every drawn data point that an axes' legend box covers, as (series, x, y)."""
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    found = []
    for axis in figure.axes:
        legend = axis.get_legend()
        if legend is None:
            continue
        box = legend.get_window_extent(renderer)
        for line in axis.get_lines():
            for (x, y), (px, py) in zip(line.get_xydata(), axis.transData.transform(line.get_xydata()), strict=True):
                if box.contains(px, py):
                    found.append((line.get_label(), float(x), float(y)))
    return found


def test_legends_never_cover_a_point_of_the_training_or_round_curve() -> None:
    """The held-out curve's last point (issue 46) and every other point lie outside the legend:
    training curve and federated round curve, on series that fill their axes. Kills: the legend
    placed inside the axes (``axis.legend()``, loc "best": today's)."""
    steps = range(0, 1001, 50)
    rows = [
        {
            "step": s,
            "loss": 6.0 - (s / 1000) * (1 + (s // 50) % 2),
            "masked_accuracy": (s // 50) % 2 * 0.5 + s / 4000,
            "lr": 1e-3,
            **(
                {"val/leak_free_masked_accuracy": 0.1 + s / 1500, "val/leak_free_majority_accuracy": 0.75 - s / 2000}
                if s % 100 == 0
                else {}
            ),
        }
        for s in steps
    ]
    lines = [
        {
            "round": r,
            "train_loss": 3.0 - r / 10,
            "heldout_leak_free_masked_accuracy": r / 10 if r % 2 else 1 - r / 10,
            "heldout_leak_free_majority_accuracy": 1 - r / 10 if r % 2 else r / 10,
        }
        for r in range(1, 11)
    ]
    for drawing in (plots.training_curve_drawing(rows), plots.round_curve_drawing(lines)):
        with plots.figure_of(drawing) as figure:
            assert any(axis.get_legend() for axis in figure.axes)
            assert covered_points(figure) == []
