"""Small PNG plots rendered offline (matplotlib, Agg): for Dagster metadata and the HTML report.

Each function returns PNG bytes of a figure a few hundred pixels wide, well under 100 KB, so it
can be inlined as a ``data:`` URI (:func:`markdown_image`, :func:`html_image`).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

DPI = 80
SIZE = (7.0, 3.0)
MAX_BARS = 40


def _render(draw, size: tuple[float, float] = SIZE) -> bytes:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    figure = plt.figure(figsize=size, dpi=DPI)
    try:
        draw(figure)
        figure.tight_layout()
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=DPI, metadata={"Software": None})
        return buffer.getvalue()
    finally:
        plt.close(figure)


def training_curve(rows: Sequence[Mapping[str, float]]) -> bytes:
    """Loss, masked accuracy and learning rate against step (rows of the trainer's metrics.jsonl)."""
    steps = [r["step"] for r in rows]

    def draw(figure) -> None:
        for index, (key, label) in enumerate((("loss", "loss"), ("masked_accuracy", "masked accuracy"), ("lr", "learning rate"))):
            axis = figure.add_subplot(1, 3, index + 1)
            axis.plot(steps, [r.get(key, np.nan) for r in rows], marker=".", linewidth=1)
            axis.set_title(label, fontsize=9)
            axis.set_xlabel("step", fontsize=8)
            axis.tick_params(labelsize=7)
            axis.grid(alpha=0.3)

    return _render(draw)


def histogram(values: Sequence[float], title: str, xlabel: str, bins: int = 30) -> bytes:
    def draw(figure) -> None:
        axis = figure.add_subplot(1, 1, 1)
        axis.hist(np.asarray(values, dtype=float), bins=bins, color="#4878a8")
        axis.set_title(title, fontsize=9)
        axis.set_xlabel(xlabel, fontsize=8)
        axis.set_ylabel("count", fontsize=8)
        axis.tick_params(labelsize=7)

    return _render(draw)


def bars(labels: Sequence[str], values: Sequence[float], title: str, ylabel: str) -> bytes:
    """A bar per label (at most ``MAX_BARS``, the largest, when there are more)."""
    order = np.argsort(np.asarray(values, dtype=float))[::-1][:MAX_BARS]
    shown = [str(labels[i]) for i in order]
    heights = [float(values[i]) for i in order]
    suffix = f" (top {len(shown)} of {len(labels)})" if len(labels) > len(shown) else ""

    def draw(figure) -> None:
        axis = figure.add_subplot(1, 1, 1)
        axis.bar(range(len(shown)), heights, color="#6a9f58")
        axis.set_xticks(range(len(shown)), shown, rotation=90, fontsize=6)
        axis.set_title(title + suffix, fontsize=9)
        axis.set_ylabel(ylabel, fontsize=8)
        axis.tick_params(axis="y", labelsize=7)

    return _render(draw)


def cluster_sizes(counts_by_client: Mapping[str, np.ndarray]) -> bytes:
    """Each client's cluster sizes as a share of its frames, largest first (rank on the x axis)."""

    def draw(figure) -> None:
        axis = figure.add_subplot(1, 1, 1)
        for client, counts in sorted(counts_by_client.items()):
            counts = np.sort(np.asarray(counts, dtype=float))[::-1]
            axis.plot(np.arange(1, len(counts) + 1), counts / max(counts.sum(), 1.0), label=client, linewidth=1)
        axis.set_title("cluster sizes (share of frames, by rank)", fontsize=9)
        axis.set_xlabel("cluster rank", fontsize=8)
        axis.set_yscale("log")
        axis.tick_params(labelsize=7)
        if len(counts_by_client) <= 12:
            axis.legend(fontsize=6)

    return _render(draw)


def curves(x: Sequence[float], series: Mapping[str, Sequence[float]], title: str, xlabel: str) -> bytes:
    """Several named lines against one x axis (e.g. federated rounds)."""

    def draw(figure) -> None:
        axis = figure.add_subplot(1, 1, 1)
        for name, values in series.items():
            axis.plot(list(x), list(values), marker=".", label=name, linewidth=1)
        axis.set_title(title, fontsize=9)
        axis.set_xlabel(xlabel, fontsize=8)
        axis.tick_params(labelsize=7)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=6)

    return _render(draw)


def round_curve(lines: Sequence[Mapping[str, Any]]) -> bytes:
    """A federated run's train loss, and held-out masked accuracy against the majority-class
    rate (on all masked frames and on the leak-free ones), per round (lines of :func:`speech_assets.federated.history.summarize_rounds`)."""
    rounds = [line["round"] for line in lines]
    nan = float("nan")

    def draw(figure) -> None:
        loss = figure.add_subplot(1, 2, 1)
        loss.plot(rounds, [line["train_loss"] for line in lines], marker="o", linewidth=1)
        loss.set_title("local train loss (mean over clients)", fontsize=9)
        accuracy = figure.add_subplot(1, 2, 2)
        accuracy.plot(rounds, [line["heldout_masked_accuracy"] or nan for line in lines], marker="o", linewidth=1,
                      label="global encoder + own head")  # fmt: skip
        accuracy.plot(rounds, [line["majority_accuracy"] or nan for line in lines], linestyle="--", linewidth=1,
                      label="majority class")  # fmt: skip
        leak_free = accuracy.plot(rounds, [line.get("heldout_leak_free_masked_accuracy") or nan for line in lines],
                                  marker="s", linewidth=1, label="leak-free frames")[0]  # fmt: skip
        accuracy.plot(rounds, [line.get("heldout_leak_free_majority_accuracy") or nan for line in lines], linestyle=":",
                      linewidth=1, color=leak_free.get_color(), label="leak-free majority class")  # fmt: skip
        accuracy.set_title("held-out masked accuracy", fontsize=9)
        accuracy.legend(fontsize=7)
        for axis in (loss, accuracy):
            axis.set_xlabel("round", fontsize=8)
            axis.tick_params(labelsize=7)
            axis.grid(alpha=0.3)
            axis.set_xticks(rounds)

    return _render(draw, size=(7.5, 2.8))


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def markdown_image(png: bytes, alt: str) -> str:
    return f"![{alt}]({data_uri(png)})"


def html_image(png: bytes, alt: str) -> str:
    return f'<img alt="{alt}" src="{data_uri(png)}">'
