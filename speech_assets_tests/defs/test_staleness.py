"""Staleness past Dagster's 100-partition limit: 101 speakers, one changes, and the project's own
check (asset checks and `speech-assets lineage --stale`) names exactly what must be rebuilt."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest
import soundfile as sf
from dagster._core.definitions.data_version import (
    SKIP_PARTITION_DATA_VERSION_DEPENDENCY_THRESHOLD,
    CachingStaleStatusResolver,
    StaleStatus,
)
from dagster._core.loader import LoadingContextForTest

from speech_assets import cli
from speech_assets.definitions import build_definitions
from speech_assets.defs import staleness
from speech_assets.defs.resources import ClientSettings, KMeansSettings, PipelineSettings, StoragePaths
from speech_assets_tests.support.corpora import LibriCorpus, with_silence
from speech_assets_tests.support.local_runs import materialize_in_process

SPEAKERS = SKIP_PARTITION_DATA_VERSION_DEPENDENCY_THRESHOLD + 1  # where Dagster stops looking (100 today)


def speak(corpus: LibriCorpus, speaker: str, seed: int, line: bool = True) -> None:
    """One short utterance of vowel-like speech (which the VAD keeps) for ``speaker``."""
    utt_id = f"{speaker}-c1-0000"
    if line:
        corpus.add_line(speaker, "c1", utt_id, "A VOWEL")
    sf.write(
        corpus.chapter_dir(speaker, "c1") / f"{utt_id}.flac",
        with_silence(0.2, 0.8 + seed % 5 * 0.05, 0.2, seed=seed),
        16_000,
    )


def test_one_changed_speaker_past_the_partition_limit_is_traced_to_what_it_makes_stale(
    tmp_path: Path, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = LibriCorpus(tmp_path / "corpus")
    for index in range(SPEAKERS):
        speak(corpus, f"s{index:03d}", seed=index)
    paths = StoragePaths(corpus=str(corpus.root), data_dir=str(tmp_path / "out"), mlflow_tracking_uri="sqlite://")
    settings = PipelineSettings(clients=ClientSettings(num_clients=3), kmeans=KMeansSettings(k=8))
    defs = build_definitions(paths, settings)

    def build(asset: str, partitions: list[str] | None = None) -> None:
        materialize_in_process(defs, instance, asset, partitions)

    build("manifest")
    speakers = list(instance.get_dynamic_partitions("speakers"))
    assert len(speakers) == SPEAKERS
    build("vad_features", speakers)
    build("cmvn_stats")
    build("client_partitions")
    clients = list(instance.get_dynamic_partitions("clients"))
    build("kmeans_targets", clients)
    build("dataset_stats")
    assert staleness.stale_report(paths) == {"pretrained_checkpoint": ["never built"]}

    changed = "s042"
    speak(corpus, changed, seed=999, line=False)
    build("manifest")  # records a new speaker_manifest version for the changed speaker only
    build("vad_features", [changed])

    # Dagster's own resolver no longer looks through so many partitions: it calls cmvn_stats fresh.
    resolver = CachingStaleStatusResolver(instance, defs.resolve_asset_graph(), LoadingContextForTest(instance))
    assert resolver.get_status(dg.AssetKey("cmvn_stats")) == StaleStatus.FRESH
    # The recorded inputs say otherwise, exactly for what read the changed shard.
    owner = next(c for c in clients if changed in (paths.targets(c).root / "quality.json").read_text())
    report = staleness.stale_report(paths)
    assert set(report) == {"cmvn_stats", f"kmeans_targets[{owner}]", "dataset_stats", "pretrained_checkpoint"}
    assert report["cmvn_stats"] == [f"1 changed shard(s): {changed}"]
    assert not staleness.cmvn_inputs_are_current(paths=paths).passed
    assert not staleness.targets_inputs_are_current(paths=paths).passed
    # the CLI's main in this process (test_cli runs it in processes of its own): an interpreter costs seconds
    monkeypatch.setenv("SPEECH_ASSETS_DATA_DIR", paths.data_dir)
    monkeypatch.setenv("SPEECH_ASSETS_CORPUS", paths.corpus)
    capsys.readouterr()
    assert cli.main(["lineage", "--stale", "--json"]) == 3
    assert json.loads(capsys.readouterr().out) == report

    build("cmvn_stats")
    build("client_partitions")
    build("kmeans_targets", [owner])
    build("dataset_stats")
    assert staleness.stale_report(paths) == {"pretrained_checkpoint": ["never built"]}
    assert staleness.cmvn_inputs_are_current(paths=paths).passed
    instance.dispose()
