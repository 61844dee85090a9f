"""The checks of the assets a data build alone does not make (the trained models, iteration 2's
targets, the probe) and of speaker_manifest, on tiny files written here in the formats the assets
write: each passes on a sound folder and fails on the fault it is there to catch. The Dagster
wrappers run against a real instance whose latest materialization names the folder.

And every asset of the graph has a check, with a test that shows that check catching its fault.
"""

from __future__ import annotations

import importlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import dagster as dg
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from speech_assets import definitions
from speech_assets.corpus.clients import ClientAssignment, write_clients
from speech_assets.corpus.manifest import ManifestRow, speaker_hashes, write_manifest
from speech_assets.defs import manifest, model_checks, probe
from speech_assets.defs.resources import StoragePaths
from speech_assets.federated.history import EVALUATION_SCHEMA, ROUNDS_SCHEMA
from speech_assets.layout import ProbeFiles
from speech_assets.targets.labels import UtteranceLabels, iter_labels, write_labels
from speech_assets_tests.support.training_data import write_corpus

CHECKS = {key: check for check in definitions.defs.asset_checks for key in check.check_keys}

# every asset: a test that shows one of its checks catching the fault it is there to catch
FAULT_TESTS = {
    "manifest": "speech_assets_tests.corpus.test_audit:test_each_audit_catches_its_fault_in_the_rows",
    "speaker_manifest": f"{__name__}:test_speaker_manifest_rows_must_match_the_manifest",
    "vad_features": "speech_assets_tests.defs.test_checks:test_each_check_catches_its_fault",
    "cmvn_stats": "speech_assets_tests.defs.test_checks:test_each_check_catches_its_fault",
    "client_partitions": "speech_assets_tests.defs.test_checks:test_each_check_catches_its_fault",
    "kmeans_targets": "speech_assets_tests.defs.test_checks:test_each_check_catches_its_fault",
    "pretrained_checkpoint": f"{__name__}:test_each_run_check_catches_its_fault",
    "pretrained_checkpoint_iter2": f"{__name__}:test_each_run_check_catches_its_fault",
    "federated_checkpoint": f"{__name__}:test_each_run_check_catches_its_fault",
    "distilled_checkpoint": f"{__name__}:test_each_run_check_catches_its_fault",
    "kmeans_targets_iter2": f"{__name__}:test_iteration_2_labels_must_match_the_frames",
    "encoder_export": (
        "speech_assets_tests.defs.test_model_runs:test_export_parity_is_run_again_and_catches_a_drifted_export"
    ),
    "downstream_probe": f"{__name__}:test_a_probe_that_does_not_beat_log_mel_is_flagged",
    "finetuned_asr": (
        "speech_assets_tests.defs.test_model_runs:test_finetuning_check_passes_and_catches_a_non_finite_loss"
    ),
    "dataset_stats": "speech_assets_tests.defs.test_checks:test_each_check_catches_its_fault",
}


def test_every_asset_has_a_check_shown_catching_its_fault() -> None:
    graph = definitions.defs.resolve_asset_graph()
    assets = {key.to_user_string() for key in graph.get_all_asset_keys()}
    unchecked = assets - {key.asset_key.to_user_string() for key in graph.asset_check_keys}
    assert not unchecked, f"assets without an asset check: {sorted(unchecked)}"
    assert set(FAULT_TESTS) == assets
    for reference in FAULT_TESTS.values():
        module, name = reference.split(":")
        assert callable(getattr(importlib.import_module(module), name)), reference


# --- the trained models' run folders -------------------------------------------------------------


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))  # json writes NaN as NaN


def edit_json(path: Path, **changes: object) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def edit_metrics(run: Path, step: int, **changes: object) -> None:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    write_jsonl(run / "metrics.jsonl", [{**row, **changes} if row["step"] == step else row for row in rows])


