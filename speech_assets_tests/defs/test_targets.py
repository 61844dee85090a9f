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
from speech_assets.testing.local_runs import materialize_in_process
from speech_assets_tests.conftest import SAMPLE_CORPUS

ONE_CLIENT = {"ops": {"client_partitions": {"config": {"num_clients": 1}}}}


def kmeans_config(refit_growth: float) -> dict:
    return {"ops": {"kmeans_targets": {"config": {"k": 8, "refit_growth": refit_growth}}}}


@pytest.fixture
def world(tmp_path: Path, instance: dg.DagsterInstance):
    corpus = tmp_path / "corpus"
    shutil.copytree(SAMPLE_CORPUS, corpus)
    paths = StoragePaths(corpus=str(corpus), data_dir=str(tmp_path / "out"), mlflow_tracking_uri=f"sqlite:///{tmp_path}/m.db")
    yield build_definitions(paths), instance, paths, corpus
    instance.dispose()


def build_features(defs: dg.Definitions, instance: dg.DagsterInstance, paths: StoragePaths) -> None:
    """manifest, the shards of the speakers it lists (existing ones are reused), CMVN."""
    materialize_in_process(defs, instance, "manifest")
    current = pq.read_table(paths.speakers_file, columns=["speaker_id"]).column(0).to_pylist()
    registered = [s for s in instance.get_dynamic_partitions("speakers") if s in current]
    materialize_in_process(defs, instance, "vad_features", registered)
    materialize_in_process(defs, instance, "cmvn_stats")


def speaker_frames(paths: StoragePaths) -> dict[str, int]:
    sums = ShardStats.load(paths.cmvn_dir / "speaker_sums.npz")
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
        return json.loads((paths.kmeans_dir("client_00") / "quality.json").read_text())

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
