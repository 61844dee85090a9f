"""Stage 4c: HuBERT iteration 2 — targets from the iteration-1 encoder's own features
(`kmeans_targets_iter2`, per client) and a checkpoint trained on them (`pretrained_checkpoint_iter2`).
"""

from collections.abc import Iterator

import dagster as dg

from speech_assets.corpus.clients import read_clients
from speech_assets.defs import per_partition
from speech_assets.defs.lineage import client_shards, required_checkpoint
from speech_assets.defs.partitions import ALL_SHARDS, CHECKPOINT_ASSETS, clients_partitions
from speech_assets.defs.readable import client_metadata
from speech_assets.defs.resources import (
    Iteration2Settings,
    PipelineSettings,
    StoragePaths,
    TrainingSettings,
    effective,
    overrides_of,
)
from speech_assets.defs.torchrun import run_pretraining, torchrun_asset
from speech_assets.targets.config import KMeansConfig
from speech_assets.utils import from_fields

# v2: the encoder's own normalisation, held-out speakers never fitted; v3: labelled on one faiss thread
KMEANS_ITER2_CODE_VERSION = "kmeans-iter2-v3"
TRAIN_ITER2_CODE_VERSION = "train-iter2-v3"  # v2: unmasked_weight 1.0; v3: as train-v3
# the encoders iteration 2 may take its targets from: those trained on iteration-1 targets
ENCODER_ASSETS = {kind: CHECKPOINT_ASSETS[kind] for kind in ("pretrained", "federated")}


Iteration2Overrides = overrides_of(Iteration2Settings)


ALL_ITER2_TARGETS = dg.AssetDep("kmeans_targets_iter2", partition_mapping=dg.AllPartitionMapping())


@per_partition.per_partition_asset(
    clients_partitions,
    group_name="iteration2",
    deps=["pretrained_checkpoint", "federated_checkpoint", "client_partitions", "cmvn_stats", ALL_SHARDS],
    code_version=KMEANS_ITER2_CODE_VERSION,
    kinds={"faiss", "pytorch"},
)
def kmeans_targets_iter2(
    context: dg.AssetExecutionContext, config: Iteration2Overrides, paths: StoragePaths, settings: PipelineSettings
) -> Iterator[object]:
    """HuBERT iteration 2, per client: k-means (`[iteration2] k` clusters) on that client's own frames in the
    feature space of one layer of the iteration-1 encoder (pretrained, or federated when
    `[iteration2] encoder` says so); int16 labels at 50 Hz. Records the checkpoint and layer."""
    from speech_assets.targets.iteration2 import EncoderRefused, iteration2_targets, load_iteration2_encoder

    options = effective(settings.iteration2, config)
    asset = ENCODER_ASSETS.get(options.encoder)
    if asset is None:
        raise dg.Failure(
            description=f"[iteration2] encoder must be one of {sorted(ENCODER_ASSETS)}, got {options.encoder!r}"
        )
    checkpoint, checkpoint_version = required_checkpoint(context, asset)
    try:
        encoder = load_iteration2_encoder(checkpoint, options.layer, asset=asset, data_version=checkpoint_version)
    except EncoderRefused as error:
        raise dg.Failure(description=str(error)) from error
    assignments = read_clients(paths.layout.clients_file)

    def publish(client_id: str) -> tuple[str, dict[str, object]]:
        out_dir = paths.targets(client_id, 2).root
        quality = iteration2_targets(
            client_shards(paths, assignments, client_id),
            out_dir,
            encoder,
            from_fields(KMeansConfig, options),
            settings=options.model_dump_json(exclude={"layer"}),
            code_version=KMEANS_ITER2_CODE_VERSION,
            log=context.log.info,
            warn=context.log.warning,
        )
        return quality["data_version"], {
            **client_metadata(quality, out_dir),
            "encoder": asset,
            "layer": encoder.layer,
            "checkpoint_sha256": encoder.sha256,
            "mean_segment_length_hz": 50,
        }

    yield from per_partition.per_client_events(context, publish)


@torchrun_asset(
    "training",
    group_name="iteration2",
    deps=["manifest", "cmvn_stats", "client_partitions", ALL_SHARDS, ALL_ITER2_TARGETS],
    code_version=TRAIN_ITER2_CODE_VERSION,
)
def pretrained_checkpoint_iter2(context, options: TrainingSettings, paths: StoragePaths, pipes) -> dg.MaterializeResult:
    """HuBERT iteration 2: the same trainer and [training] settings as pretrained_checkpoint, on
    kmeans_targets_iter2's labels (a fresh model, as in HuBERT); torchrun, Pipes, MLflow."""
    return run_pretraining(context, options, paths, pipes, 2, TRAIN_ITER2_CODE_VERSION)


ASSETS = [kmeans_targets_iter2, pretrained_checkpoint_iter2]
