"""Stage 3: per-client k-means targets (the clients themselves: defs/clients.py)."""

from collections.abc import Callable, Iterator
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq

from speech_assets.features import cmvn
from speech_assets.corpus.clients import read_clients
from speech_assets.targets import labels
from speech_assets.layout import TargetFiles
from speech_assets.defs.conditions import follow_upstream
from speech_assets.defs.lineage import input_provenance, markdown_table, partition_materialization, shard_hashes, step_events
from speech_assets.defs.progress import ProgressLog
from speech_assets.defs.partitions import ALL_SHARDS, clients_partitions
from speech_assets.defs.resources import (
    KMeansSettings,
    PipelineSettings,
    StoragePaths,
    effective,
    overrides_of,
)
from speech_assets.targets.publish import ClientShards, KMeansPolicy, kmeans_client_targets

KMEANS_CODE_VERSION = "kmeans-v3"  # v2: held-out speakers are labelled, never fitted; v3: labelled on one faiss thread


class KMeansOverrides(overrides_of(KMeansSettings)):
    """Run-config overrides of the `[kmeans]` settings for one manual run."""

    force: bool = False  # refit even when this client's inputs are unchanged


@dg.asset(
    group_name="clients",
    partitions_def=clients_partitions,
    backfill_policy=dg.BackfillPolicy.single_run(),
    deps=[
        "client_partitions",
        "cmvn_stats",
        ALL_SHARDS,
    ],
    code_version=KMEANS_CODE_VERSION,
    # client_partitions is rebuilt after every shard or CMVN update: react to it, not to them
    automation_condition=follow_upstream(ignore_updates_of=["vad_features", "cmvn_stats"]),
    kinds={"faiss"},
    output_required=False,  # one materialization per client, each with its own content hash
)
def kmeans_targets(
    context: dg.AssetExecutionContext, config: KMeansOverrides, paths: StoragePaths, settings: PipelineSettings
) -> Iterator[object]:
    """Per client: k-means on that client's own CMVN-normalised MFCC frames (federated HuBERT),
    codebook and int16 labels per utterance at 50 Hz."""
    kmeans = effective(settings.kmeans, config)
    assignments = read_clients(paths.clients_file)
    speaker_sums = cmvn.ShardStats.load(paths.cmvn.speaker_sums)
    provenance = input_provenance(context)
    clients = list(context.partition_keys)
    progress = ProgressLog(context.log, "clients")
    published = []
    policy = KMeansPolicy(
        kmeans.k, kmeans.max_fit_frames, kmeans.seed, kmeans.refit_growth, kmeans.model_dump_json(exclude={"refit_growth"}),
        KMEANS_CODE_VERSION,
    )  # fmt: skip
    for done, client_id in enumerate(clients, start=1):
        speakers = sorted(a.speaker_id for a in assignments if a.client_id == client_id)
        heldout = sorted(a.speaker_id for a in assignments if a.client_id == client_id and a.heldout)
        if not speakers:
            raise dg.Failure(description=f"{client_id} has no speakers: lower num_clients or add data")
        client = ClientShards(client_id, speakers, heldout, shard_hashes(paths, speakers, f" of {client_id}"), paths.shard_file)
        quality = kmeans_client_targets(
            client, paths.kmeans_dir(client_id), policy, speaker_sums, force=config.force, log=context.log.info,
            warn=context.log.warning,
        )  # fmt: skip
        published.append(
            partition_materialization(
                context, client_id, quality["data_version"], client_metadata(quality, paths.kmeans_dir(client_id)), provenance
            )
        )
        progress(client_id, done, len(clients))
    yield from step_events(context, published)


def client_metadata(quality: dict, out_dir) -> dict[str, object]:
    """One client's page: its own quality figures (plotted across partitions) and a bounded speaker list."""
    speakers = quality["speakers"]
    shown = speakers[:MAX_LISTED]
    listing = ", ".join(shown) + (f" ... and {len(speakers) - len(shown)} more" if len(speakers) > len(shown) else "")
    return {
        "k": quality["k"],
        "frames_fit": quality["frames_fit"],
        "frames_labelled": quality["frames_labelled"],
        "inertia_per_frame": round(quality["inertia_per_frame"], 3),
        "perplexity": round(quality["perplexity"], 1),
        "perplexity_share_of_k": round(quality["perplexity"] / max(quality["k"], 1), 3),
        "empty_clusters": quality["empty_clusters"],
        "mean_segment_length": round(quality["mean_segment_length"], 2),
        "mode": quality.get("mode", "refit"),
        "speakers": len(speakers),
        "speaker_ids": dg.MetadataValue.md(listing),
        "codebook_speakers": len(quality.get("codebook_speakers", speakers)),
        "label_rate_hz": 50,
        "cluster_sizes": dg.MetadataValue.md(_cluster_size_plot(out_dir, quality["client_id"])),
        "path": dg.MetadataValue.path(str(out_dir)),
    }


