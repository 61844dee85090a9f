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


# the tables show the last rounds only (metadata stays small; rounds.parquet has them all)
MAX_ROWS = 40
MAX_NAMES = 12


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(names[:MAX_NAMES])
    return (shown + f" (+{len(names) - MAX_NAMES})" if len(names) > MAX_NAMES else shown) or "-"


def _last(lines: Sequence[Mapping[str, Any]]) -> tuple[list[Mapping[str, Any]], str]:
    skipped = max(len(lines) - MAX_ROWS, 0)
    return list(lines[skipped:]), (f"\n\n(the first {skipped} rounds are in rounds.parquet)" if skipped else "")


def markdown_rounds(lines: Sequence[Mapping[str, Any]]) -> str:
    """One row per round: clients that trained of those sampled, who was missing (sampled and
    silent, dropped or refused), train loss, held-out masked accuracy of the global encoder
    beside the majority-class rate (n/a in rounds without evaluation), the same on leak-free
    masked frames, epsilon so far (DP), MB up/down, seconds and the share of it not spent in the
    slowest client's local training."""
    header = (
        "| round | clients | missing | train loss | held-out masked acc. | majority class | leak-free acc. "
        "| leak-free majority | epsilon | MB up | MB down | s | overhead |\n"
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    shown, note = _last(lines)
    rows = [
        f"| {line['round']} | {line['clients']}/{line.get('sampled', line['clients'])} | {_names(line['missing'])} "
        f"| {_fmt(line['train_loss'], 4)} "
        f"| {_fmt(line['heldout_masked_accuracy'])} | {_fmt(line['majority_accuracy'])} "
        f"| {_fmt(line.get('heldout_leak_free_masked_accuracy'))} | "
        f"{_fmt(line.get('heldout_leak_free_majority_accuracy'))} "
        f"| {_fmt(line.get('epsilon'), 2)} | {line['bytes_up'] / 1e6:.1f} | {line['bytes_down'] / 1e6:.1f} "
        f"| {line['round_seconds']:.0f} | {_fmt(line.get('overhead'), 2)} |"
        for line in shown
    ]
    return "\n".join([header, *rows]) + note
