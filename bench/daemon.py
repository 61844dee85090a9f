"""Daemon benchmark: how long a new speaker's audio takes to reach ``dataset_stats`` under `make ui`.

    python bench/daemon.py [--speakers 13] [--files-per-speaker 16]
    python bench/daemon.py --instance-yaml old.yaml --env SPEECH_ASSETS_SENSOR_INTERVAL_S=60 ...

Starts the real ``dagster dev`` the way `make ui` does (``workspace.yaml`` of the repository,
``scripts/ensure_dagster_home.sh`` copying ``dagster.yaml`` into a temporary ``DAGSTER_HOME``, a
temporary ``SPEECH_ASSETS_DATA_DIR``), on a LibriSpeech-layout FLAC corpus of ``--speakers``
speakers (the committed sample's speakers under new ids, each utterance in two chapters: 13 x 16 =
208 files by default). It turns ``corpus_sensor`` and ``speech_assets_automation`` on through
the webserver's GraphQL API, waits for the initial build the sensors start to finish (every speaker
in ``stats.duckdb`` and no run left), then moves one more speaker's folder into the corpus (one
``rename``: it appears at once) and measures the time until a ``dataset_stats`` materialization
whose database lists that speaker. It prints the timeline from the instance: each sensor and
automation tick that requested something, and each run from queued to dequeued, started, its
materializations and its end.

Everything it starts runs under ``speech_assets.runtime.supervise`` in a process group of its own,
which takes dagster dev's webserver, daemon, code servers and run workers down on exit, on Ctrl-C
and on an exception. A benchmark, not a test: it asserts nothing about time (target, issue 24:
<= 90 s on ~13 speakers / ~200 files on 2 cores).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's speech_assets, here and (PYTHONPATH) in every process it starts
SAMPLE = REPO / "data" / "sample"
BIN = Path(sys.executable).parent
LOCATION = "speech_assets"
SENSORS = ("corpus_sensor", "speech_assets_automation")
START_SENSOR = """
mutation Start($selector: SensorSelector!) {
  startSensor(sensorSelector: $selector) {
    __typename
    ... on Sensor { sensorState { status } }
    ... on PythonError { message }
    ... on SensorNotFoundError { message }
  }
}"""
LOCATION_STATUS = (
    "{ workspaceOrError { ... on Workspace { locationEntries { name loadStatus locationOrLoadError { __typename "
    "} } } } }"
)


def build_corpus(root: Path, speakers: int, files_per_speaker: int) -> list[str]:
    """``speakers`` LibriSpeech-layout speakers made from the sample's: speaker i reads sample
    speaker i mod 8's utterances, copied into ``files_per_speaker / 8`` chapters. Returns the ids."""
    from speech_assets_tests.support.corpora import copy_recording

    sources = sorted(p for p in SAMPLE.iterdir() if p.is_dir())
    copies = max(1, files_per_speaker // 8)
    ids = []
    for index in range(speakers):
        source = sources[index % len(sources)]
        speaker = f"{index // len(sources) + 1}{source.name}"
        ids.append(speaker)
        for flac in sorted(source.rglob("*.flac")):
            src_speaker, chapter, utt = flac.stem.split("-")
            text = dict(
                line.split(" ", 1)
                for line in (flac.parent / f"{src_speaker}-{chapter}.trans.txt").read_text().splitlines()
            )
            for copy in range(copies):
                new_chapter = f"{copy + 1}{chapter}"
                folder = root / speaker / new_chapter
                folder.mkdir(parents=True, exist_ok=True)
                utt_id = f"{speaker}-{new_chapter}-{utt}"
                nudge = (
                    index // len(sources) * copies + copy
                )  # one recording under two ids would be a duplicate_audio reject
                if nudge:
                    copy_recording(flac, folder / f"{utt_id}.flac", nudge)
                else:
                    shutil.copyfile(flac, folder / f"{utt_id}.flac")
                with open(folder / f"{speaker}-{new_chapter}.trans.txt", "a") as handle:
                    handle.write(f"{utt_id} {text[flac.stem]}\n")
    return ids


def graphql(url: str, query: str, variables: dict | None = None) -> dict:
    request = urllib.request.Request(
        url,
        data=json.dumps({"query": query, "variables": variables or {}}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def wait_for(check, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


class DagsterDev:
    """``dagster dev`` as `make ui` runs it, under the subreaper supervisor in its own group."""

    def __init__(self, env: dict[str, str], port: int, log: Path):
        self.env, self.port, self.log = env, port, log
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> DagsterDev:
        from speech_assets.runtime.processes import die_with_parent

        if not (Path(self.env["DAGSTER_HOME"]) / "dagster.yaml").exists():  # else --instance-yaml's, as given
            subprocess.run([str(REPO / "scripts" / "ensure_dagster_home.sh")], env=self.env, check=True)
        command = [
            sys.executable,
            "-m",
            "speech_assets.runtime.supervise",
            "--",
            str(BIN / "dagster"),
            "dev",
            "-w",
            "workspace.yaml",
            "-h",
            "127.0.0.1",
            "-p",
            str(self.port),
        ]
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                command,
                env=self.env,
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=lambda: die_with_parent(signal.SIGTERM),  # noqa: PLW1509
            )
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/graphql"

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def __exit__(self, *exc: object) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # the supervisor stops every descendant
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def tree_cpu_seconds(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) used so far by ``pid`` and each process below it, by pid."""
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    used = {}
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        used[process.pid] = times.user + times.system
    return used


def cpu_used_since(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds between two :func:`tree_cpu_seconds`: what the processes alive at the end used
    since the start (all of it for those started since); a process that ended in between is left
    out (its last seconds are lost, which only under-counts)."""
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())


def speakers_in_database(db: Path) -> set[str] | None:
    """Speakers in stats.duckdb's hours_per_speaker, or None while it cannot be read."""
    import duckdb

    if not db.exists():
        return None
    try:
        con = duckdb.connect(str(db), read_only=True)
    except duckdb.Error:
        return None  # being rewritten (DuckDB allows one writer process and no readers beside it)
    try:
        return {row[0] for row in con.execute("SELECT speaker_id FROM hours_per_speaker").fetchall()}
    except duckdb.Error:
        return None
    finally:
        con.close()


def active_runs(instance) -> list:
    import dagster as dg

    return instance.get_runs(
        filters=dg.RunsFilter(
            statuses=[
                dg.DagsterRunStatus.QUEUED,
                dg.DagsterRunStatus.NOT_STARTED,
                dg.DagsterRunStatus.STARTING,
                dg.DagsterRunStatus.STARTED,
                dg.DagsterRunStatus.CANCELING,
            ]
        )
    )


def timeline(instance, t0: float, t_end: float) -> list[tuple[float, str]]:
    """(seconds after t0, what) for every tick that requested runs and every run created after t0."""
    import dagster as dg
    from dagster._core.definitions.run_request import InstigatorType

    rows: list[tuple[float, str]] = []
    for state in instance.all_instigator_state(instigator_type=InstigatorType.SENSOR):
        ticks = instance.get_ticks(
            state.instigator_origin_id, state.selector_id, after=t0 - 1, before=t_end + 1, limit=500
        )
        requested = [tick for tick in ticks if tick.run_ids]
        for tick in requested:
            took = (tick.end_timestamp or tick.timestamp) - tick.timestamp
            rows.append(
                (
                    tick.timestamp - t0,
                    f"{state.instigator_name} tick ({took:.1f} s) requests {len(tick.run_ids)} run(s): "
                    + ", ".join(run_id[:8] for run_id in tick.run_ids),
                )
            )
        if ticks:
            rows.append(
                (
                    t_end - t0,
                    f"{state.instigator_name}: {len(ticks)} ticks in the window, {len(requested)} requested runs",
                )
            )
    records = instance.get_run_records(
        filters=dg.RunsFilter(created_after=datetime.datetime.fromtimestamp(t0 - 1, datetime.UTC))
    )
    wanted = {
        dg.DagsterEventType.RUN_DEQUEUED,
        dg.DagsterEventType.RUN_STARTING,
        dg.DagsterEventType.RUN_START,
        dg.DagsterEventType.STEP_START,
        dg.DagsterEventType.ASSET_MATERIALIZATION,
        dg.DagsterEventType.RUN_SUCCESS,
        dg.DagsterEventType.RUN_FAILURE,
    }
    for record in sorted(records, key=lambda r: r.create_timestamp.timestamp()):
        run = record.dagster_run
        assets = ",".join(sorted(key.to_user_string() for key in run.asset_selection or []))
        origin = run.tags.get("dagster/sensor_name") or run.tags.get("dagster/schedule_name") or "manual"
        where = run.tags.get("dagster/asset_partition_range_start")
        if where:
            where = f"[{where}..{run.tags.get('dagster/asset_partition_range_end')}]"
        elif run.tags.get("dagster/partition"):
            where = f"[{run.tags['dagster/partition']}]"
        rows.append(
            (
                record.create_timestamp.timestamp() - t0,
                f"run {run.run_id[:8]} {assets}{where or ''} queued (from {origin})",
            )
        )
        seen_steps = set()
        materialized: dict[str, int] = {}
        last_materialization: dict[str, float] = {}
        for entry in instance.all_logs(run.run_id, of_type=wanted):
            event = entry.dagster_event
            kind = event.event_type
            at = entry.timestamp - t0
            if kind == dg.DagsterEventType.ASSET_MATERIALIZATION:
                name = event.asset_key.to_user_string()
                materialized[name] = materialized.get(name, 0) + 1
                last_materialization[name] = at
                continue
            if kind == dg.DagsterEventType.STEP_START:
                if event.step_key in seen_steps:
                    continue
                seen_steps.add(event.step_key)
                rows.append((at, f"run {run.run_id[:8]}   step {event.step_key} starts"))
                continue
            label = {
                dg.DagsterEventType.RUN_DEQUEUED: "dequeued",
                dg.DagsterEventType.RUN_STARTING: "launched",
                dg.DagsterEventType.RUN_START: "worker started",
                dg.DagsterEventType.RUN_SUCCESS: "succeeded",
                dg.DagsterEventType.RUN_FAILURE: "FAILED",
            }.get(kind, kind.value)
            rows.append((at, f"run {run.run_id[:8]}   {label}"))
        for name, at in last_materialization.items():
            count = materialized[name]
            rows.append(
                (at, f"run {run.run_id[:8]}   {name} materialized" + (f" ({count} events)" if count > 1 else ""))
            )
    return sorted(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--speakers", type=int, default=13, help="speakers in the corpus before the new one")
    parser.add_argument("--files-per-speaker", type=int, default=16, help="a multiple of 8")
    parser.add_argument(
        "--instance-yaml",
        type=Path,
        default=None,
        help="use this dagster.yaml instead of the repository's (e.g. an older one: `git show REV:dagster.yaml`)",
    )
    parser.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE", help="extra environment for dagster dev"
    )
    parser.add_argument(
        "--settle", type=float, default=30.0, help="seconds with no run left before the new speaker arrives"
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="give up after this many seconds per phase")
    parser.add_argument("--keep-log", type=Path, default=None, help="copy dagster dev's output here")
    args = parser.parse_args()

    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    memory = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal")) / 2**20
    print(
        f"machine: {cpu}, {os.cpu_count()} logical CPUs, {memory:.0f} GiB; load average at start "
        f"{os.getloadavg()[0]:.2f}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="bench-daemon-") as tmp:
        root = Path(tmp)
        corpus, incoming, home, out = root / "corpus", root / "incoming", root / "dagster_home", root / "out"
        ids = build_corpus(incoming, args.speakers + 1, args.files_per_speaker)
        newcomer = ids[-1]
        corpus.mkdir()
        for speaker in ids[:-1]:
            os.rename(incoming / speaker, corpus / speaker)
        files = sum(1 for _ in corpus.rglob("*.flac"))
        print(
            f"corpus: {args.speakers} speakers, {files} FLAC files; new speaker {newcomer} "
            f"({sum(1 for _ in (incoming / newcomer).rglob('*.flac'))} files)",
            flush=True,
        )
        if args.instance_yaml:
            home.mkdir()
            shutil.copy(args.instance_yaml, home / "dagster.yaml")
        env = {
            **os.environ,
            "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
            "DAGSTER_HOME": str(home),
            "SPEECH_ASSETS_DATA_DIR": str(out),
            "SPEECH_ASSETS_CORPUS": str(corpus),
            "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
        }
        env.pop("MLFLOW_TRACKING_URI", None)
        for item in args.env:
            name, value = item.split("=", 1)
            env[name] = value
        os.environ["DAGSTER_HOME"] = str(home)
        from speech_assets_tests.support.ports import free_port

        dev = DagsterDev(env, free_port(), root / "dagster-dev.log")
        instance = None
        try:
            with dev:
                started = time.monotonic()

                def location_loaded() -> bool:
                    if not dev.alive():
                        raise RuntimeError("dagster dev exited")
                    try:
                        entries = graphql(dev.url, LOCATION_STATUS)["data"]["workspaceOrError"]["locationEntries"]
                    except (OSError, KeyError, TypeError):
                        return False
                    return any(e["name"] == LOCATION and e["loadStatus"] == "LOADED" for e in entries)

                wait_for(location_loaded, args.timeout, "dagster dev's webserver and code location")
                print(f"dagster dev up, code location loaded: {time.monotonic() - started:.1f} s", flush=True)
                import dagster as dg

                instance = dg.DagsterInstance.get()
                settings = instance.get_settings("run_coordinator") or {}
                print(
                    f"run coordinator: {type(instance.run_coordinator).__name__} "
                    f"dequeue every {getattr(instance.run_coordinator, 'dequeue_interval_seconds', '?')} s, "
                    f"threads {getattr(instance.run_coordinator, 'dequeue_use_threads', '?')}; "
                    f"sensors: {instance.get_settings('sensors') or {}}; auto_materialize: "
                    f"{instance.get_settings('auto_materialize') or {}}" + (f"; {settings}" if settings else ""),
                    flush=True,
                )
                turned_on = time.time()
                for sensor in SENSORS:
                    answer = graphql(
                        dev.url,
                        START_SENSOR,
                        {
                            "selector": {
                                "repositoryLocationName": LOCATION,
                                "repositoryName": "__repository__",
                                "sensorName": sensor,
                            }
                        },
                    )
                    result = answer.get("data", {}).get("startSensor") or answer
                    if result.get("__typename") != "Sensor":
                        raise RuntimeError(f"could not start {sensor}: {result}")
                print(f"sensors on: {', '.join(SENSORS)}", flush=True)

                db = out / "stats.duckdb"
                quiet_since: list[float] = []

                def built() -> bool:
                    if not dev.alive():
                        raise RuntimeError("dagster dev exited")
                    failed = instance.get_runs(filters=dg.RunsFilter(statuses=[dg.DagsterRunStatus.FAILURE]))
                    if failed:
                        raise RuntimeError(f"run(s) failed: {[r.run_id for r in failed]}")
                    listed = speakers_in_database(db) if not active_runs(instance) else None
                    if listed is None or set(ids[:-1]) - listed:
                        quiet_since.clear()
                        return False
                    if not quiet_since:
                        quiet_since.extend([time.monotonic(), tree_cpu_seconds(dev.process.pid)])
                    return time.monotonic() - quiet_since[0] >= args.settle

                wait_for(built, args.timeout, "the initial build", interval=1.0)
                initial = time.time() - turned_on
                idle_cpu = cpu_used_since(quiet_since[1], tree_cpu_seconds(dev.process.pid)) / (
                    time.monotonic() - quiet_since[0]
                )
                runs_before = len(instance.get_runs())
                print(
                    f"initial build by the sensors and automation: {initial - args.settle:.1f} s "
                    f"({runs_before} runs), then {args.settle:.0f} s with no run, in which dagster dev's processes "
                    f"used {idle_cpu:.1%} of one core (sensor and automation ticks, run queue, webserver)",
                    flush=True,
                )

                os.rename(incoming / newcomer, corpus / newcomer)
                t0 = time.time()
                print(
                    f"new speaker {newcomer} moved into the corpus at "
                    f"{datetime.datetime.fromtimestamp(t0):%H:%M:%S.%f}",
                    flush=True,
                )

                looked_at = {
                    "storage_id": instance.fetch_materializations(dg.AssetKey("dataset_stats"), limit=1)
                    .records[0]
                    .storage_id
                }

                def arrived() -> float | None:
                    """The time of the first dataset_stats materialization after t0 whose database
                    lists the newcomer: read as soon as each new one is recorded (the file can
                    change before its materialization is recorded, never after)."""
                    if not dev.alive():
                        raise RuntimeError("dagster dev exited")
                    records = instance.fetch_materializations(dg.AssetKey("dataset_stats"), limit=1).records
                    if not records or records[0].storage_id == looked_at["storage_id"]:
                        return None
                    listed = speakers_in_database(db)
                    if listed is None:
                        return None  # being written: look again
                    looked_at["storage_id"] = records[0].storage_id
                    return records[0].timestamp if newcomer in listed else None

                t_first = wait_for(arrived, args.timeout, f"dataset_stats with {newcomer}", interval=0.5)
                seen = time.time() - t0
                # then until the chain is over: no run left for --settle seconds (a dataset_stats
                # run may have come before the new speaker's k-means targets; the one after counts)
                idle: list[float] = []

                def chain_over() -> bool:
                    if active_runs(instance):
                        idle.clear()
                        return False
                    if not idle:
                        idle.append(time.monotonic())
                    return time.monotonic() - idle[0] >= args.settle

                wait_for(chain_over, args.timeout, "the runs the new speaker started to end", interval=0.5)
                failed = instance.get_runs(filters=dg.RunsFilter(statuses=[dg.DagsterRunStatus.FAILURE]))
                stats = [
                    r.timestamp
                    for r in instance.fetch_materializations(dg.AssetKey("dataset_stats"), limit=20).records
                    if r.timestamp > t0
                ]
                kmeans = [
                    r.timestamp
                    for r in instance.fetch_materializations(dg.AssetKey("kmeans_targets"), limit=50).records
                    if r.timestamp > t0
                ]
                t_done = max(stats)
                print(
                    f"\nfirst dataset_stats listing {newcomer}: {t_first - t0:.1f} s (seen by the benchmark "
                    f"at {seen:.1f} s); "
                    f"{len(stats)} dataset_stats and {len(kmeans)} kmeans_targets materializations after the "
                    f"new speaker" + (f"; FAILED runs: {[r.run_id[:8] for r in failed]}" if failed else "")
                )
                last_kmeans = max(kmeans) if kmeans else None
                ordered = last_kmeans is None or t_done > last_kmeans
                print(
                    f"new speaker -> the last dataset_stats (after the last kmeans_targets: "
                    f"{'yes' if ordered else 'NO'}): "
                    f"{t_done - t0:.1f} s; target <= 90 s: {'PASS' if t_done - t0 <= 90 else 'FAIL'}; "
                    f"load average now {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
                print("\ntimeline (s after the new speaker's folder appeared):")
                for at, what in timeline(instance, t0, t_done):
                    print(f"  {at:7.1f}  {what}")
        except BaseException:
            if dev.log.exists():
                print("".join(dev.log.read_text().splitlines(keepends=True)[-60:]), file=sys.stderr)
            raise
        finally:
            if instance is not None:
                instance.dispose()
            if args.keep_log and dev.log.exists():
                shutil.copy(dev.log, args.keep_log)


if __name__ == "__main__":
    main()
