"""The one held-out masked accuracy: the leak-free one, under one name in every view.

A masked frame next to a visible one can be scored right by copying its neighbour (an MFCC label's
window reaches it: docs/ARCHITECTURE.md, "Leak-free masked accuracy"), so every view reads the
accuracy on *leak-free* frames through this module, against the majority-class rate on the same
frames. The accuracy on all masked frames is kept only to measure the leak, shown as ``all_frames_*``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

LABEL = "held-out masked accuracy"
# result.json, the training_runs table and a federation's round lines
ACCURACY, MAJORITY = "heldout_leak_free_masked_accuracy", "heldout_leak_free_majority_accuracy"
# each held-out evaluation in metrics.jsonl and MLflow
CURVE_ACCURACY, CURVE_MAJORITY = "val/leak_free_masked_accuracy", "val/leak_free_majority_accuracy"
# the leaky figure on all masked frames, as result.json records it, and the name views give it
ALL_FRAMES_RECORDED = ("heldout_masked_accuracy", "heldout_majority_accuracy")
ALL_FRAMES_SHOWN = ("all_frames_masked_accuracy", "all_frames_majority_accuracy")


@dataclass(frozen=True)
class HeldoutAccuracy:
    """The held-out masked accuracy (leak-free frames) and the majority-class rate on the same frames."""

    accuracy: float
    majority: float

    @property
    def beats_majority(self) -> bool:
        return self.accuracy > self.majority

    def __str__(self) -> str:
        return f"{LABEL} {self.accuracy:.3f} (majority class {self.majority:.3f})"


def heldout_accuracy(record: Mapping[str, Any]) -> HeldoutAccuracy | None:
    """The held-out masked accuracy a ``result.json``, ``training_runs`` row or federated round line
    records; None where not measured (never the all-frames figure in its place)."""
    accuracy, majority = record.get(ACCURACY), record.get(MAJORITY)
    if accuracy is None or majority is None:
        return None
    return HeldoutAccuracy(float(accuracy), float(majority))


def curve_points(rows: list[Mapping[str, Any]]) -> list[tuple[float, float, float]]:
    """(step, held-out masked accuracy, majority-class rate) at each evaluation of ``metrics.jsonl`` rows."""
    return [
        (r["step"], float(r[CURVE_ACCURACY]), float(r[CURVE_MAJORITY]))
        for r in rows
        if r.get(CURVE_ACCURACY) is not None and r.get(CURVE_MAJORITY) is not None
    ]


def metadata(record: Mapping[str, Any]) -> dict[str, float | str]:
    """The held-out masked accuracy (leak-free frames) as asset metadata."""
    found = heldout_accuracy(record)
    if found is None:
        return {"heldout_masked_accuracy": "not measured"}
    return {"heldout_masked_accuracy": round(found.accuracy, 4), "heldout_majority_accuracy": round(found.majority, 4)}


def per_client_row(client: str, scores: Mapping[str, Any]) -> dict[str, Any]:
    """One client's held-out scores (``result.json``'s ``heldout_per_client``) under the views' names."""
    return {
        "client": client,
        "masked_accuracy": scores.get("leak_free_masked_accuracy"),
        "majority_accuracy": scores.get("leak_free_majority_accuracy"),
        "leak_free_frames": scores.get("leak_free_frames"),
        "masked_frames": scores.get("masked_frames"),
        "all_frames_masked_accuracy": scores.get("masked_accuracy"),
        "all_frames_majority_accuracy": scores.get("majority_accuracy"),
    }


PER_CLIENT_COLUMNS = {
    "client": "the client whose head predicted",
    "masked_accuracy": f"{LABEL}: on leak-free frames (null without them)",
    "majority_accuracy": "majority-class rate, same frames",
    "leak_free_frames": "masked frames no visible frame gives away",
    "masked_frames": "all held-out masked frames (0: no held-out speaker)",
    "all_frames_masked_accuracy": "on all masked frames, leak included: only to measure the leak",
    "all_frames_majority_accuracy": "majority-class rate on all masked frames",
}
