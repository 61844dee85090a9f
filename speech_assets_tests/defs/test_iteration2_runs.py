"""HuBERT iteration 2 in real Dagster runs on the sample: pretrained_checkpoint (iteration 1,
torchrun), then kmeans_targets_iter2 (each client clusters its own frames in a layer of that
encoder) and pretrained_checkpoint_iter2, executed in this process against the sample build's
instance; lineage, K, 50 Hz alignment and input versions are checked."""

from __future__ import annotations

import json

import dagster as dg
import pyarrow.parquet as pq

from speech_assets.definitions import build_definitions
from speech_assets.defs.resources import PipelineSettings, StoragePaths
from speech_assets.targets.labels import read_labels
from speech_assets.testing.local_runs import materialize_in_process
from speech_assets_tests.conftest import REPO, SAMPLE_CORPUS

SHORT = {"preset": "tiny", "max_steps": 40, "checkpoint_every": 20, "heldout_fraction": 0.1}


def test_iteration_2_targets_and_checkpoint_from_the_iteration_1_encoder(sample_build: dict) -> None:
    out = sample_build["out"]
    paths = StoragePaths(corpus=str(SAMPLE_CORPUS), data_dir=str(out), mlflow_tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    defs = build_definitions(paths, PipelineSettings.load(REPO / "pipeline.toml"))
    with dg.DagsterInstance.from_config(str(sample_build["home"])) as instance:
        clients = list(instance.get_dynamic_partitions("clients"))  # a range runs in registration order
        materialize_in_process(defs, instance, "pretrained_checkpoint", run_config={"ops": {"pretrained_checkpoint": {"config": SHORT}}})
        materialize_in_process(defs, instance, "kmeans_targets_iter2", clients)
        materialize_in_process(
            defs, instance, "pretrained_checkpoint_iter2",
            run_config={"ops": {"pretrained_checkpoint_iter2": {"config": {"max_steps": 40, "checkpoint_every": 20}}}},
        )  # fmt: skip
        event = instance.fetch_materializations(dg.AssetKey("pretrained_checkpoint_iter2"), limit=1).records[0].asset_materialization
    (teacher,) = [json.loads(p.read_text()) for p in (out / "training").glob("*/result.json")]
    for client_dir in sorted((out / "kmeans_iter2").glob("client_*")):
        quality = json.loads((client_dir / "quality.json").read_text())
        # lineage: which encoder and layer made the targets; K=500 shrank for these small clients
        assert quality["checkpoint_sha256"] == teacher["checkpoint_sha256"] and quality["layer"] == 2
        assert 1 < quality["k"] <= 500 and quality["perplexity"] > 1
        labels = read_labels(client_dir / "labels.parquet")
        for speaker in quality["speakers"]:
            shard = pq.read_table(out / "features" / "shards" / f"{speaker}.parquet", columns=["utt_id", "num_frames"]).to_pylist()
            for row in shard:  # one label per 50 Hz encoder frame
                assert len(labels[row["utt_id"]]) == (row["num_frames"] + 1) // 2
    (result,) = [json.loads(p.read_text()) for p in (out / "training_iter2").glob("*/result.json")]
    assert result["step"] == 40
    assert event.tags["dagster/data_version"] == result["checkpoint_sha256"]
    assert event.metadata["input_versions"].value["kmeans_targets_iter2"].startswith("4 partitions")
