"""The end of ``make demo`` (``scripts/materialize_all.sh``): the fine-tuned recogniser on held-out
utterances of the corpus the demo ran on, each with its reference text and CER; then one verdict
line read from the Dagster instance (the steps of the demo's runs that succeeded, and every asset
check that warned, with the reason its evaluation recorded) and what to open.

``python -m speech_assets.demo --since <epoch seconds>``: the runs created since then are the
demo's. Nothing here recomputes a check: the instance's evaluations are the verdict.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import dagster as dg

from speech_assets import locations
from speech_assets.layout import DataLayout, RecogniserFiles, RunFiles

EXAMPLES = 3


@dataclass(frozen=True)
class Example:
    """A held-out utterance of the fine-tuning split: its audio and reference text."""

    utt_id: str
    speaker_id: str
    path: str
    reference: str


def heldout_examples(data: DataLayout, count: int = EXAMPLES) -> list[Example]:
    """``count`` held-out utterances of the exported recogniser's fine-tuning run that the current
    manifest lists and whose audio exists; one speaker after another, in id order."""
    from speech_assets.corpus.manifest import read_manifest

    card = RecogniserFiles(data.finetune.recogniser).card
    if not card.is_file():
        raise FileNotFoundError(f"no recogniser at {card.parent}: materialize finetuned_asr")
    run_dir = Path(json.loads(card.read_text(encoding="utf-8"))["checkpoint"]).parent
    heldout = json.loads(RunFiles(run_dir).labelled.read_text(encoding="utf-8"))["heldout"]
    listed = {row.utt_id: row for row in read_manifest(data.manifest.manifest)}
    by_speaker: dict[str, list[Example]] = {}
    for utt_id in sorted(heldout):
        row = listed.get(utt_id)
        if row is not None and Path(row.path).is_file():
            by_speaker.setdefault(row.speaker_id, []).append(Example(utt_id, row.speaker_id, row.path, heldout[utt_id]))
    # each speaker's first utterance, then each one's second, ...
    ranked = sorted((i, speaker, example) for speaker, items in by_speaker.items() for i, example in enumerate(items))
    return [example for _, _, example in ranked[:count]]


@dataclass(frozen=True)
class CheckOutcome:
    asset: str
    check: str
    passed: bool
    severity: str
    why: str

    @property
    def name(self) -> str:
        return f"{self.check} on {self.asset}"


def check_outcomes(instance: dg.DagsterInstance, run_ids: Iterable[str]) -> list[CheckOutcome]:
    """The last evaluation of every asset check in ``run_ids``; the reason is its description, else its verdict."""
    latest: dict[tuple[str, str], CheckOutcome] = {}
    for run_id in run_ids:
        for entry in instance.all_logs(run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION):
            evaluation = entry.dagster_event.event_specific_data
            verdict = evaluation.metadata.get("verdict")
            why = evaluation.description or (str(verdict.value) if verdict is not None else "")
            asset = evaluation.asset_key.to_user_string()
            latest[(asset, evaluation.check_name)] = CheckOutcome(
                asset, evaluation.check_name, evaluation.passed, evaluation.severity.value, why.strip()
            )
    return [latest[key] for key in sorted(latest)]


def verdict(succeeded: int, failed: int, outcomes: Sequence[CheckOutcome]) -> list[str]:
    """``N steps succeeded, K warnings: ...``, then one line per check that did not pass, with its reason."""
    warned = [o for o in outcomes if not o.passed and o.severity == dg.AssetCheckSeverity.WARN.value]
    errors = [o for o in outcomes if not o.passed and o.severity != dg.AssetCheckSeverity.WARN.value]
    head = f"{succeeded} steps succeeded" + (f", {failed} failed" if failed else "")
    head += f", {len(warned)} warning{'s' * (len(warned) != 1)}"
    if errors:
        head += f", {len(errors)} failed check{'s' * (len(errors) != 1)}"
    named = [o.name for o in (*errors, *warned)]
    lines = [head + (f": {', '.join(named)}" if named else "")]
    for outcome in (*errors, *warned):
        kind = "warned" if outcome in warned else "failed"
        why = outcome.why.splitlines()[0] if outcome.why else "no reason recorded"
        lines.append(f"- {outcome.name} {kind}: {why}")
    return lines


def what_to_open(data: DataLayout) -> list[str]:
    return [
        f"report: {data.report.index}",
        "Dagster UI (runs, asset checks, lineage): make ui",
        "MLflow (every model's run, the registered speech_assets_recogniser): make mlflow",
    ]


def _examples_section(data: DataLayout, instance: dg.DagsterInstance, count: int) -> tuple[list[str], bool]:
    import jiwer

    from speech_assets.evaluation.recognise import Recogniser, RecogniserError, fetch_recogniser

    try:
        examples = heldout_examples(data, count)
    except (OSError, KeyError, ValueError) as error:
        return [f"error: {error}"], False
    if not examples:
        return ["error: no held-out utterance of the fine-tuning split is in the corpus the demo ran on"], False
    from speech_assets.defs.lineage import latest_metadata

    uri = latest_metadata(instance, "finetuned_asr").get("registered_model")  # the MLflow model version, if any
    try:
        with tempfile.TemporaryDirectory(prefix="speech-assets-model.") as folder:
            model = data.finetune.recogniser
            if uri:
                model = fetch_recogniser(uri, Path(folder), locations.mlflow_tracking_uri(data.root))
            recogniser = Recogniser(model)
    except RecogniserError as error:
        return [f"error: {error}"], False
    lines, ok = [f"recogniser: {uri or f'{data.finetune.recogniser} (not registered in MLflow)'}"], True
    for example, transcript in zip(examples, recogniser.transcribe_all(e.path for e in examples), strict=True):
        head = f"{example.utt_id} (speaker {example.speaker_id})"
        if transcript.error is not None:
            lines.append(f"{head}: error: {transcript.error}")
            ok = False
            continue
        hypothesis = transcript.text or ""
        cer = float(jiwer.cer(example.reference, hypothesis)) if hypothesis else 1.0
        lines += [f"{head}: CER {cer:.2f}", f"  reference:  {example.reference}", f"  recognised: {hypothesis}"]
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m speech_assets.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--since", type=float, required=True, help="epoch seconds: the demo's runs start here")
    parser.add_argument("--examples", type=int, default=EXAMPLES, help="held-out utterances to transcribe (0: none)")
    args = parser.parse_args(argv)
    data = DataLayout(locations.data_dir())
    ok = True
    with dg.DagsterInstance.get() as instance:
        if args.examples > 0:
            print(f"== the fine-tuned recogniser on {args.examples} held-out utterances (speakers it never heard) ==")
            lines, ok = _examples_section(data, instance, args.examples)
            print("\n".join(lines))
            print()
        runs = instance.get_runs(filters=dg.RunsFilter(created_after=datetime.fromtimestamp(args.since, UTC)))
        run_ids = [run.run_id for run in reversed(runs)]  # oldest first
        ends = {dg.DagsterEventType.STEP_SUCCESS, dg.DagsterEventType.STEP_FAILURE}
        steps = [e.dagster_event.event_type for run_id in run_ids for e in instance.all_logs(run_id, of_type=ends)]
        succeeded, failed = steps.count(dg.DagsterEventType.STEP_SUCCESS), steps.count(dg.DagsterEventType.STEP_FAILURE)
        print(f"== verdict ({len(run_ids)} runs) ==")
        print("\n".join(verdict(succeeded, failed, check_outcomes(instance, run_ids))))
    print("\n".join(what_to_open(data)))
    return 0 if ok and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