def training_run(run: Path) -> None:
    """What the trainer writes: a metrics line per logged window, result.json at the end."""
    write_jsonl(
        run / "metrics.jsonl",
        [
            {
                "step": step,
                "loss": 6.0 - step / 10,
                "masked_loss": 5.8 - step / 10,
                "masked_accuracy": 0.02 * step,
                "unmasked_accuracy": 0.03 * step,
                "lr": 1e-3,
                "grad_norm": 1.5,
                "audio_seconds_per_second": 90.0,
                "epoch": 0.0,
            }
            for step in (5, 10, 15, 20)
        ],
    )
    (run / "result.json").write_text(
        json.dumps(
            {
                "step": 20,
                "final_loss": 4.0,
                "final_masked_accuracy": 0.4,
                "heldout_loss": 4.3,
                "heldout_leak_free_masked_accuracy": 0.31,
                "heldout_leak_free_majority_accuracy": 0.12,
                # all masked frames: leaky, higher; no check reads it
                "heldout_masked_accuracy": 0.45,
                "heldout_majority_accuracy": 0.1,
                "chance_accuracy": 0.01,
            }
        )
    )


def distill_run(run: Path) -> None:
    write_jsonl(
        run / "metrics.jsonl",
        [
            {
                "step": 10,
                "loss": 1.8,
                "lr": 5e-4,
                "l1_layer_02": 0.9,
                "l1_layer_04": 0.8,
                "cosine_layer_02": 0.05,
                "cosine_layer_04": 0.05,
            },
            {
                "step": 20,
                "loss": 1.1,
                "lr": 5e-4,
                "l1_layer_02": 0.5,
                "l1_layer_04": 0.5,
                "cosine_layer_02": 0.05,
                "cosine_layer_04": 0.05,
            },
        ],
    )
    (run / "result.json").write_text(
        json.dumps({"step": 20, "final_loss": 1.1, "l1_layer_02": 0.5, "cosine_layer_02": 0.05})
    )


def federated_run(run: Path) -> None:
    """What the ServerApp writes: one row per client and round, the evaluation, result.json."""
    clients = ("client_00", "client_01")
    rounds = [
        {
            "round": r,
            "client_id": c,
            "num_examples": 12,
            "train_loss": 5.0 - r,
            "masked_accuracy": 0.1 * r,
            "bytes_up": 1000,
            "bytes_down": 1000,
            "seconds": 3.0,
        }
        for r in (1, 2)
        for c in clients
    ]
    pq.write_table(pa.Table.from_pylist(rounds, schema=ROUNDS_SCHEMA), run / "rounds.parquet")
    heldout = [
        {
            "round": r,
            "client_id": c,
            "utterances": 2,
            "masked_frames": 40,
            "heldout_loss": 5.1 - r,
            "heldout_masked_accuracy": 0.1 * r,
            "majority_accuracy": 0.08,
        }
        for r in (1, 2)
        for c in clients
    ]
    pq.write_table(pa.Table.from_pylist(heldout, schema=EVALUATION_SCHEMA), run / "evaluation.parquet")
    (run / "result.json").write_text(
        json.dumps(
            {
                "rounds": 2,
                "final_train_loss": 3.0,
                "heldout_leak_free_masked_accuracy": 0.2,
                "heldout_leak_free_majority_accuracy": 0.08,
                "heldout_masked_accuracy": 0.3,
                "heldout_majority_accuracy": 0.07,
            }
        )
    )


def nan_in_a_round(run: Path) -> None:
    table = pq.read_table(run / "rounds.parquet").to_pylist()
    table[3]["train_loss"] = float("nan")  # one client's update in round 2 diverged
    pq.write_table(pa.Table.from_pylist(table, schema=ROUNDS_SCHEMA), run / "rounds.parquet")


def restarted_and_rising(run: Path) -> None:
    """A second attempt appended to the same metrics.jsonl, whose loss went up."""
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write(json.dumps({"step": 10, "loss": 1.2}) + "\n" + json.dumps({"step": 20, "loss": 1.9}) + "\n")


