"""Fresh-data automation: a corpus sensor, a re-validation schedule, and declarative automation.

Everything starts STOPPED (docs/OPERATIONS.md, "Fresh data"). ``corpus_sensor`` requests a
``manifest`` run when the corpus fingerprint changes, then ``vad_features`` runs for exactly the
speakers whose rows changed; downstream assets follow their ``AutomationCondition``s
(``conditions.py``).
"""

import itertools
import json
import os

import dagster as dg

from speech_assets.corpus.audit import AUDITS
from speech_assets.corpus.manifest import CorpusError, check_corpus_location, corpus_fingerprint
from speech_assets.corpus.publish import SpeakerRows
from speech_assets.defs.lineage import latest_metadata
from speech_assets.defs.partitions import PARTITION_RANGE_END, PARTITION_RANGE_START, speakers_partitions
from speech_assets.defs.per_partition import speaker_observations
from speech_assets.defs.resources import StoragePaths
from speech_assets.defs.runs import IN_PROCESS_TAG
from speech_assets.utils import sha256_strings

REVALIDATE_CRON = os.environ.get("SPEECH_ASSETS_REVALIDATE_CRON", "0 2 * * *")
# Fresh audio takes five hops, each waiting for the next tick (docs/BENCHMARKS.md). The daemon's
# loops come round every 5 s and skip a sensor until its interval has passed since its last tick
# *ended*: 5 would skip every other loop, 2 means every loop. corpus_sensor stats every corpus
# file each tick (~1-2 s for 10,000: raise it for large corpora).
CORPUS_SENSOR_INTERVAL_S = int(os.environ.get("SPEECH_ASSETS_CORPUS_SENSOR_INTERVAL_S", "2"))
AUTOMATION_INTERVAL_S = int(os.environ.get("SPEECH_ASSETS_AUTOMATION_INTERVAL_S", "2"))
# The sensors' runs are small and many: their steps run in the run worker, not in forked step
# processes (see speech_assets/defs/runs.py; training, in a pool, keeps its own processes).
SENSOR_RUN_TAGS = {IN_PROCESS_TAG: "true"}
# The request a shard run answers (speaker range + the rows' hashes), beside Dagster's run key: a
# canceled run is asked for again under a new key, a failed one is not (it would fail again).
SHARD_REQUEST_TAG = "speech_assets/shard_request"
MANIFEST_CHECKS = [dg.AssetCheckKey(dg.AssetKey("manifest"), name) for name in AUDITS]


def stale_speakers(paths: StoragePaths, listed: dict[str, SpeakerRows]) -> dict[str, str]:
    """Speakers whose shard is missing or was built from other manifest rows -> current hash."""
    built = {s: (paths.shard_files(s).read_meta() or {}).get("speaker_manifest_hash") for s in listed}
    return {s: row.manifest_hash for s, row in listed.items() if built[s] != row.manifest_hash}


