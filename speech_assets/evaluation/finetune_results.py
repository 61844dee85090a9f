"""What ``finetune/results.parquet`` says: its schema, a table per labelled budget and decoder,
and one line per encoder on whether fine-tuning it beat the same architecture from scratch.

Light (pyarrow, no torch): ``finetuned_asr``'s metadata and ``speech-assets finetune`` read it.
Rows are grouped into :class:`~speech_assets.evaluation.compare.ProbeResult` per budget and
decoder so that the probe's summary over seeds and its "too small to tell" rule
(:func:`too_small_to_tell`) judge fine-tuning.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from speech_assets.evaluation.compare import MIN_HELDOUT_UTTERANCES, ModelSummary, ProbeResult, summarise

# what the exported recogniser may differ from the PyTorch model by (fp32), as the encoder export
RECOGNISER_PARITY_ATOL = 1e-4

SCRATCH = "scratch"
GREEDY = "greedy"
# the contract's columns first, then what the tables and the lineage read
SCHEMA = pa.schema(
    [
        ("model", pa.string()),
        ("labelled_minutes", pa.float64()),
        ("seed", pa.int64()),
        ("decoder", pa.string()),
        ("split", pa.string()),
        ("cer", pa.float64()),
        ("wer", pa.float64()),
        ("utterances", pa.int64()),
        ("steps", pa.int64()),
        ("labelled_seconds", pa.float64()),
        ("checkpoint_sha256", pa.string()),
    ]
)


# a fine-tuned model and its scratch baseline are told apart over seeds: at least this many each,
# and a gap of more than SPREAD_FACTOR combined standard deviations
MIN_SEEDS = 2
SPREAD_FACTOR = 2.0


def ratio(cer: float, baseline: float) -> str:
    """``cer`` relative to ``baseline``'s, as ``0.85x``."""
    return f"{cer / baseline:.2f}x" if baseline > 0 else "n/a x"


def too_small_to_tell(a: ModelSummary, b: ModelSummary) -> str | None:
    """Why the held-out CERs of ``a`` and ``b`` cannot be told apart, or ``None`` when they can."""
    utterances = min(a.utterances, b.utterances)
    if utterances < MIN_HELDOUT_UTTERANCES:
        return f"{utterances} held-out utterances < {MIN_HELDOUT_UTTERANCES}"
    for s in (a, b):
        if s.cer.n < MIN_SEEDS:
            return f"{s.model} has {s.cer.n} seed, no spread to compare with"
    diff, spread = abs(a.cer.mean - b.cer.mean), SPREAD_FACTOR * math.hypot(a.cer.std, b.cer.std)
    if not diff > spread:
        return f"|difference| {diff:.3f} <= {SPREAD_FACTOR:g} x combined std {spread / SPREAD_FACTOR:.3f}"
    return None


def results_table(rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist([dict(r) for r in rows], schema=SCHEMA)


def read_rows(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    missing = [name for name in SCHEMA.names if name not in table.column_names]
    if missing:
        raise ValueError(f"fine-tuning results lack the columns {missing}: rematerialize finetuned_asr")
    return table.to_pylist()


def as_probe_results(rows: Sequence[Mapping[str, Any]], decoder: str, minutes: float) -> list[ProbeResult]:
    """The rows of one budget and decoder, as the probe's summaries read them."""
    return [
        ProbeResult(
            r["model"],
            r["checkpoint_sha256"],
            "ctc",
            [],
            r["split"],
            r["cer"],
            r["wer"],
            r["utterances"],
            r["steps"],
            r["seed"],
            "",
            0,
        )
        for r in rows
        if r["decoder"] == decoder and r["labelled_minutes"] == minutes
    ]


def budgets(rows: Sequence[Mapping[str, Any]]) -> list[float]:
    return sorted({float(r["labelled_minutes"]) for r in rows})


def verdicts(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per fine-tuned encoder: at each budget, its held-out greedy CER against scratch's
    (mean ± std over seeds, and their ratio) and whether it beat scratch, lost, or the corpus is
    too small to tell (too few held-out utterances or seeds, or a difference within the spread)."""
    encoders = [m for m in dict.fromkeys(r["model"] for r in rows) if m != SCRATCH]
    lines = []
    for encoder in encoders:
        parts = []
        for minutes in budgets(rows):
            held = summarise(as_probe_results(rows, GREEDY, minutes))
            if encoder not in held or SCRATCH not in held:
                continue
            a, b = held[encoder], held[SCRATCH]
            reason = too_small_to_tell(a, b)
            said = (
                f"too small to tell ({reason})"
                if reason
                else ("beats scratch" if a.cer.mean < b.cer.mean else "loses to scratch")
            )
            parts.append(f"{minutes:g} min: CER {a.cer} vs scratch {b.cer} ({ratio(a.cer.mean, b.cer.mean)}), {said}")
        lines.append(f"{encoder}: " + ("; ".join(parts) or "no scratch baseline to compare with"))
    return lines


def markdown_tables(rows: Sequence[Mapping[str, Any]], probe: Mapping[str, str] | None = None) -> str:
    """Per budget and decoder: each model's held-out CER and WER (mean ± std over seeds) and its CER
    on its own labelled utterances, best first; ``probe``: the frozen probe's held-out CER by model."""
    out: list[str] = []
    for minutes in budgets(rows):
        seconds = max(r["labelled_seconds"] for r in rows if r["labelled_minutes"] == minutes)
        for decoder in sorted({r["decoder"] for r in rows}, key=lambda d: (d != GREEDY, d)):
            results = as_probe_results(rows, decoder, minutes)
            held, trained = summarise(results, "heldout"), summarise(results, "train")
            out += [
                f"**{minutes:g} min budget ({seconds / 60:.1f} min labelled), {decoder} decoding**",
                "",
                "| model | seeds | held-out CER | held-out WER | labelled CER | held-out utterances |",
                "|---|---|---|---|---|---|",
            ]
            for model, s in sorted(held.items(), key=lambda item: item[1].cer.mean):
                own = str(trained[model].cer) if model in trained else "n/a"
                out.append(f"| {model} | {len(s.seeds)} | {s.cer} | {s.wer} | {own} | {s.utterances} |")
            out += [f"| frozen probe: {name} | | {cer} | | | |" for name, cer in (probe or {}).items()] + [""]
    return "\n".join(out)


def wer_by_budget(rows: Sequence[Mapping[str, Any]]) -> tuple[list[float], dict[str, list[float]]]:
    """(budgets, mean held-out greedy WER per model at each budget): the papers' figure."""
    x = budgets(rows)
    series: dict[str, list[float]] = {}
    for model in dict.fromkeys(r["model"] for r in rows):
        means = []
        for minutes in x:
            values = [
                r["wer"]
                for r in rows
                if r["model"] == model
                and r["labelled_minutes"] == minutes
                and r["split"] == "heldout"
                and r["decoder"] == GREEDY
            ]
            means.append(sum(values) / len(values) if values else math.nan)
        series[model] = means
    return x, series
