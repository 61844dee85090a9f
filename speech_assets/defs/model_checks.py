"""Checks on the trained models and iteration 2's targets, read from the files they wrote.

Each check is a pure function of the run folder (named by ``run_dir`` in the asset's latest
materialization) in a thin Dagster wrapper.
"""

import math
from collections.abc import Callable
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq

from speech_assets.defs.lineage import latest_metadata
from speech_assets.defs.partitions import CHECKPOINT_ASSETS
from speech_assets.defs.readable import labels_match_shards_check
from speech_assets.defs.resources import PipelineSettings, StoragePaths
from speech_assets.layout import FederatedPaths, RecogniserFiles, RunFiles
from speech_assets.train.accuracy import LABEL, heldout_accuracy
from speech_assets.utils import read_json, read_jsonl


def _is_loss(key: str) -> bool:
    # a distillation's per-layer L1 and cosine parts too
    return key == "loss" or key.endswith("_loss") or key.startswith(("l1_", "cosine_"))


def recorded_losses(run_dir: Path) -> dict[str, list[float]]:
    """Every loss ``run_dir`` records, by where it is recorded (None values: not measured)."""
    found: dict[str, list[float]] = {}
    for row in read_jsonl(RunFiles(run_dir).metrics):
        for key, value in row.items():
            if _is_loss(key) and value is not None:
                found.setdefault(f"metrics.jsonl {key}", []).append(float(value))
    for key, value in read_json(RunFiles(run_dir).result, strict=True).items():
        if _is_loss(key) and isinstance(value, int | float):
            found[f"result.json {key}"] = [float(value)]
    federation = FederatedPaths(run_dir)
    for table, column in ((federation.rounds_table, "train_loss"), (federation.evaluation_table, "heldout_loss")):
        if table.is_file():
            values = pq.read_table(table, columns=[column]).column(0).to_pylist()
            found[f"{table.name} {column}"] = [float(v) for v in values if v is not None]
    return found


def loss_problems(run_dir: Path) -> list[str]:
    """Non-finite losses in ``run_dir``, or that it records none at all."""
    losses = recorded_losses(run_dir)
    if not any(losses.values()):
        return [f"no loss recorded in {run_dir}"]
    return [
        f"{where}: {bad} of {len(values)} not finite"
        for where, values in sorted(losses.items())
        if (bad := sum(not math.isfinite(v) for v in values))
    ]


def loss_trend(run_dir: Path) -> tuple[float, float, int] | None:
    """(first loss, last loss, logged steps) of ``metrics.jsonl``, None under two steps; a step logged
    twice (a run re-started in the same folder) counts once, with its last value."""
    by_step = {
        int(row["step"]): float(row["loss"])
        for row in read_jsonl(RunFiles(run_dir).metrics)
        if row.get("loss") is not None
    }
    if len(by_step) < 2:
        return None
    steps = sorted(by_step)
    return by_step[steps[0]], by_step[steps[-1]], len(steps)


