"""What ``finetune/results.parquet`` says: its schema, a table per labelled budget and decoder, and
one line per encoder on whether fine-tuning it beat the same architecture from scratch (no torch).
Rows are grouped as the probe's results so that the probe's summary over seeds judges fine-tuning too.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from speech_assets.evaluation.compare import (
    MIN_HELDOUT_SPEAKERS,
    MIN_HELDOUT_UTTERANCES,
    ModelSummary,
    ProbeResult,
    Spread,
    indicative_reasons,
    summarise,
)
from speech_assets.utils import markdown_table

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
        ("steps", pa.int64()),  # the step the dev set selected
        ("dev_cer", pa.float64()),  # that step's greedy dev CER (the same on every row of one run)
        ("labelled_seconds", pa.float64()),
        ("checkpoint_sha256", pa.string()),
        # per run: the peak lr, the held-out speakers, the train + dev utterances whose transcript is a
        # held-out one (must be 0), the share of held-out words outside the beam decoder's lexicon
        ("lr", pa.float64()),
        ("heldout_speakers", pa.int64()),
        ("text_overlap", pa.int64()),
        ("oov_rate", pa.float64()),
    ]
)
# later additions: a results file without them still reads (as None); without any other column it is refused
OPTIONAL_COLUMNS = ("dev_cer", "lr", "heldout_speakers", "text_overlap", "oov_rate")

# a model whose mean greedy CER on its own labelled utterances (split "train") stays at or above
# this did not train (CTC's all-blank plateau scores about 1.0): a comparison with it is not measured
DID_NOT_TRAIN_CER = 0.95


# a fine-tuned model and its scratch baseline are told apart over seeds: at least this many each,
# and a gap of more than SPREAD_FACTOR combined standard deviations
MIN_SEEDS = 2
SPREAD_FACTOR = 2.0


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
    missing = [name for name in SCHEMA.names if name not in table.column_names and name not in OPTIONAL_COLUMNS]
    if missing:
        raise ValueError(f"fine-tuning results lack the columns {missing}: rematerialize finetuned_asr")
    return [{name: row.get(name) for name in SCHEMA.names} | row for row in table.to_pylist()]


def probe_reference(path: str | os.PathLike[str]) -> dict[str, str]:
    """The frozen probe's held-out CER of pretrained and fbank; empty if the probe has not run."""
    from speech_assets.evaluation.compare import read_results

    try:
        held = summarise(read_results(path))
    except (OSError, ValueError):  # not run yet, or unreadable
        return {}
    return {name: str(held[name].cer) for name in ("pretrained", "fbank") if name in held}


PROBE_COLUMNS = ("split", "cer", "wer", "utterances", "steps", "seed")  # in ProbeResult's field order


def as_probe_results(rows: Sequence[Mapping[str, Any]], decoder: str, minutes: float) -> list[ProbeResult]:
    """The rows of one budget and decoder, as the probe's summaries read them."""
    return [
        ProbeResult(r["model"], r["checkpoint_sha256"], "ctc", [], *(r[c] for c in PROBE_COLUMNS), "", 0)
        for r in rows
        if r["decoder"] == decoder and r["labelled_minutes"] == minutes
    ]


def budgets(rows: Sequence[Mapping[str, Any]]) -> list[float]:
    return sorted({float(r["labelled_minutes"]) for r in rows})


def _of(rows: Sequence[Mapping[str, Any]], model: str, minutes: float, split: str = "heldout") -> list:
    return [
        r
        for r in rows
        if r["model"] == model and r["labelled_minutes"] == minutes and r["decoder"] == GREEDY and r["split"] == split
    ]


def _run_values(rows: Sequence[Mapping[str, Any]], column: str) -> list:
    return [r[column] for r in rows if r.get(column) is not None]


def heldout_speakers(rows: Sequence[Mapping[str, Any]]) -> int | None:
    found = _run_values(rows, "heldout_speakers")
    return int(min(found)) if found else None


def verdicts(rows: Sequence[Mapping[str, Any]], min_heldout_speakers: int = MIN_HELDOUT_SPEAKERS) -> list[str]:
    return [line for line, _ in judged(rows, min_heldout_speakers)]


def judged(
    rows: Sequence[Mapping[str, Any]], min_heldout_speakers: int = MIN_HELDOUT_SPEAKERS
) -> list[tuple[str, str | None]]:
    """(line, why it is only indicative or None) per fine-tuned encoder: at each budget, its held-out
    greedy CER against scratch's and whether it beat scratch, lost, or the corpus is too small to
    tell. A model that did not train (labelled CER at or above :data:`DID_NOT_TRAIN_CER`) makes it
    "not measured", never a win."""
    encoders = [m for m in dict.fromkeys(r["model"] for r in rows) if m != SCRATCH]
    lines = []
    for encoder in encoders:
        parts = []
        for minutes in budgets(rows):
            results = as_probe_results(rows, GREEDY, minutes)
            held, trained = summarise(results, "heldout"), summarise(results, "train")
            if encoder not in held or SCRATCH not in held:
                continue
            a, b = held[encoder], held[SCRATCH]
            stuck = [
                (who, trained[name].cer)
                for who, name in (("model", encoder), ("baseline", SCRATCH))
                if name in trained and trained[name].cer.mean >= DID_NOT_TRAIN_CER
            ]
            if stuck:
                who, cers = " and ".join(who for who, _ in stuck), " and ".join(f"{c.mean:.3f}" for _, c in stuck)
                said = f"{who} did not train (labelled CER {cers} >= {DID_NOT_TRAIN_CER:g}): not measured"
                parts.append(f"{minutes:g} min: CER {a.cer} vs scratch {b.cer}, {said}")
                continue
            reason = too_small_to_tell(a, b)
            said = "beats scratch" if a.cer.mean < b.cer.mean else "loses to scratch"
            said = f"too small to tell ({reason})" if reason else said
            ratio = f"{a.cer.mean / b.cer.mean:.2f}x" if b.cer.mean > 0 else "n/a x"
            parts.append(f"{minutes:g} min: CER {a.cer} vs scratch {b.cer} ({ratio}), {said}")
        line = f"{encoder}: " + ("; ".join(parts) or "no scratch baseline to compare with")
        # in the probe's words; None: enough held-out speakers, or their count not recorded
        speakers = heldout_speakers([r for r in rows if r["model"] in (encoder, SCRATCH)])
        why = None if speakers is None else indicative_reasons(speakers, None, min_heldout_speakers)
        lines.append((line + (f" (indicative only: {why})" if why else ""), why))
    return lines


