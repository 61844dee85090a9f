"""Plots are looked up by their inputs before they are drawn: same bytes, drawn once."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from speech_assets.stats import plots


def test_a_plot_of_the_same_inputs_is_drawn_once() -> None:
    plots.forget()
    before = plots.drawn()
    values = np.random.default_rng(0).gamma(4.0, 3.0, 500)
    first = plots.histogram(values, "durations", "seconds")
    assert plots.histogram(list(values), "durations", "seconds") == first and plots.drawn() == before + 1
    assert plots.histogram(values, "durations", "minutes") != first and plots.drawn() == before + 2  # any input counts
    changed = values.copy()
    changed[7] += 1e-9
    plots.histogram(changed, "durations", "seconds")
    assert plots.drawn() == before + 3


def test_a_cache_folder_keeps_the_last_blocks_plots(tmp_path: Path) -> None:
    plots.forget()
    before = plots.drawn()
    folder = tmp_path / ".plots"
    with plots.cached_in(folder):
        bars = plots.bars(["a", "b"], [1.0, 2.0], "hours", "h")
        sizes = plots.cluster_sizes({"client_00": np.array([5, 3, 1])})
    assert plots.drawn() == before + 2 and len(list(folder.glob("*.png"))) == 2

    plots.forget()  # as a new process would
    with plots.cached_in(folder):
        assert plots.bars(["a", "b"], [1.0, 2.0], "hours", "h") == bars
        assert plots.cluster_sizes({"client_00": np.array([5, 3, 2])}) != sizes
    assert plots.drawn() == before + 3
    assert len(list(folder.glob("*.png"))) == 2  # the old cluster sizes are gone