WRITERS = {
    "pretrained_checkpoint": training_run,
    "pretrained_checkpoint_iter2": training_run,
    "federated_checkpoint": federated_run,
    "distilled_checkpoint": distill_run,
}
RUN_CASES: list[tuple[str, str, Callable[[Path], None]]] = [
    ("pretrained_checkpoint", "losses_are_finite", lambda run: edit_metrics(run, 10, loss=float("nan"))),
    (
        "pretrained_checkpoint",
        "losses_are_finite",
        lambda run: edit_json(run / "result.json", heldout_loss=float("inf")),
    ),
    ("pretrained_checkpoint", "losses_are_finite", lambda run: [p.unlink() for p in run.iterdir()]),
    (
        "pretrained_checkpoint",
        "beats_majority_class",
        lambda run: edit_json(run / "result.json", heldout_leak_free_masked_accuracy=0.12),
    ),
    ("pretrained_checkpoint_iter2", "losses_are_finite", lambda run: edit_metrics(run, 20, masked_loss=float("-inf"))),
    (
        "pretrained_checkpoint_iter2",
        "beats_majority_class",
        lambda run: edit_json(run / "result.json", heldout_leak_free_majority_accuracy=0.5),
    ),
    ("federated_checkpoint", "losses_are_finite", nan_in_a_round),
    (
        "federated_checkpoint",
        "beats_majority_class",
        lambda run: edit_json(run / "result.json", heldout_leak_free_masked_accuracy=0.05),
    ),
    ("distilled_checkpoint", "losses_are_finite", lambda run: edit_metrics(run, 20, l1_layer_04=float("nan"))),
    ("distilled_checkpoint", "student_loss_falls", lambda run: edit_metrics(run, 20, loss=1.9)),
    ("distilled_checkpoint", "student_loss_falls", restarted_and_rising),
]


@pytest.fixture(scope="module")
def instance():
    with dg.instance_for_test() as instance:
        yield instance


def run_check(instance: dg.DagsterInstance, asset: str, name: str, run: Path) -> dg.AssetCheckResult:
    """``name`` on ``asset`` as Dagster runs it: after a materialization that names ``run``."""
    instance.report_runless_asset_event(
        dg.AssetMaterialization(asset, metadata={"run_dir": dg.MetadataValue.path(str(run))})
    )
    check = CHECKS[dg.AssetCheckKey(dg.AssetKey(asset), name)]
    return check(dg.build_asset_check_context(instance=instance))


@pytest.mark.parametrize(("asset", "name"), sorted({(asset, name) for asset, name, _ in RUN_CASES}))
def test_every_run_check_passes_on_a_sound_run(instance, tmp_path: Path, asset: str, name: str) -> None:
    WRITERS[asset](tmp_path)
    result = run_check(instance, asset, name, tmp_path)
    assert result.passed, result.metadata


@pytest.mark.parametrize(
    ("asset", "name", "fault"), RUN_CASES, ids=[f"{a}-{n}-{i}" for i, (a, n, _) in enumerate(RUN_CASES)]
)
def test_each_run_check_catches_its_fault(instance, tmp_path: Path, asset: str, name: str, fault) -> None:
    WRITERS[asset](tmp_path)
    fault(tmp_path)
    assert not run_check(instance, asset, name, tmp_path).passed


def test_run_checks_say_what_they_could_not_measure(tmp_path: Path) -> None:
    training_run(tmp_path)
    edit_json(
        tmp_path / "result.json", heldout_leak_free_masked_accuracy=None, heldout_leak_free_majority_accuracy=None
    )  # no leak-free frames: the all-frames figure is not used in its place
    measured = model_checks.above_majority_class(tmp_path)
    assert measured.passed and "no held-out masked accuracy" in measured.description
    write_jsonl(tmp_path / "metrics.jsonl", [{"step": 10, "loss": 2.0}])
    assert model_checks.loss_trend(tmp_path) is None
    assert model_checks.loss_problems(tmp_path) == []
    assert "no loss recorded" in model_checks.loss_problems(tmp_path / "missing")[0]


# --- speaker_manifest: the rows every partition is a view of -------------------------------------


def manifest_rows() -> list[ManifestRow]:
    return [
        ManifestRow(
            f"{speaker}-1-{i:04d}",
            speaker,
            "1",
            f"/corpus/{speaker}/{i}.flac",
            f"words {i}",
            16000,
            1,
            16000 * (i + 1),
            float(i + 1),
            f"{i:064x}",
        )
        for speaker in ("spk-a", "spk-b")
        for i in range(3)
    ]


def write_speakers(path: Path, rows: list[ManifestRow]) -> None:
    hashes = speaker_hashes(rows)
    pq.write_table(
        pa.table(
            {
                "speaker_id": list(hashes),
                "utterances": [sum(r.speaker_id == s for r in rows) for s in hashes],
                "hours": [sum(r.duration_s for r in rows if r.speaker_id == s) / 3600 for s in hashes],
                "manifest_hash": list(hashes.values()),
            }
        ),
        path,
    )