def _cluster_size_plot(out_dir, client_id: str) -> str:
    import numpy as np

    from speech_assets.stats import plots
    from speech_assets.targets.build import STATE_FILE

    with np.load(out_dir / STATE_FILE) as state:
        counts = state["counts"]
    return plots.markdown_image(plots.cluster_sizes({client_id: counts}), f"{client_id} cluster sizes")


MAX_LISTED = 50


# --- checks: each reads the published files, independently of how they were written -------------

MIN_PERPLEXITY_SHARE = 0.2
MAX_EMPTY_CLUSTER_SHARE = 0.1


@dg.asset_check(asset="kmeans_targets", blocking=True, description=(
    "Every client's labels cover exactly its speakers' utterances, one label per 50 Hz frame "
    "((num_frames + 1) // 2), every label a valid cluster id of its codebook."
))
def labels_match_shards(paths: StoragePaths) -> dg.AssetCheckResult:
    return labels_check_result(label_problems(paths, paths.kmeans_dir))


def label_problems(paths: StoragePaths, targets_dir: Callable[[str], Path]) -> list[str]:
    """What is wrong with every registered client's ``targets_dir(client)/labels.parquet`` against
    the shards of its speakers: utterances missing or foreign, label counts other than one per
    50 Hz frame, ids outside the client's codebook (``codebook.npy``)."""
    import numpy as np

    assignments = read_clients(paths.clients_file)
    problems: list[str] = []
    for client in assignments.clients:
        out = targets_dir(client)
        files = TargetFiles(out)
        if not files.codebook.is_file() or not files.labels.is_file():
            problems.append(f"{client}: no codebook.npy or labels.parquet in {out}")
            continue
        k = int(np.load(files.codebook, mmap_mode="r").shape[0])
        found = labels.read_label_columns(files.labels)
        expected: dict[str, int] = {}
        for speaker in (a.speaker_id for a in assignments if a.client_id == client):
            table = pq.ParquetFile(paths.shard_file(speaker)).read(columns=["utt_id", "num_frames"])
            expected |= dict(zip(table.column(0).to_pylist(), table.column(1).to_pylist(), strict=True))
        lengths = dict(zip(found.utt_ids, found.lengths.tolist(), strict=True))
        if set(lengths) != set(expected):
            problems.append(f"{client}: {len(set(expected) - set(lengths))} utterance(s) unlabelled, {len(set(lengths) - set(expected))} foreign")
        # ids are checked over all of the client's labels at once; per utterance only if some fail
        outside = (found.values < 0) | (found.values >= k)
        bad_ids = set()
        if outside.any():
            owner = np.repeat(np.arange(len(found.utt_ids)), found.lengths)  # label -> its utterance
            bad_ids = {found.utt_ids[i] for i in np.unique(owner[outside]).tolist()}
        for utt, frames in expected.items():
            count = lengths.get(utt)
            if count is None:
                continue
            if count != (frames + 1) // 2 or utt in bad_ids:
                problems.append(f"{client}/{utt}: {count} labels for {frames} frames or ids outside [0, {k})")
    return problems


def labels_check_result(problems: list[str]) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(
        passed=not problems,
        severity=dg.AssetCheckSeverity.ERROR,
        metadata={"problems": len(problems), "first_problems": dg.MetadataValue.md("\n".join(f"- {p}" for p in problems[:20]) or "none")},
    )


@dg.asset_check(asset="kmeans_targets", description=(
    f"Cluster use, counted in the published labels: perplexity at least {MIN_PERPLEXITY_SHARE:.0%} of K "
    f"and at most {MAX_EMPTY_CLUSTER_SHARE:.0%} empty clusters per client (a collapsed codebook gives weak targets)."
))
def clusters_are_used(paths: StoragePaths) -> dg.AssetCheckResult:
    rows = [(client, *cluster_use(paths.kmeans_dir(client))) for client in read_clients(paths.clients_file).clients]
    return dg.AssetCheckResult(
        passed=all(row[-1] for row in rows),
        severity=dg.AssetCheckSeverity.WARN,
        metadata={"clients": dg.MetadataValue.md(markdown_table(("client", "K", "perplexity / K", "empty", "ok"), rows[:50]))},
    )


def cluster_use(out_dir: Path) -> tuple[int, float, int, bool]:
    """K (codebook rows), perplexity / K and empty clusters of the labels in ``out_dir``, and
    whether they are within the bounds."""
    import numpy as np

    from speech_assets.targets.kmeans import cluster_perplexity, empty_clusters

    k = int(np.load(TargetFiles(out_dir).codebook, mmap_mode="r").shape[0])
    values = labels.read_label_columns(TargetFiles(out_dir).labels).values
    counts = np.bincount(values[(values >= 0) & (values < k)], minlength=max(k, 1)).astype(np.int64)
    share = cluster_perplexity(counts) / max(k, 1)
    empty = empty_clusters(counts)
    return k, round(share, 3), empty, share >= MIN_PERPLEXITY_SHARE and empty / max(k, 1) <= MAX_EMPTY_CLUSTER_SHARE
