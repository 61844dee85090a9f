"""Dynamic partitions: one feature shard per speaker, one k-means target set per client."""

import dagster as dg

speakers_partitions = dg.DynamicPartitionsDefinition(name="speakers")
clients_partitions = dg.DynamicPartitionsDefinition(name="clients")

# The run tags that make one run cover a first..last range of partition keys (what a backfill and
# `dagster asset materialize --partition-range` set); the automation's requests set them too.
PARTITION_RANGE_START = "dagster/asset_partition_range_start"
PARTITION_RANGE_END = "dagster/asset_partition_range_end"


def register_new(
    context: dg.AssetExecutionContext,
    partitions: dg.DynamicPartitionsDefinition,
    keys: list[str],
    known: list[str] | None = None,
) -> list[str]:
    """Add the keys the instance does not know yet (``known``: the registered keys, if the caller
    has just read them); returns those added. Registered keys are never written again."""
    assert partitions.name is not None
    if known is None:
        known = list(context.instance.get_dynamic_partitions(partitions.name))
    new = sorted(set(keys) - set(known))
    if new:
        context.instance.add_dynamic_partitions(partitions.name, new)
    return new


# Dependencies on every partition of a partitioned asset (a speaker shard or a client's targets).
ALL_SHARDS = dg.AssetDep("vad_features", partition_mapping=dg.AllPartitionMapping())
ALL_TARGETS = dg.AssetDep("kmeans_targets", partition_mapping=dg.AllPartitionMapping())
# Each HuBERT iteration's k-means targets asset (one partition per client).
TARGETS_ASSETS = {1: "kmeans_targets", 2: "kmeans_targets_iter2"}


# The per-speaker view of the manifest (an observed asset; its partitions' versions are what a shard follows).
SPEAKER_MANIFEST = "speaker_manifest"

# Every encoder checkpoint the graph trains, by the kind the probe, fine-tuning and the stats name it.
CHECKPOINT_ASSETS = {
    "pretrained": "pretrained_checkpoint",
    "federated": "federated_checkpoint",
    "distilled": "distilled_checkpoint",
    "iteration2": "pretrained_checkpoint_iter2",
}

# Everything a training run reads (and the stats database summarises).
TRAINING_INPUTS = ["manifest", "cmvn_stats", "client_partitions", ALL_SHARDS, ALL_TARGETS]
