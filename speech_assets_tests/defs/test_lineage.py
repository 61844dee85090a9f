"""What Dagster reports as stale or in sync matches what is on disk, through its own stale-status API.

Every partition's data version is its own content hash, whether it was built alone or with
others; re-running an unchanged partition leaves everything downstream in sync; changing one
speaker's audio makes exactly that speaker's shard and what depends on it stale.
"""

from __future__ import annotations

import json
import shutil

import dagster as dg
import numpy as np
import pytest
import soundfile as sf
from dagster._core.definitions.data_version import CachingStaleStatusResolver, StaleStatus
from dagster._core.loader import LoadingContextForTest

from speech_assets.definitions import build_definitions
from speech_assets.defs.resources import KMeansSettings, PipelineSettings, StoragePaths
from speech_assets.utils import sha256_file
from speech_assets_tests.conftest import SAMPLE_CORPUS, fresh_instance
from speech_assets_tests.support.corpora import write_flac
from speech_assets_tests.support.local_runs import materialize_in_process

DOWNSTREAM_OF_SHARDS = ("cmvn_stats", "client_partitions", "dataset_stats")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("lineage")
    corpus = root / "corpus"
    shutil.copytree(SAMPLE_CORPUS, corpus)
    # two rejects the report can play: one too short (the manifest's), one silent (the VAD's)
    chapter = corpus / "1001" / "100101"
    write_flac(chapter / "1001-100101-0090.flac", seconds=0.2)
    sf.write(
        chapter / "1001-100101-0091.flac",
        1e-4 * np.random.default_rng(0).standard_normal(32_000),
        16_000,
        format="FLAC",
    )
    with open(chapter / "1001-100101.trans.txt", "a", encoding="utf-8") as transcripts:
        transcripts.write("1001-100101-0090 TOO SHORT\n1001-100101-0091 ONLY SILENCE\n")
    paths = StoragePaths(corpus=str(corpus), data_dir=str(root / "out"), mlflow_tracking_uri=f"sqlite:///{root}/m.db")
    with fresh_instance(root) as instance:
        defs = build_definitions(paths, PipelineSettings(kmeans=KMeansSettings(k=16)))
        materialize_in_process(defs, instance, "manifest")
        speakers = list(instance.get_dynamic_partitions("speakers"))
        materialize_in_process(defs, instance, "vad_features", speakers)  # all shards in ONE run
        materialize_in_process(defs, instance, "cmvn_stats")
        materialize_in_process(defs, instance, "client_partitions")
        materialize_in_process(defs, instance, "kmeans_targets", list(instance.get_dynamic_partitions("clients")))
        materialize_in_process(defs, instance, "dataset_stats")
        yield defs, instance, paths, corpus, speakers


def status(defs: dg.Definitions, instance: dg.DagsterInstance, asset: str, partition: str | None = None) -> StaleStatus:
    resolver = CachingStaleStatusResolver(instance, defs.resolve_asset_graph(), LoadingContextForTest(instance))
    return resolver.get_status(dg.AssetKey(asset), partition)


def data_version(instance: dg.DagsterInstance, asset: str, partition: str) -> str:
    (record,) = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[partition]), limit=1
    ).records
    return record.asset_materialization.tags["dagster/data_version"]


def latest_event_id(instance: dg.DagsterInstance) -> int:
    return instance.event_log_storage.get_maximum_record_id() or 0


def observed_since(instance: dg.DagsterInstance, storage_id: int) -> list[str]:
    """speaker_manifest partitions observed after ``storage_id``."""
    records = instance.fetch_observations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("speaker_manifest"), after_storage_id=storage_id), limit=10_000
    ).records
    return sorted(r.partition_key for r in records)


def everything_in_sync(defs, instance, speakers: list[str]) -> dict[str, StaleStatus]:
    statuses = {f"vad_features[{s}]": status(defs, instance, "vad_features", s) for s in speakers}
    statuses |= {key: status(defs, instance, key) for key in DOWNSTREAM_OF_SHARDS}
    statuses |= {
        f"kmeans_targets[{c}]": status(defs, instance, "kmeans_targets", c)
        for c in instance.get_dynamic_partitions("clients")
    }
    return {key: value for key, value in statuses.items() if value != StaleStatus.FRESH}


def test_partitions_built_together_carry_their_own_content_hash(built) -> None:
    _defs, instance, paths, _corpus, speakers = built
    versions = {s: data_version(instance, "vad_features", s) for s in speakers}
    assert versions == {s: sha256_file(paths.shard_file(s)) for s in speakers}
    assert len(set(versions.values())) == len(speakers)
    for client in instance.get_dynamic_partitions("clients"):
        quality = (paths.targets(client).root / "quality.json").read_text()
        assert data_version(instance, "kmeans_targets", client) in quality


