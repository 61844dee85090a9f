"""Dynamic partitions: one feature shard per speaker, one k-means target set per client."""

import dagster as dg

speakers_partitions = dg.DynamicPartitionsDefinition(name="speakers")
clients_partitions = dg.DynamicPartitionsDefinition(name="clients")


def register_new(context: dg.AssetExecutionContext, partitions: dg.DynamicPartitionsDefinition, keys: list[str]) -> list[str]:
    """Add the keys the instance does not know yet; returns those added."""
    assert partitions.name is not None
    known = set(context.instance.get_dynamic_partitions(partitions.name))
    new = sorted(set(keys) - known)
    if new:
        context.instance.add_dynamic_partitions(partitions.name, new)
    return new


# Dependencies on every partition of a partitioned asset (a speaker shard or a client's targets).
ALL_SHARDS = dg.AssetDep("vad_features", partition_mapping=dg.AllPartitionMapping())
ALL_TARGETS = dg.AssetDep("kmeans_targets", partition_mapping=dg.AllPartitionMapping())
