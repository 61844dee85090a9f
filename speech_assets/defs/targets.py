"""Stage 3: per-client k-means targets (the clients themselves: defs/clients.py)."""

from collections.abc import Iterator
from pathlib import Path

import dagster as dg

from speech_assets.corpus.clients import read_clients
from speech_assets.defs import per_partition
from speech_assets.defs.conditions import follow_upstream
from speech_assets.defs.lineage import client_shards
from speech_assets.defs.partitions import ALL_SHARDS, clients_partitions
from speech_assets.defs.readable import client_metadata, labels_match_shards_check
from speech_assets.defs.resources import KMeansSettings, PipelineSettings, StoragePaths, effective, overrides_of
from speech_assets.features import cmvn
from speech_assets.layout import TargetFiles
from speech_assets.targets import labels
from speech_assets.targets.config import KMeansConfig
from speech_assets.targets.publish import KMeansPolicy, kmeans_client_targets
from speech_assets.utils import from_fields, markdown_table

KMEANS_CODE_VERSION = "kmeans-v3"  # v2: held-out speakers are labelled, never fitted; v3: labelled on one faiss thread


# force: refit even when this client's inputs are unchanged
KMeansOverrides = overrides_of(KMeansSettings, force=(bool, False))


@per_partition.per_partition_asset(
    clients_partitions,
    group_name="clients",
    deps=["client_partitions", "cmvn_stats", ALL_SHARDS],
    code_version=KMEANS_CODE_VERSION,
    # client_partitions is rebuilt after every shard or CMVN update: react to it, not to them
    automation_condition=follow_upstream(ignore_updates_of=["vad_features", "cmvn_stats"]),
    kinds={"faiss"},
)
def kmeans_targets(
    context: dg.AssetExecutionContext, config: KMeansOverrides, paths: StoragePaths, settings: PipelineSettings
) -> Iterator[object]:
    """Per client: k-means on that client's own CMVN-normalised MFCC frames (federated HuBERT),
    codebook and int16 labels per utterance at 50 Hz."""
    kmeans = effective(settings.kmeans, config)
    assignments = read_clients(paths.layout.clients_file)
    speaker_sums = cmvn.ShardStats.load(paths.layout.cmvn.speaker_sums)
    policy = KMeansPolicy(
        from_fields(KMeansConfig, kmeans),
        kmeans.refit_growth,
        kmeans.model_dump_json(exclude={"refit_growth"}),
        KMEANS_CODE_VERSION,
    )

    def publish(client_id: str) -> tuple[str, dict[str, object]]:
        out_dir = paths.targets(client_id).root
        quality = kmeans_client_targets(
            client_shards(paths, assignments, client_id),
            out_dir,
            policy,
            speaker_sums,
            force=config.force,
            log=context.log.info,
            warn=context.log.warning,
        )
        return quality["data_version"], client_metadata(quality, out_dir)

    yield from per_partition.per_client_events(context, publish)


# --- checks: each reads the published files, independently of how they were written -------------

MIN_PERPLEXITY_SHARE = 0.2
MAX_EMPTY_CLUSTER_SHARE = 0.1


labels_match_shards = labels_match_shards_check(1)


@dg.asset_check(
    asset="kmeans_targets",
    description=(
        f"Cluster use, counted in the published labels: perplexity at least {MIN_PERPLEXITY_SHARE:.0%} of K and at "
        f"most {MAX_EMPTY_CLUSTER_SHARE:.0%} empty clusters per client (a collapsed codebook gives weak targets)."
    ),
)
def clusters_are_used(paths: StoragePaths) -> dg.AssetCheckResult:
    rows = [
        (client, *cluster_use(paths.targets(client).root)) for client in read_clients(paths.layout.clients_file).clients
    ]
    return dg.AssetCheckResult(
        passed=all(row[-1] for row in rows),
        severity=dg.AssetCheckSeverity.WARN,
        metadata={
            "clients": dg.MetadataValue.md(markdown_table(("client", "K", "perplexity / K", "empty", "ok"), rows[:50]))
        },
    )


def cluster_use(out_dir: Path) -> tuple[int, float, int, bool]:
    """K, perplexity / K and empty clusters of the labels in ``out_dir``, and whether they are within bounds."""
    import numpy as np

    from speech_assets.targets.kmeans import cluster_perplexity, empty_clusters

    k = int(np.load(TargetFiles(out_dir).codebook, mmap_mode="r").shape[0])
    values = labels.read_label_columns(TargetFiles(out_dir).labels).values
    counts = np.bincount(values[(values >= 0) & (values < k)], minlength=max(k, 1)).astype(np.int64)
    share = cluster_perplexity(counts) / max(k, 1)
    empty = empty_clusters(counts)
    return k, round(share, 3), empty, share >= MIN_PERPLEXITY_SHARE and empty / max(k, 1) <= MAX_EMPTY_CLUSTER_SHARE