def run_folder_check(
    asset: str, name: str, description: str, judge: Callable[[Path], dg.AssetCheckResult], blocking: bool = False
) -> dg.AssetChecksDefinition:
    """``judge(run folder)`` of ``asset``'s latest materialization; fails when none is recorded."""

    @dg.asset_check(asset=asset, name=name, blocking=blocking, description=description)
    def check(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        run_dir = latest_metadata(context.instance, asset).get("run_dir")
        if run_dir is None:
            return dg.AssetCheckResult(passed=False, description=f"no run folder recorded: materialize {asset} first")
        return judge(Path(str(run_dir)))

    return check


def finite_losses(run_dir: Path) -> dg.AssetCheckResult:
    problems = loss_problems(run_dir)
    return dg.AssetCheckResult(
        passed=not problems,
        severity=dg.AssetCheckSeverity.ERROR,
        description="; ".join(problems) if problems else None,
        metadata={"run_dir": dg.MetadataValue.path(str(run_dir)), "problems": dg.MetadataValue.json(problems)},
    )


def above_majority_class(run_dir: Path) -> dg.AssetCheckResult:
    result = read_json(RunFiles(run_dir).result, strict=True)
    measured = heldout_accuracy(result)
    if measured is None:
        return dg.AssetCheckResult(
            passed=True, description=f"no {LABEL} recorded (no held-out speaker or no leak-free frame)"
        )
    steps = result.get("step")
    return dg.AssetCheckResult(
        passed=measured.beats_majority,
        severity=dg.AssetCheckSeverity.WARN,
        description=None
        if measured.beats_majority
        else (
            f"{LABEL} {measured.accuracy:.3f} <= majority-class rate {measured.majority:.3f}"
            + (f" after {steps} steps" if steps is not None else "")
            + ": "
            + MAJORITY_AT_DEMO_SCALE
        ),
        metadata={
            "heldout_masked_accuracy": round(measured.accuracy, 4),
            "heldout_majority_accuracy": round(measured.majority, 4),
            **({"steps": int(steps)} if isinstance(steps, int | float) else {}),
        },
    )


def falling_loss(run_dir: Path) -> dg.AssetCheckResult:
    trend = loss_trend(run_dir)
    if trend is None:
        return dg.AssetCheckResult(passed=True, description="fewer than two logged steps: nothing to compare")
    first, last, steps = trend
    return dg.AssetCheckResult(
        passed=last < first,
        severity=dg.AssetCheckSeverity.ERROR,
        metadata={"first_loss": first, "last_loss": last, "logged_steps": steps},
    )


LOSSES_ARE_FINITE = (
    "Every loss the run recorded is finite: each logged step's (metrics.jsonl), the final and held-out "
    "ones (result.json) and, for a federation, each client's per round (rounds.parquet, evaluation.parquet)."
)
MAJORITY_AT_DEMO_SCALE = (
    "expected at demo scale (a few hundred steps on minutes of audio: the encoder has not yet learnt more than the "
    "most frequent cluster); at full scale, train longer or check the targets. Whether the encoder is useful is "
    "the downstream probe's verdict (downstream_probe)."
)
BEATS_MAJORITY_CLASS = (
    "Held-out masked accuracy (on leak-free frames, the figure every view shows) above the majority-class rate "
    "(always predicting each client's most frequent training label) on the same frames, where the run measured "
    "both. Warns at demo scale: " + MAJORITY_AT_DEMO_SCALE
)
CHECKS = [
    *(
        run_folder_check(asset, "losses_are_finite", LOSSES_ARE_FINITE, finite_losses, blocking=True)
        for asset in CHECKPOINT_ASSETS.values()
    ),
    *(
        run_folder_check(asset, "beats_majority_class", BEATS_MAJORITY_CLASS, above_majority_class)
        for kind, asset in CHECKPOINT_ASSETS.items()
        if kind != "distilled"  # a student evaluates no masked prediction
    ),
    run_folder_check(
        "distilled_checkpoint",
        "student_loss_falls",
        "The student's distillation loss fell: its last logged value is below its first (metrics.jsonl).",
        falling_loss,
    ),
    labels_match_shards_check(2),
]


FINETUNING_IS_SOUND = (
    "Every fine-tuning run of the latest materialization recorded finite CTC losses, no labelled or dev "
    "utterance's transcript is a held-out one (text overlap 0), and the exported recogniser's ONNX output matched "
    "PyTorch within the export's tolerance on held-out utterances. Its description and `verdict` metadata state "
    "each encoder's verdict against scratch word for word as `speech-assets finetune` (the same function, the "
    "same [probe] min_heldout_speakers): 'not measured' where a model did not train, 'indicative only' below "
    "min_heldout_speakers held-out speakers, which makes the check warn (yellow) with those lines; a verdict never "
    "fails it."
)


@dg.asset_check(asset="finetuned_asr", blocking=True, description=FINETUNING_IS_SOUND)
def finetuning_is_sound(
    context: dg.AssetCheckExecutionContext, paths: StoragePaths, settings: PipelineSettings
) -> dg.AssetCheckResult:
    from speech_assets.evaluation import finetune_results as results

    runs = latest_metadata(context.instance, "finetuned_asr").get("run_dirs")
    if runs is None:
        return dg.AssetCheckResult(passed=False, description="no fine-tuning recorded: materialize finetuned_asr first")
    problems = [f"{name}: {problem}" for name, folder in runs.items() for problem in loss_problems(Path(folder))]
    spec = read_json(RecogniserFiles(paths.layout.finetune.recogniser).card)
    diff = (spec.get("parity") or {}).get("max_abs_diff")
    atol = results.RECOGNISER_PARITY_ATOL
    if not (diff is not None and diff <= atol):  # NaN and a missing record fail too
        problems.append(f"the recogniser's ONNX export differs from PyTorch by {diff} (tolerance {atol:g})")
    try:
        rows = results.read_rows(paths.layout.finetune.results)
    except (OSError, ValueError) as error:
        rows = []
        problems.append(f"fine-tuning results unreadable: {error}")
    problems += results.overlap_problems(rows)
    min_speakers = settings.probe.min_heldout_speakers
    judged = results.judged(rows, min_heldout_speakers=min_speakers)
    lines = [line for line, _ in judged]
    # an indicative verdict warns (yellow) in the words of the asset's `verdict` metadata; a problem fails
    warnings = [line for line, why in judged if why]
    overlap = [r["text_overlap"] for r in rows if r.get("text_overlap") is not None]
    speakers = results.heldout_speakers(rows)
    return dg.AssetCheckResult(
        passed=not problems and not warnings,
        severity=dg.AssetCheckSeverity.ERROR if problems else dg.AssetCheckSeverity.WARN,
        description="\n".join(["; ".join(problems)] * bool(problems) + lines) or None,
        metadata={
            "runs": len(runs),
            "max_abs_diff": float(diff) if diff is not None else float("nan"),
            "verdict": dg.MetadataValue.md(results.verdict_markdown(lines)),
            "text_overlap": int(max(overlap)) if overlap else "not recorded",
            "heldout_speakers": speakers if speakers is not None else "not recorded",
            "min_heldout_speakers": min_speakers,
        },
    )


RECOGNISER_READS_RAW_AUDIO = (
    "The exported recogniser fed the held-out utterances' audio files (frontend.onnx, then recogniser.onnx, as "
    "`speech-assets transcribe` runs them without torch) gave the same greedy text as the pipeline's featurisation "
    "and the PyTorch model on every one, and its features matched the pipeline's CMVN log-mel within the recorded "
    "tolerance (recogniser.json's audio_parity)."
)


@dg.asset_check(asset="finetuned_asr", description=RECOGNISER_READS_RAW_AUDIO)
def recogniser_reads_raw_audio(paths: StoragePaths) -> dg.AssetCheckResult:
    record = read_json(RecogniserFiles(paths.layout.finetune.recogniser).card).get("audio_parity") or {}
    count, diff = record.get("utterances") or 0, record.get("feature_max_abs_diff", math.nan)
    passed = count > 0 and record.get("same_text") == count and diff <= record.get("feature_atol", 0.0)
    return dg.AssetCheckResult(
        passed=bool(passed),
        description=None
        if passed
        else f"audio parity not met: {record or 'not recorded (rematerialize finetuned_asr)'}",
        metadata={k: v for k, v in record.items() if isinstance(v, (int, float))},
    )
