"""The round table of a federated run, for people (its PNG curve: stats/plots.round_curve).

Inputs are the per-round lines of :func:`speech_assets.federated.rounds.summarize_rounds` (no
torch needed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_rounds(lines: Sequence[Mapping[str, Any]]) -> str:
    """One row per round: clients that trained, who was missing, train loss, held-out masked
    accuracy of the global encoder beside the majority-class rate, the same on leak-free masked
    frames, MB up/down, seconds."""
    header = (
        "| round | clients | missing | train loss | held-out masked acc. | majority class | leak-free acc. "
        "| leak-free majority | MB up | MB down | s |\n"
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    rows = [
        f"| {line['round']} | {line['clients']} | {', '.join(line['missing']) or '-'} | {_fmt(line['train_loss'], 4)} "
        f"| {_fmt(line['heldout_masked_accuracy'])} | {_fmt(line['majority_accuracy'])} "
        f"| {_fmt(line.get('heldout_leak_free_masked_accuracy'))} | {_fmt(line.get('heldout_leak_free_majority_accuracy'))} "
        f"| {line['bytes_up'] / 1e6:.1f} | {line['bytes_down'] / 1e6:.1f} | {line['round_seconds']:.0f} |"
        for line in lines
    ]
    return "\n".join([header, *rows])
