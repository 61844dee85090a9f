"""The round curve of a federated run, for people: a markdown table and a small PNG.

Inputs are the per-round lines of :func:`speech_assets.federated.rounds.summarize_rounds` (no
torch needed). The PNG is rendered offline (matplotlib, Agg), a few tens of KB, inlined in
Dagster metadata as a ``data:`` URI.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence
from typing import Any

DPI = 80
SIZE = (7.5, 2.8)


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_rounds(lines: Sequence[Mapping[str, Any]]) -> str:
    """One row per round: clients that trained, who was missing, train loss, held-out masked
    accuracy of the global encoder beside the majority-class rate, MB up/down, seconds."""
    header = (
        "| round | clients | missing | train loss | held-out masked acc. | majority class | MB up | MB down | s |\n"
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    rows = [
        f"| {line['round']} | {line['clients']} | {', '.join(line['missing']) or '-'} | {_fmt(line['train_loss'], 4)} "
        f"| {_fmt(line['heldout_masked_accuracy'])} | {_fmt(line['majority_accuracy'])} "
        f"| {line['bytes_up'] / 1e6:.1f} | {line['bytes_down'] / 1e6:.1f} | {line['round_seconds']:.0f} |"
        for line in lines
    ]
    return "\n".join([header, *rows])


def round_curve_png(lines: Sequence[Mapping[str, Any]]) -> bytes:
    """Train loss, and held-out masked accuracy against the majority-class rate, per round."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    rounds = [line["round"] for line in lines]
    nan = float("nan")
    figure = plt.figure(figsize=SIZE, dpi=DPI)
    try:
        loss = figure.add_subplot(1, 2, 1)
        loss.plot(rounds, [line["train_loss"] for line in lines], marker="o", linewidth=1)
        loss.set_title("local train loss (mean over clients)", fontsize=9)
        accuracy = figure.add_subplot(1, 2, 2)
        accuracy.plot(rounds, [line["heldout_masked_accuracy"] or nan for line in lines], marker="o", linewidth=1,
                      label="global encoder + own head")  # fmt: skip
        accuracy.plot(rounds, [line["majority_accuracy"] or nan for line in lines], linestyle="--", linewidth=1,
                      label="majority class")  # fmt: skip
        accuracy.set_title("held-out masked accuracy", fontsize=9)
        accuracy.legend(fontsize=7)
        for axis in (loss, accuracy):
            axis.set_xlabel("round", fontsize=8)
            axis.tick_params(labelsize=7)
            axis.grid(alpha=0.3)
            axis.set_xticks(rounds)
        figure.tight_layout()
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=DPI, metadata={"Software": None})
        return buffer.getvalue()
    finally:
        plt.close(figure)


def markdown_image(png: bytes, alt: str) -> str:
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode('ascii')})"