def verdict_markdown(lines: Sequence[str]) -> str:
    return "\n".join(f"- {line}" for line in lines)


def overlap_problems(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per run whose labelled or dev text overlaps the held-out transcripts (must be 0)."""
    seen = {
        (r["model"], r["labelled_minutes"], r["seed"]): int(r["text_overlap"]) for r in rows if r.get("text_overlap")
    }
    return [
        f"{model}/{minutes:g}min/seed{seed}: {n} labelled or dev utterance{'s' if n != 1 else ''} whose transcript "
        "is a held-out one (text overlap must be 0)"
        for (model, minutes, seed), n in sorted(seen.items())
    ]


def _spread(values: Sequence[float]) -> str:
    return str(Spread.of([float(v) for v in values])) if values else "n/a"


def text_notes(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The text overlap (must be 0) and the held-out OOV rate per budget, where recorded."""
    notes = []
    overlap = _run_values(rows, "text_overlap")
    if overlap:
        most = int(max(overlap))
        notes.append(
            f"text overlap: {most} labelled or dev utterance{'s' if most != 1 else ''} whose transcript is a held-out "
            f"one (must be 0{'' if most == 0 else ': these held-out scores flatter every model'})"
        )
    if oov := oov_by_budget(rows):
        notes.append(
            "held-out OOV rate against the beam decoder's lexicon (the labelled words; mean over runs): "
            + ", ".join(f"{budget} {rate:.3f}" for budget, rate in oov.items())
        )
    return notes


def oov_by_budget(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Per budget (``"1 min"``): the mean held-out OOV rate (every run has as many rows)."""
    rates = {
        f"{m:g} min": _run_values([r for r in rows if r["labelled_minutes"] == m], "oov_rate") for m in budgets(rows)
    }
    return {budget: round(sum(v) / len(v), 4) for budget, v in rates.items() if v}


def markdown_tables(rows: Sequence[Mapping[str, Any]], probe: Mapping[str, str] | None = None) -> str:
    """Per budget and decoder a table of each model's scores, best first; ``probe``: the frozen probe's
    held-out CER by model (none: the table says the probe has not run)."""
    out: list[str] = []
    for minutes in budgets(rows):
        here = [r for r in rows if r["labelled_minutes"] == minutes]
        seconds = max(r["labelled_seconds"] for r in here)
        for decoder in sorted({r["decoder"] for r in rows}, key=lambda d: (d != GREEDY, d)):
            results = as_probe_results(rows, decoder, minutes)
            held, trained = summarise(results, "heldout"), summarise(results, "train")
            beam = decoder != GREEDY
            names = ["model", "seeds", "held-out CER", "held-out WER"]
            names += ["held-out OOV rate"] if beam else []
            names += ["labelled CER", "dev CER", "lr", "step", "held-out utterances"]
            table = []
            for model, s in sorted(held.items(), key=lambda item: item[1].cer.mean):
                runs = _of(rows, model, minutes)
                own = str(trained[model].cer) if model in trained else "n/a"
                lrs = sorted(set(_run_values(runs, "lr")))
                steps = sorted({int(r["steps"]) for r in runs if r.get("steps") is not None})
                cells = [model, str(len(s.seeds)), str(s.cer), str(s.wer)]
                cells += [_spread(_run_values(runs, "oov_rate"))] if beam else []
                cells += [
                    own,
                    _spread(_run_values(runs, "dev_cer")),
                    ", ".join(f"{lr:.2g}" for lr in lrs) or "n/a",
                    "–".join(str(v) for v in dict.fromkeys([steps[0], steps[-1]])) if steps else "n/a",
                    str(s.utterances),
                ]
                table.append(cells)
            out += [f"**{minutes:g} min budget ({seconds / 60:.1f} min labelled), {decoder} decoding**", ""]
            out.append(markdown_table(names, table))
            blank = " |" * (len(names) - 3)
            out += [f"| frozen probe: {name} | | {cer} |{blank}" for name, cer in (probe or {}).items()] or [
                f"| frozen probe: not run yet | | |{blank}"
            ]
            notes = text_notes(here)
            out += [""] + [f"{note}." for note in notes] + ([""] if notes else [])
    return "\n".join(out)


def wer_by_budget(rows: Sequence[Mapping[str, Any]]) -> tuple[list[float], dict[str, list[float]]]:
    """(budgets, mean held-out greedy WER per model at each budget): the papers' figure."""
    x = budgets(rows)
    wers = {
        model: [[r["wer"] for r in _of(rows, model, m)] for m in x] for model in dict.fromkeys(r["model"] for r in rows)
    }
    return x, {model: [sum(v) / len(v) if v else math.nan for v in found] for model, found in wers.items()}