@dg.sensor(
    name="corpus_sensor",
    minimum_interval_seconds=CORPUS_SENSOR_INTERVAL_S,
    default_status=dg.DefaultSensorStatus.STOPPED,
    target=["manifest", "vad_features"],
    description="Watches the corpus for new or changed audio and requests only the work it implies.",
)
def corpus_sensor(context: dg.SensorEvaluationContext, paths: StoragePaths) -> dg.SensorResult | dg.SkipReason:
    fingerprint = corpus_fingerprint(paths.corpus_path)
    if not fingerprint:
        return dg.SkipReason(f"corpus {paths.corpus_path} does not exist")
    cursor = json.dumps({"fingerprint": fingerprint})
    seen = latest_metadata(context.instance, "manifest").get("corpus_fingerprint")
    if seen != fingerprint:
        try:
            check_corpus_location(paths.corpus_path)
        except CorpusError as err:
            return unreadable_corpus(context, fingerprint, str(err))
        return dg.SensorResult(
            run_requests=[
                dg.RunRequest(
                    run_key=f"manifest:{fingerprint}", asset_selection=[dg.AssetKey("manifest")], tags=SENSOR_RUN_TAGS
                )
            ],
            cursor=cursor,
        )
    records = context.instance.event_log_storage.get_latest_asset_check_execution_by_key(MANIFEST_CHECKS)
    if failed := [
        key.name for key, record in records.items() if record is not None and record.status.value == "FAILED"
    ]:
        return dg.SkipReason(
            f"the last manifest was not published: check(s) {', '.join(failed)} failed; fix the corpus "
            "(or the [manifest] settings) and the next corpus change re-validates it"
        )
    registered = list(context.instance.get_dynamic_partitions(speakers_partitions.name))
    listed = paths.listed_speakers()
    new = sorted(set(listed) - set(registered))
    order = registered + new  # new partitions are appended in this order
    add = [speakers_partitions.build_add_request(new)] if new else []
    # The manifest run records the speakers' rows versions (speaker_manifest observations) for the
    # speakers whose rows changed; any it could not record (a run killed after publishing, a
    # manifest from before observations) are recorded here, without a run. Normally none.
    observations = speaker_observations(context.instance, listed, order)
    stale = stale_speakers(paths, listed)
    if not stale:
        return dg.SensorResult(skip_reason="every shard is up to date", cursor=cursor, asset_events=observations)
    return dg.SensorResult(
        dynamic_partitions_requests=add,
        asset_events=observations,
        run_requests=[
            dg.RunRequest(
                run_key=shard_run_key(context.instance, request),
                asset_selection=[dg.AssetKey("vad_features")],
                tags={
                    **SENSOR_RUN_TAGS,
                    PARTITION_RANGE_START: first,
                    PARTITION_RANGE_END: last,
                    SHARD_REQUEST_TAG: request,
                },
            )
            for first, last, keys in contiguous_ranges(order, set(stale))
            for request in [f"shards:{first}...{last}:" + sha256_strings(f"{s}:{stale[s]}" for s in keys)]
        ],
        cursor=cursor,
    )


def unreadable_corpus(context: dg.SensorEvaluationContext, fingerprint: str, problem: str) -> dg.SensorResult:
    """A corpus that cannot be read at all: logged once per fingerprint (kept in the cursor), never a
    failed tick, and no manifest run that could only fail the same way."""
    try:
        reported = json.loads(context.cursor or "{}").get("unreadable")
    except (ValueError, AttributeError):
        reported = None
    if reported == fingerprint:
        return dg.SensorResult(
            skip_reason=(
                "the corpus still cannot be read (the error was logged when it changed); waiting for it to change"
            ),
            cursor=context.cursor,
        )
    context.log.error(f"corpus cannot be read, no manifest run requested until it changes: {problem}")
    return dg.SensorResult(
        skip_reason=f"corpus cannot be read: {problem}",
        cursor=json.dumps({"fingerprint": fingerprint, "unreadable": fingerprint}),
    )


def shard_run_key(instance: dg.DagsterInstance, request: str) -> str:
    """The request itself until a run for it is canceled: the daemon launches a run key once, so each
    canceled run gives the next attempt a key of its own (else the speakers stay unbuilt)."""
    runs = instance.get_runs(filters=dg.RunsFilter(tags={SHARD_REQUEST_TAG: request}))
    canceled = sum(run.status == dg.DagsterRunStatus.CANCELED for run in runs)
    return f"{request}:retry{canceled}" if canceled else request


def contiguous_ranges(order: list[str], wanted: set[str]) -> list[tuple[str, str, list[str]]]:
    """Group ``wanted`` keys into neighbours in partition order: one run per range, so unchanged
    shards never fall inside a range."""
    ranges = [list(keys) for is_wanted, keys in itertools.groupby(order, wanted.__contains__) if is_wanted]
    return [(keys[0], keys[-1], keys) for keys in ranges]


revalidate_corpus = dg.ScheduleDefinition(
    name="revalidate_corpus",
    cron_schedule=REVALIDATE_CRON,
    target=["manifest"],
    default_status=dg.DefaultScheduleStatus.STOPPED,
    description="Re-validates the whole corpus (decode cache makes unchanged files free).",
)

automation_sensor = dg.AutomationConditionSensorDefinition(
    "speech_assets_automation",
    target=dg.AssetSelection.all(),
    default_status=dg.DefaultSensorStatus.STOPPED,
    minimum_interval_seconds=AUTOMATION_INTERVAL_S,
    run_tags=SENSOR_RUN_TAGS,
    # Several clients' kmeans_targets go to one backfill (Dagster's default, kept: one run whose
    # checks read every client's files, never mid-write). A backfill advances one dependency level
    # per 30 s loop, so conditions.py keeps kmeans_targets alone in its tick.
)
