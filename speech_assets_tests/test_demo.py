"""The end of `make demo` (speech_assets/demo.py): held-out utterances of the corpus the demo ran
on, transcribed by the registered recogniser with their reference and CER; the verdict line read
from a real Dagster instance's step events and asset check evaluations of the demo's runs only."""

from __future__ import annotations

import json
import time
from pathlib import Path

import dagster as dg
import pytest

from speech_assets import demo
from speech_assets.corpus.manifest import ManifestRow, write_manifest
from speech_assets.layout import DataLayout, RecogniserFiles, RunFiles
from speech_assets_tests.conftest import SAMPLE_CORPUS
from speech_assets_tests.evaluation.test_recognise import store  # noqa: F401 (the registered recogniser)


def transcripts() -> dict[str, str]:
    found = {}
    for trans in SAMPLE_CORPUS.rglob("*.trans.txt"):
        for line in trans.read_text().splitlines():
            utt, _, text = line.partition(" ")
            found[utt] = text
    return found


def utterances(speaker: str, count: int) -> list[str]:
    return sorted(u for u in transcripts() if u.startswith(speaker + "-"))[:count]


def data_layout(root: Path, listed: list[str], heldout: list[str], train: list[str]) -> DataLayout:
    """A data dir as finetuned_asr leaves it: the manifest of the corpus (``listed``), one
    fine-tuning run whose labelled.json holds ``train`` and ``heldout``, and the recogniser card
    naming that run's checkpoint."""
    data = DataLayout(root)
    texts = transcripts()
    rows = [
        ManifestRow(
            u,
            u.split("-")[0],
            u.split("-")[1],
            str(next(SAMPLE_CORPUS.rglob(f"{u}.flac"))),
            texts[u],
            16000,
            1,
            16000,
            1.0,
            "0",
        )
        for u in listed
    ]
    data.manifest.root.mkdir(parents=True)
    write_manifest(data.manifest.manifest, rows)
    run = RunFiles(data.finetune.runs / "run-a")
    run.root.mkdir(parents=True)
    labelled = {"train": {u: texts[u] for u in train}, "dev": {}, "heldout": {u: texts.get(u, "GONE") for u in heldout}}
    run.labelled.write_text(json.dumps(labelled))
    card = RecogniserFiles(data.finetune.recogniser)
    card.root.mkdir(parents=True)
    card.card.write_text(json.dumps({"checkpoint": str(run.root / "final.pt")}))
    return data


def test_the_examples_are_heldout_utterances_of_the_corpus_given(tmp_path: Path) -> None:
    """Mutations killed: taking the examples from labelled.json's "train" (training speakers)
    instead of "heldout"; not checking them against the manifest (an utterance of another corpus,
    first in id order, is then shown); one speaker's utterances only."""
    train = utterances("1001", 3)
    heldout = utterances("1003", 3) + utterances("1004", 2)
    unseen = "0999-099901-0000"  # held out in the run, but not in the corpus this demo ran on
    data = data_layout(tmp_path / "out", train + heldout + utterances("1005", 2), [unseen, *heldout], train)
    chosen = demo.heldout_examples(data, 3)
    assert [e.utt_id for e in chosen] == [heldout[0], heldout[3], heldout[1]]  # speaker after speaker
    texts = transcripts()
    assert all(e.reference == texts[e.utt_id] and Path(e.path).name == f"{e.utt_id}.flac" for e in chosen)
    assert demo.heldout_examples(data, 10) == demo.heldout_examples(data, 5)  # no more than there are


def test_no_recogniser_is_said_plainly(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="materialize finetuned_asr"):
        demo.heldout_examples(DataLayout(tmp_path), 3)