def sound_manifest(paths: StoragePaths) -> list[ManifestRow]:
    rows = manifest_rows()
    paths.layout.manifest.root.mkdir(parents=True)
    write_manifest(paths.layout.manifest.manifest, rows)
    write_speakers(paths.layout.manifest.speakers, rows)
    return rows


def interrupted_publish(paths: StoragePaths, rows: list[ManifestRow]) -> None:
    """The new manifest's rows beside the speakers file of the one before (one utterance fewer)."""
    write_speakers(paths.layout.manifest.speakers, rows[:-1])


def hours_off(paths: StoragePaths, rows: list[ManifestRow]) -> None:
    table = pq.read_table(paths.layout.manifest.speakers)
    hours = [h * 2 if i == 0 else h for i, h in enumerate(table.column("hours").to_pylist())]
    pq.write_table(
        table.set_column(table.column_names.index("hours"), "hours", pa.array(hours)), paths.layout.manifest.speakers
    )


def speaker_dropped(paths: StoragePaths, rows: list[ManifestRow]) -> None:
    write_speakers(paths.layout.manifest.speakers, [r for r in rows if r.speaker_id != "spk-b"])


@pytest.mark.parametrize("fault", [None, interrupted_publish, hours_off, speaker_dropped])
def test_speaker_manifest_rows_must_match_the_manifest(tmp_path: Path, fault) -> None:
    paths = StoragePaths(corpus=str(tmp_path), data_dir=str(tmp_path / "out"), mlflow_tracking_uri="sqlite://")
    rows = sound_manifest(paths)
    if fault is not None:
        fault(paths, rows)
    result = manifest.rows_match_manifest(paths=paths)
    assert result.passed == (fault is None), result.metadata


# --- kmeans_targets_iter2: one label per 50 Hz frame of every utterance --------------------------


def iteration2_build(paths: StoragePaths) -> None:
    """Shards of two clients' speakers and iteration-2 targets in their folders (kmeans_iter2/)."""
    corpus = write_corpus(
        paths.root / "features",
        clients={"client_00": 6, "client_01": 6},
        speakers_per_client=1,
        utterances_per_speaker=3,
        unlabelled_per_shard=0,
    )
    write_clients(paths.layout.clients_file, [ClientAssignment(f"{c}-spk0", c, 0.0, 3) for c in sorted(corpus.clients)])
    for client, targets in corpus.clients.items():
        out = paths.root / "kmeans_iter2" / client
        out.mkdir(parents=True)
        shutil.copy(targets.labels, out / "labels.parquet")
        np.save(out / "codebook.npy", np.zeros((targets.k, 16), np.float32))


def rewrite_labels(out: Path, change) -> None:
    write_labels(
        out / "labels.parquet",
        [
            UtteranceLabels(item.utt_id, item.speaker_id, change(item.labels))
            for item in iter_labels(out / "labels.parquet")
        ],
    )


ITER2_FAULTS = {
    # labels at the input's 100 Hz instead of the encoder's 50 Hz
    "100 Hz": lambda out: rewrite_labels(out, lambda labels: np.repeat(labels, 2)),
    "ids beyond K": lambda out: np.save(out / "codebook.npy", np.zeros((2, 16), np.float32)),
    "utterance unlabelled": lambda out: write_labels(
        out / "labels.parquet", list(iter_labels(out / "labels.parquet"))[1:]
    ),
}


@pytest.mark.parametrize("fault", [None, *ITER2_FAULTS])
def test_iteration_2_labels_must_match_the_frames(tmp_path: Path, fault: str | None) -> None:
    paths = StoragePaths(corpus=str(tmp_path), data_dir=str(tmp_path / "out"), mlflow_tracking_uri="sqlite://")
    iteration2_build(paths)
    if fault is not None:
        ITER2_FAULTS[fault](paths.root / "kmeans_iter2" / "client_01")
    result = CHECKS[dg.AssetCheckKey(dg.AssetKey("kmeans_targets_iter2"), "labels_match_shards")](paths=paths)
    assert result.passed == (fault is None), result.metadata


# --- downstream_probe ---------------------------------------------------------------------------


