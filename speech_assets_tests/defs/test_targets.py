"""kmeans_targets on a real instance: growth is measured against the last refit, not compounded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest

from speech_assets.definitions import build_definitions
from speech_assets.defs.resources import StoragePaths
from speech_assets.features.cmvn import ShardStats
from speech_assets_tests.conftest import SAMPLE_CORPUS
from speech_assets_tests.support.local_runs import materialize_in_process

ONE_CLIENT = {"ops": {"client_partitions": {"config": {"num_clients": 1}}}}


def kmeans_config(refit_growth: float) -> dict:
    return {"ops": {"kmeans_targets": {"config": {"k": 8, "refit_growth": refit_growth}}}}


@pytest.fixture
def world(tmp_path: Path, instance: dg.DagsterInstance):
    corpus = tmp_path / "corpus"
    shutil.copytree(SAMPLE_CORPUS, corpus)
    paths = StoragePaths(
        corpus=str(corpus), data_dir=str(tmp_path / "out"), mlflow_tracking_uri=f"sqlite:///{tmp_path}/m.db"
    )
    yield build_definitions(paths), instance, paths, corpus
    instance.dispose()


def build_features(defs: dg.Definitions, instance: dg.DagsterInstance, paths: StoragePaths) -> None:
    """manifest, the shards of the speakers it lists (existing ones are reused), CMVN."""
    materialize_in_process(defs, instance, "manifest")
    current = pq.read_table(paths.layout.manifest.speakers, columns=["speaker_id"]).column(0).to_pylist()
    registered = [s for s in instance.get_dynamic_partitions("speakers") if s in current]
    materialize_in_process(defs, instance, "vad_features", registered)
    materialize_in_process(defs, instance, "cmvn_stats")


def speaker_frames(paths: StoragePaths) -> dict[str, int]:
    sums = ShardStats.load(paths.layout.cmvn.root / "speaker_sums.npz")
    return {speaker: stats["mfcc"].count for speaker, stats in sums.speakers.items()}


def test_small_extensions_do_not_compound_past_refit_growth(world) -> None:
    defs, instance, paths, corpus = world
    build_features(defs, instance, paths)  # every speaker once, to learn their real frame counts
    frames = speaker_frames(paths)
    speakers = sorted(frames)
    # the larger newcomer first: then each step alone is within the bound chosen below
    first, second = sorted(speakers[-2:], key=lambda s: (-frames[s], s))
    aside = corpus.parent / "aside"
    for speaker in (first, second):
        shutil.move(corpus / speaker, aside / speaker)

    def targets_after(refit_growth: float) -> dict:
        build_features(defs, instance, paths)
        materialize_in_process(defs, instance, "client_partitions", run_config=ONE_CLIENT)
        materialize_in_process(defs, instance, "kmeans_targets", ["client_00"], kmeans_config(refit_growth))
        return json.loads((paths.targets("client_00").root / "quality.json").read_text())

    quality = targets_after(refit_growth=0.2)
    at_refit = quality["frames_labelled"]
    assert quality["mode"] == "refit" and quality["frames_at_refit"] == at_refit
    bound = frames[first] / at_refit * 1.0001
    # The old rule compared each step with the frames labelled before it: both steps would pass.
    assert frames[second] <= bound * (at_refit + frames[first])

    shutil.move(aside / first, corpus / first)
    quality = targets_after(refit_growth=bound)
    assert quality["mode"] == "extended" and quality["frames_at_refit"] == at_refit
    assert quality["frames_labelled"] == at_refit + frames[first]

    shutil.move(aside / second, corpus / second)
    quality = targets_after(refit_growth=bound)
    assert quality["mode"] == "refit", "growth since the last refit exceeds refit_growth: the codebook must be refitted"
    assert quality["frames_at_refit"] == quality["frames_labelled"] == at_refit + frames[first] + frames[second]


def test_label_problems_name_the_utterance_with_an_id_outside_the_codebook(tmp_path: Path) -> None:
    """One bad id among a client's labels (the check tests all of them at once) is reported for
    its utterance only, with an unlabelled-frames utterance (0 frames, 0 labels) beside it."""
    import numpy as np
    import pyarrow as pa

    from speech_assets.corpus.clients import CLIENTS_SCHEMA, read_clients
    from speech_assets.targets.checks import label_problems
    from speech_assets.targets.labels import UtteranceLabels, write_labels

    paths = StoragePaths(corpus=str(tmp_path), data_dir=str(tmp_path / "out"), mlflow_tracking_uri="sqlite://")
    frames = {"s1": {"s1-c-0": 9, "s1-c-1": 4}, "s2": {"s2-c-0": 0}}
    paths.layout.shards_dir.mkdir(parents=True)
    for speaker, utterances in frames.items():
        pq.write_table(
            pa.table({"utt_id": list(utterances), "num_frames": list(utterances.values())}), paths.shard_file(speaker)
        )
    rows = [
        {"speaker_id": s, "client_id": "client_00", "hours": 0.0, "utterances": len(u), "heldout": False}
        for s, u in frames.items()
    ]
    paths.layout.clients_file.parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=CLIENTS_SCHEMA), paths.layout.clients_file)
    out = paths.targets("client_00").root
    out.mkdir(parents=True)
    np.save(out / "codebook.npy", np.zeros((8, 39), np.float32))
    labels = {
        "s1-c-0": np.array([0, 1, 7, 3, 2], np.int16),
        "s1-c-1": np.array([1, 8], np.int16),
        "s2-c-0": np.zeros(0, np.int16),
    }
    write_labels(out / "labels.parquet", [UtteranceLabels(u, u[:2], v) for u, v in labels.items()])
    assert label_problems(
        read_clients(paths.layout.clients_file), paths.shard_file, lambda c: paths.targets(c).root
    ) == ["client_00/s1-c-1: 2 labels for 4 frames or ids outside [0, 8)"]

    labels["s1-c-1"] = np.array([1, 7], np.int16)
    write_labels(out / "labels.parquet", [UtteranceLabels(u, u[:2], v) for u, v in labels.items()])
    assert (
        label_problems(read_clients(paths.layout.clients_file), paths.shard_file, lambda c: paths.targets(c).root) == []
    )