def checked_asset(name: str, warnings: dict[str, dict], registered: str | None = None) -> list:
    """An asset ``name`` and one WARN check per ``warnings`` entry (``{"passed", "description",
    "verdict"}``), as the pipeline's checks report them."""

    @dg.asset(name=name)
    def the_asset() -> dg.MaterializeResult:
        return dg.MaterializeResult(metadata={"registered_model": registered} if registered else {})

    def check_of(check: str, how: dict) -> dg.AssetChecksDefinition:
        @dg.asset_check(asset=name, name=check)
        def evaluate() -> dg.AssetCheckResult:
            return dg.AssetCheckResult(
                passed=how["passed"],
                severity=dg.AssetCheckSeverity.WARN,
                description=how.get("description"),
                metadata={"verdict": how["verdict"]} if "verdict" in how else {},
            )

        return evaluate

    checks = [check_of(check, how) for check, how in warnings.items()]
    return [the_asset, *checks]


def test_the_demo_prints_heldout_transcripts_and_the_verdict_of_its_own_runs(
    store: dict,  # noqa: F811
    instance: dg.DagsterInstance,
    tmp_path: Path,
    monkeypatch,
    capsys,
) -> None:
    """Mutations killed: counting a passed check as a warning; counting the checks of runs before
    ``--since`` (an older run's warning); a fixed warning text instead of the evaluation's
    description (or, without one, its recorded verdict); transcribing with the local folder when
    finetuned_asr registered a model version (the recogniser line names the version)."""
    older = dg.materialize(
        checked_asset("stale", {"old_check": {"passed": False, "description": "from before"}}), instance=instance
    )
    assert older.success
    time.sleep(1.1)  # the runs storage keeps creation times to the second or finer
    since = time.time()
    time.sleep(1.1)
    registered = store["logged"]["registered_uri"]
    warnings = {
        "beats_baseline": {"passed": False, "description": "pretrained: indicative only (1 held-out speaker)\nmore"},
        "sound": {"passed": True, "description": "fine"},
        "only_verdict": {"passed": False, "verdict": "worse than fbank"},
    }
    assert dg.materialize(checked_asset("finetuned_asr", warnings, registered), instance=instance).success
    heldout = utterances("1003", 2) + utterances("1004", 2)
    data = data_layout(tmp_path / "out", heldout + utterances("1001", 2), heldout, utterances("1001", 2))
    monkeypatch.setenv("SPEECH_ASSETS_DATA_DIR", str(data.root))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store["uri"])
    assert demo.main(["--since", str(since), "--examples", "3"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert f"recogniser: {registered}" in lines
    for utt in (heldout[0], heldout[2], heldout[1]):
        assert any(line.startswith(f"{utt} (speaker {utt[:4]}): CER ") for line in lines), out
        assert f"  reference:  {transcripts()[utt]}" in lines
    assert sum(line.startswith("  recognised: ") for line in lines) == 3
    head = lines.index("== verdict (1 runs) ==")
    assert lines[head + 1 : head + 4] == [
        "4 steps succeeded, 2 warnings: beats_baseline on finetuned_asr, only_verdict on finetuned_asr",
        "- beats_baseline on finetuned_asr warned: pretrained: indicative only (1 held-out speaker)",
        "- only_verdict on finetuned_asr warned: worse than fbank",
    ]
    assert "old_check" not in out and "from before" not in out
    assert lines[-3:] == demo.what_to_open(data) and lines[-3] == f"report: {data.report.index}"


def test_the_verdict_line_names_failures_and_counts() -> None:
    outcomes = [
        demo.CheckOutcome("a", "x", True, "WARN", ""),
        demo.CheckOutcome("a", "y", False, "ERROR", "broken"),
        demo.CheckOutcome("b", "z", False, "WARN", ""),
    ]
    assert demo.verdict(7, 1, outcomes) == [
        "7 steps succeeded, 1 failed, 1 warning, 1 failed check: y on a, z on b",
        "- y on a failed: broken",
        "- z on b warned: no reason recorded",
    ]
    assert demo.verdict(3, 0, outcomes[:1]) == ["3 steps succeeded, 0 warnings"]