def probe_rows(model: str, errors_per_utterance: int, speakers: int, utterances: int = 40) -> list:
    """Three seeds of held-out rows, each utterance (20 characters) with ``errors_per_utterance`` errors give or
    take one."""
    from speech_assets.evaluation.compare import HeldoutErrors, ProbeResult

    found = []
    for seed in range(3):
        errors = np.full(utterances, errors_per_utterance, dtype=np.int64) + (np.arange(utterances) + seed) % 3 - 1
        held = HeldoutErrors(
            tuple(f"u{i}" for i in range(utterances)),
            tuple(f"h{i % speakers}" for i in range(utterances)),
            errors,
            np.full(utterances, 20),
            errors // 4,
            np.full(utterances, 5),
        )
        cer = float(errors.sum() / (20 * utterances))
        found.append(
            ProbeResult(
                model,
                "",
                "linear",
                [1.0],
                "heldout",
                cer,
                cer,
                utterances,
                60,
                seed,
                "utterance",
                speakers,
                errors=held,
            )
        )
    return found


@pytest.mark.parametrize(
    ("pretrained_errors", "speakers", "passed", "verdict", "said"),
    [
        (10, 4, True, "better than fbank and random", "pass: better than fbank, CER change -0.200 ["),
        (
            14,
            4,
            False,
            "better than random; no evidence against fbank",
            "warn: no evidence against fbank, CER change +0.000 [",
        ),
        (17, 4, False, "better than random; worse than fbank", "warn: worse than fbank, CER change +0.150 ["),
        (
            10,
            1,
            False,
            "better than fbank and random (indicative only: 1 held-out speaker, fewer than 3)",
            "warn: indicative only (1 held-out speaker, fewer than 3): better than fbank, CER change -0.200 [",
        ),
    ],
    ids=["better", "same as fbank", "worse", "better on one held-out speaker"],
)
def test_a_probe_that_does_not_beat_log_mel_is_flagged(
    tmp_path: Path, pretrained_errors: int, speakers: int, passed: bool, verdict: str, said: str
) -> None:
    """The check and the asset's ``pretrained_beats_fbank`` metadata say the same words, passing or
    warning (both outcomes). Kills: the metadata judged apart from the check (today's
    ``yes (indicative only)`` beside a warning check)."""
    from speech_assets.evaluation.compare import (
        leaderboard,
        leaderboard_table,
        results_table,
        standing,
    )

    paths = StoragePaths(corpus=str(tmp_path), data_dir=str(tmp_path / "out"), mlflow_tracking_uri="sqlite://")
    (paths.root / "probe").mkdir(parents=True)
    result = probe.pretrained_beats_fbank(paths=paths)
    assert not result.passed and "rematerialize downstream_probe" in result.description
    rows = (
        probe_rows("fbank", 14, speakers)
        + probe_rows("pretrained", pretrained_errors, speakers)
        + probe_rows("random", 19, speakers)
    )
    target = paths.root / "probe" / "results.parquet"
    board = leaderboard(rows, 3)
    pq.write_table(results_table(rows), target)
    pq.write_table(leaderboard_table(board, 3), ProbeFiles.beside(target).leaderboard)
    result = probe.pretrained_beats_fbank(paths=paths)
    assert result.passed is passed and result.severity == dg.AssetCheckSeverity.WARN
    assert result.description.startswith(said)
    # the asset's metadata shows the check's description word for word
    assert probe.verdict_metadata(board, 3) == {"pretrained_beats_fbank": result.description}
    assert standing(rows, 3)[0].endswith(f": {verdict}")
    assert result.metadata["verdict"].value == verdict and result.metadata["min_heldout_speakers"].value == 3
    assert "indicative only" in probe.PRETRAINED_BEATS_FBANK and "demo scale" in probe.PRETRAINED_BEATS_FBANK


def test_a_model_below_the_majority_class_is_told_this_is_expected_at_demo_scale(tmp_path: Path) -> None:
    training_run(tmp_path)
    edit_json(tmp_path / "result.json", heldout_leak_free_masked_accuracy=0.05)
    result = model_checks.above_majority_class(tmp_path)
    assert not result.passed and result.severity == dg.AssetCheckSeverity.WARN
    assert result.description.startswith(
        "held-out masked accuracy 0.050 <= majority-class rate 0.120 after 20 steps: expected at demo scale"
    )
    assert "downstream_probe" in result.description and result.metadata["steps"].value == 20
    assert model_checks.MAJORITY_AT_DEMO_SCALE in model_checks.BEATS_MAJORITY_CLASS