def test_dataset_stats_shows_its_report_as_a_path_with_a_header_and_playable_rejects(built) -> None:
    """The UI gets the report's path (a browser refuses file:// links from the UI's http page);
    the page names the Dagster run that built it, and each reject it plays is a copied clip."""
    import re

    from speech_assets.locations import git_commit

    _, instance, paths, corpus, _ = built
    (record,) = instance.fetch_materializations(dg.AssetKey("dataset_stats"), limit=1).records
    metadata = record.asset_materialization.metadata
    assert isinstance(metadata["report"], dg.PathMetadataValue)
    assert not [
        key
        for key, value in metadata.items()
        if isinstance(value, dg.UrlMetadataValue) and value.url.startswith("file:")
    ]
    page = paths.layout.report.root / "index.html"
    assert metadata["report"].path == str(page.resolve())
    text = page.read_text()
    header = text.split("<h2>About this report</h2>", 1)[1]  # the report ends with its header
    assert f"<th>Dagster run</th><td>{record.run_id}</td>" in header and f"<th>corpus</th><td>{corpus}</td>" in header
    assert f'title="{git_commit()}"' in header and "<th>settings hash</th>" in header and "<th>built at</th>" in header
    sources = re.findall(r'<audio controls preload="metadata" src="(audio/reject-[0-9a-f]{24}\.flac)"></audio>', text)
    import duckdb

    with duckdb.connect(str(paths.layout.stats_db), read_only=True) as con:
        playable = con.execute(
            "SELECT count(*) FROM (SELECT *, row_number() OVER (PARTITION BY stage, reason ORDER BY utt_id) "
            "AS n FROM rejects) "
            "WHERE n <= 3 AND reason NOT IN ('missing_file', 'unreadable', 'outside_root')"
        ).fetchone()[0]
    assert (
        playable == 2
        and len(sources) == playable
        and all((paths.layout.report.root / src).is_file() for src in sources)
    )
    examples = text.split("<h2>Reject examples</h2>", 1)[1].split("</section>", 1)[0]
    assert examples.count('<img class="vad"') == examples.count(
        "<td>no_speech</td>"
    )  # the VAD decision for each no_speech reject


def test_rerunning_an_unchanged_partition_leaves_downstream_in_sync(built) -> None:
    defs, instance, _paths, _corpus, speakers = built
    assert everything_in_sync(defs, instance, speakers) == {}
    mark = latest_event_id(instance)
    materialize_in_process(defs, instance, "manifest")  # the same corpus again: no speaker's rows changed
    assert observed_since(instance, mark) == []
    before = data_version(instance, "vad_features", speakers[3])
    materialize_in_process(defs, instance, "vad_features", [speakers[3]])
    materialize_in_process(defs, instance, "kmeans_targets", ["client_01"])
    assert data_version(instance, "vad_features", speakers[3]) == before
    assert everything_in_sync(defs, instance, speakers) == {}


def test_changing_one_speakers_audio_makes_exactly_its_dependents_stale(built) -> None:
    defs, instance, paths, corpus, speakers = built
    changed = speakers[5]
    flac = sorted((corpus / changed).rglob("*.flac"))[0]
    audio, rate = sf.read(flac, dtype="float32")
    sf.write(flac, (audio * 0.5).astype(np.float32), rate, format="FLAC", subtype="PCM_16")

    mark = latest_event_id(instance)
    materialize_in_process(defs, instance, "manifest")
    # the manifest run recorded a new rows version for the changed speaker only: no event at all
    # for the others, and no run of speaker_manifest
    assert observed_since(instance, mark) == [changed]
    assert status(defs, instance, "vad_features", changed) == StaleStatus.STALE
    assert {s for s in speakers if status(defs, instance, "vad_features", s) != StaleStatus.FRESH} == {changed}
    assert {s for s in speakers if status(defs, instance, "speaker_manifest", s) != StaleStatus.FRESH} == set()
    # what a shard records of its input: its own speaker's rows, their version and observation
    (record,) = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("vad_features"), asset_partitions=[speakers[0]]), limit=1
    ).records
    (observed,) = instance.fetch_observations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("speaker_manifest"), asset_partitions=[speakers[0]]), limit=1
    ).records
    tags = record.asset_materialization.tags
    assert tags["dagster/input_event_pointer/speaker_manifest"] == str(observed.storage_id)
    assert (
        tags["dagster/input_data_version/speaker_manifest"] == observed.asset_observation.tags["dagster/data_version"]
    )
    assert (
        json.loads(paths.shard_files(speakers[0]).meta.read_text())["speaker_manifest_hash"]
        == observed.asset_observation.tags["dagster/data_version"]
    )

    materialize_in_process(defs, instance, "vad_features", [changed])
    assert data_version(instance, "vad_features", changed) == sha256_file(paths.shard_file(changed))
    # Dagster's staleness is about direct inputs whose data version changed: the assets that read
    # the shards (client_partitions reads cmvn_stats, whose version changes once it is rebuilt).
    stale = everything_in_sync(defs, instance, speakers)
    readers = {
        "cmvn_stats",
        "dataset_stats",
        *(f"kmeans_targets[{c}]" for c in instance.get_dynamic_partitions("clients")),
    }
    assert set(stale) == readers
    assert set(stale.values()) == {StaleStatus.STALE}
