"""The learning benchmark: does pretraining beat log-mel features on held-out speakers, at equal compute?

    # full: ~2.2 h, 48 voices, ~45 min on 2 cores (+ ~12 min synth once)
    python bench/learning.py --out /tmp/learning.md
    python bench/learning.py --smoke --out /tmp/learning.md    # a tiny corpus and budgets: checks the script end to end
    python bench/learning.py --scale 2 --set federated_checkpoint.eta=0.1   # longer budgets, one knob changed

1. Builds (or reuses, from ``--corpus-cache``) a synthetic corpus with ``speech-assets corpus synth``
   from the TTS engines Debian and PyPI provide (docs/USER_GUIDE.md, "Making a corpus offline"); the full run asks
   for at least 2 hours and 40 distinct voices and stops if the engines installed here give less.
2. Runs the asset graph end to end through Dagster, each stage a ``dagster asset materialize`` run
   (as scripts/materialize_all.sh does) against a fresh DAGSTER_HOME and data dir under ``--work``:
   manifest -> vad_features -> cmvn_stats, client_partitions -> kmeans_targets ->
   pretrained_checkpoint (torchrun) -> federated_checkpoint (Flower) -> distilled_checkpoint ->
   kmeans_targets_iter2 -> pretrained_checkpoint_iter2 -> downstream_probe (``--probe-seeds`` seeds)
   -> finetuned_asr (CTC fine-tuning of the centralised encoder and of the same architecture from
   scratch on the same labelled subsets of the training speakers, ``--finetune-minutes`` budgets x
   ``--finetune-seeds`` seeds, greedy and n-gram beam decoding; issue 44: each model's peak lr chosen
   once on the dev speakers from [finetune] lr_grid at the smallest budget and first seed, every run
   evaluated on dev every ``eval_every`` steps, its best checkpoint kept and stopped after
   ``patience`` evaluations without a better dev CER, up to ``--finetune-steps``). ``--stages`` runs
   a subset, e.g. ``--stages data,centralised,probe,finetune`` (the fine-tuning table without the
   federation; about 40 min for its finetune stage on 2 idle cores, see `stage_estimates`).
   The synthesized corpus uses ``corpus synth --distinct-sentences``: no sentence is read twice, so
   the held-out speakers' sentences never occur among the labelled, dev or LM text.
   Budgets come from the flags (run config); every other knob from pipeline.toml
   (or ``--settings``); ``--set asset.key=value`` changes one knob of one asset for this run.
3. Equal compute: the federation gets the centralised run's audio seconds of local training,
   rounds x local_steps x clients x federated batch = max_steps x centralised batch
   (local_steps is derived); both totals are printed, budgeted and measured.
4. Reports, as markdown (stdout and ``--out``) and JSON (``--json``, default ``--out`` with .json):
   held-out CER and WER per encoder as mean +- standard deviation over the probe seeds, held-out
   masked accuracy against the majority-class rate (leak-free frames when the run records them),
   the issue-22 targets checked one by one, the fine-tuning table per labelled budget and its
   targets (issue 38), the machine, the budgets and each stage's wall time.

The work folder keeps every stage's log (``<work>/run-*/logs``) and the data dir for inspection.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # speech_assets_tests.support (in-process runs) from `python bench/learning.py`
BIN = Path(sys.executable).parent
CODE_LOCATION = "speech_assets.definitions"
MIN_FULL_HOURS = 2.0
MIN_FULL_VOICES = 40
MIN_FINETUNE_TRAINING_HOURS = 1.5  # the 60-minute labelled budget, the dev speakers and room to draw subsets

# The probe's model names (speech_assets/evaluation/compare.py, defs/probe.py) and how the table names them.
MODEL_LABELS = {
    "fbank": "fbank (log-mel input)",
    "random": "random `tiny`",
    "pretrained": "centralised = iteration 1 (pretrained_checkpoint)",
    "federated": "federated (federated_checkpoint)",
    "distilled": "distilled (student of the centralised)",
    "iteration2": "iteration 2 (pretrained_checkpoint_iter2)",
}
# Which materialization records each encoder's held-out masked accuracy.
TRAINING_ASSETS = {
    "pretrained": "pretrained_checkpoint",
    "federated": "federated_checkpoint",
    "iteration2": "pretrained_checkpoint_iter2",
}


# --------------------------------------------------------------------------------------------
# Budgets and equal compute (pure arithmetic)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Budgets:
    """Every training and evaluation budget of one benchmark run (seconds are seconds of audio)."""

    speakers: int
    utterances: int
    steps: int  # centralised optimizer steps; iteration 2 trains the same number
    batch_seconds: float  # centralised audio per optimizer step (all processes together)
    nproc: int  # centralised torchrun processes
    rounds: int  # Flower rounds
    fed_batch_seconds: float  # audio per local step of one client
    distill_steps: int
    distill_batch_seconds: float
    probe_steps: int
    probe_seeds: tuple[int, ...]
    finetune_minutes: tuple[float, ...] = (5.0, 20.0, 60.0)  # labelled budgets of the training speakers' audio
    # the ceiling of optimizer steps of every fine-tuning run (each stops early on its dev CER): the
    # from-scratch model left CTC's blank plateau by step ~400 at 49 labelled minutes (docs/BENCHMARKS.md)
    finetune_steps: int = 1200
    finetune_seeds: tuple[int, ...] = (0, 1)
    # dev CER every eval_every steps; stop after patience evaluations without a better one. A run on
    # the blank plateau (dev CER 1.0) therefore trains at least eval_every x (patience + 1) = 500 steps
    finetune_eval_every: int = 100
    finetune_patience: int = 4
    finetune_dev_speakers: int = 2  # ~68 dev utterances of 2 voices (1 voice: 34, a noisy choice of step)
    finetune_dev_utterances: int = 100  # scored at each evaluation (all of them here)

    def scaled(self, factor: float) -> Budgets:
        """The training budgets (centralised, iteration 2, distillation, hence federated) times ``factor``."""
        return replace(
            self, steps=max(1, round(self.steps * factor)), distill_steps=max(1, round(self.distill_steps * factor))
        )

    @property
    def central_audio_seconds(self) -> float:
        """Audio seconds the centralised run trains on: max_steps x batch."""
        return self.steps * self.batch_seconds

    def local_steps(self, clients: int) -> int:
        """Local steps per client per round that give the federation the centralised audio seconds."""
        return equal_local_steps(self.central_audio_seconds, self.rounds, clients, self.fed_batch_seconds)

    def federated_audio_seconds(self, clients: int) -> float:
        """Audio seconds of local training in the whole federation: rounds x local_steps x clients x batch."""
        return self.rounds * self.local_steps(clients) * clients * self.fed_batch_seconds


def equal_local_steps(central_audio_seconds: float, rounds: int, clients: int, batch_seconds: float) -> int:
    """``local_steps`` such that rounds x local_steps x clients x batch_seconds is closest to
    ``central_audio_seconds`` (at least 1)."""
    if rounds < 1 or clients < 1 or batch_seconds <= 0:
        raise ValueError(
            f"rounds, clients and batch seconds must be positive, got {rounds}, {clients}, {batch_seconds}"
        )
    return max(1, round(central_audio_seconds / (rounds * clients * batch_seconds)))


FULL = Budgets(
    speakers=48,
    utterances=34,
    steps=1600,
    batch_seconds=32.0,
    nproc=2,
    rounds=6,
    fed_batch_seconds=16.0,
    distill_steps=2000,
    distill_batch_seconds=16.0,
    probe_steps=1600,
    probe_seeds=(0, 1, 2),
)
SMOKE = Budgets(
    speakers=12,
    utterances=4,
    steps=16,
    batch_seconds=32.0,
    nproc=2,
    rounds=2,
    fed_batch_seconds=16.0,
    distill_steps=8,
    distill_batch_seconds=16.0,
    probe_steps=20,
    probe_seeds=(0, 1, 2),
    finetune_minutes=(0.5, 1.0),
    finetune_steps=12,
    finetune_seeds=(0,),
    finetune_eval_every=4,
    finetune_patience=2,
    finetune_dev_speakers=1,
    finetune_dev_utterances=8,
)
STAGES = (
    "data",
    "centralised",
    "federated",
    "distilled",
    "iteration2_targets",
    "iteration2",
    "probe",
    "finetune",
)


@dataclass(frozen=True)
class Rates:
    """Assumed speeds on an idle 2-core machine, only for the time budget printed before a run
    (figures from docs/BENCHMARKS.md and the smoke runs; the measured times are printed after)."""

    train_audio_per_s: float = 170.0  # centralised, 2 torchrun processes, tiny
    federated_audio_per_s: float = 120.0  # all clients together on the same cores
    round_overhead_s: float = 60.0  # per Flower round: clientapp start-ups, evaluation, transfers, aggregation
    distill_audio_per_s: float = 150.0
    launch_s: float = 10.0  # starting a run (in process; a `dagster asset materialize` process: ~30 s)
    train_fixed_s: float = 60.0  # torchrun start-up, data loading, held-out evaluation, checkpoint, MLflow
    federation_fixed_s: float = 90.0  # SuperLink, SuperNodes, ServerApp start-up and the final checkpoint
    data_s_per_hour: float = 90.0  # manifest + features + CMVN + clients + k-means per hour of audio
    iter2_s_per_hour: float = 90.0  # encoder features + k-means K=500 per hour of audio
    probe_s_per_step: float = (
        0.012  # one probe step of one model and seed (1,600 steps with their development evaluations: ~20 s)
    )
    probe_features_s_per_model: float = 10.0
    # one fine-tuning run: a process with one thread on an idle core (docs/BENCHMARKS.md, 2026-11-27:
    # 300 steps x 16 s in 30-40 s of training, ~120-160 audio s/s); runs train a core each at once
    finetune_audio_per_s: float = 120.0
    finetune_parallel: int = 2  # runs at once: [finetune] parallel_runs 0 = one per core of 2
    finetune_eval_audio_per_s: float = 400.0  # a dev evaluation: forward + greedy decoding only
    finetune_utterance_s: float = 4.9  # synth utterances average ~4.9 s with padding
    # per run: data loading, held-out greedy + beam scoring, the beam weights' grid on dev, checkpoints
    finetune_fixed_s: float = 60.0


FINETUNE_KNOBS = (
    "lr",
    "lr_grid",
    "freeze_steps",
    "freeze_frontend",
    "mask_prob",
    "mask_length",
    "channel_mask_prob",
    "batch_seconds",
    "lm_order",
    "lm_weights",
    "word_scores",
    "max_eval_utterances",
    "nproc",
    "parallel_runs",
)
FINETUNE_BATCH_SECONDS = 16.0  # audio per fine-tuning step: [finetune] batch_seconds' default (for the plan only)


def finetune_runs(budgets: Budgets, lr_grid: int) -> int:
    """Fine-tuning runs of one materialization: the pretrained encoder and scratch at every budget
    and seed, plus each model's other ``lr_grid - 1`` peak learning rates tried at the smallest
    budget and first seed (the best of the grid is that point's run)."""
    return 2 * (len(budgets.finetune_minutes) * len(budgets.finetune_seeds) + max(0, lr_grid - 1))


def finetune_estimate(budgets: Budgets, rates: Rates = Rates(), lr_grid: int = 3) -> float:
    """Wall seconds of the fine-tuning stage when every run trains to its ceiling (early stopping
    only shortens it): `finetune_runs` in rounds of ``rates.finetune_parallel``, each run its fixed
    cost, ``finetune_steps`` x 16 s of audio and a dev evaluation every ``finetune_eval_every`` steps.

    The full budgets: 16 runs in 8 rounds of 60 + 1,200 x 16 / 120 + 12 x 68 x 4.9 / 400 = 230 s:
    ~31 min at most on 2 idle cores, 35 min if a run trains at 100 audio s/s instead of 120; the
    pretrained runs stop early (dev CER flat for 4 x 100 steps), so less in practice."""
    evaluations = budgets.finetune_steps // max(1, budgets.finetune_eval_every)
    dev_audio = (
        min(budgets.finetune_dev_utterances, budgets.utterances * budgets.finetune_dev_speakers)
        * rates.finetune_utterance_s
    )
    run = (
        rates.finetune_fixed_s
        + budgets.finetune_steps * FINETUNE_BATCH_SECONDS / rates.finetune_audio_per_s
        + evaluations * dev_audio / rates.finetune_eval_audio_per_s
    )
    rounds = math.ceil(finetune_runs(budgets, lr_grid) / max(1, rates.finetune_parallel))
    return rates.launch_s + rounds * run


def stage_estimates(
    budgets: Budgets, hours: float, clients: int, rates: Rates = Rates(), probe_runs: int = 1
) -> dict[str, float]:
    """Expected wall seconds of each stage on an idle benchmark machine (a rough plan, not a
    measurement); ``probe_runs``: how many probe runs cover the seeds (1 when [probe] takes seeds)."""
    fed_audio = budgets.federated_audio_seconds(clients)
    models = len(MODEL_LABELS)
    central = rates.launch_s + rates.train_fixed_s + budgets.central_audio_seconds / rates.train_audio_per_s
    return {
        "data": 4 * rates.launch_s + hours * rates.data_s_per_hour,
        "centralised": central,
        "federated": rates.launch_s
        + rates.federation_fixed_s
        + budgets.rounds * rates.round_overhead_s
        + fed_audio / rates.federated_audio_per_s,
        "distilled": rates.launch_s
        + rates.train_fixed_s
        + budgets.distill_steps * budgets.distill_batch_seconds / rates.distill_audio_per_s,
        "iteration2_targets": rates.launch_s + hours * rates.iter2_s_per_hour,
        "iteration2": central,
        "probe": probe_runs * (rates.launch_s + models * rates.probe_features_s_per_model)
        + models * (len(budgets.probe_seeds) + 2) * budgets.probe_steps * rates.probe_s_per_step,  # + 2: the lr search
        "finetune": finetune_estimate(budgets, rates),
    }


# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CorpusInfo:
    path: str
    speakers: int
    distinct_voices: int  # distinct (engine, voice, rate, warp) labels
    base_voices: int  # distinct (engine, voice) pairs
    hours: float
    sources: list[str]
    synth_seconds: float | None  # None: reused from the cache


def read_speakers_txt(corpus: Path) -> tuple[list[str], float]:
    """(voice labels, one per speaker; hours) from the corpus' SPEAKERS.TXT (synth's layout)."""
    labels, minutes = [], 0.0
    for line in (corpus / "SPEAKERS.TXT").read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith(";"):
            continue
        columns = [c.strip() for c in line.split("|")]
        minutes += float(columns[3])
        labels.append(columns[4])
    return labels, minutes / 60


def corpus_info(corpus: Path, synth_seconds: float | None) -> CorpusInfo:
    labels, hours = read_speakers_txt(corpus)
    base = {" ".join(label.split()[:2]) for label in labels}
    return CorpusInfo(
        path=str(corpus),
        speakers=len(labels),
        distinct_voices=len(set(labels)),
        base_voices=len(base),
        hours=hours,
        sources=sorted({label.split()[0] for label in labels}),
        synth_seconds=synth_seconds,
    )


def build_corpus(
    cache: Path, speakers: int, utterances: int, seed: int, sources: str | None, distinct: bool = True
) -> CorpusInfo:
    """The corpus for these arguments under ``cache``: reused when a finished one exists, else
    synthesized into a temporary folder and renamed (an interrupted build is never reused).
    ``distinct``: ``--distinct-sentences``, no sentence read twice, so whichever speakers
    client_partitions holds out (a hash of the speaker id), their text is disjoint from the rest."""
    from speech_assets.corpus.synth import available_sources

    names = sources.split(",") if sources else available_sources()
    key = f"synth-s{speakers}-u{utterances}-seed{seed}-{'+'.join(names)}{'-distinct' if distinct else ''}"
    corpus, marker = cache / key, cache / f"{key}.done.json"
    arguments = {"speakers": speakers, "utterances": utterances, "seed": seed, "sources": names}
    if distinct:
        arguments["distinct_sentences"] = True
    if marker.is_file() and corpus.is_dir() and json.loads(marker.read_text()).get("arguments") == arguments:
        print(f"corpus: reusing {corpus}")
        return corpus_info(corpus, None)
    partial = cache / f"{key}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(corpus, ignore_errors=True)
    cache.mkdir(parents=True, exist_ok=True)
    command = [
        str(BIN / "speech-assets"),
        "corpus",
        "synth",
        "--out",
        str(partial),
        "--speakers",
        str(speakers),
        "--utterances",
        str(utterances),
        "--seed",
        str(seed),
        "--sources",
        ",".join(names),
        *(["--distinct-sentences"] if distinct else []),
    ]
    print("corpus: " + " ".join(command[1:]))
    started = time.perf_counter()
    completed = subprocess.run(command, check=False, cwd=REPO, capture_output=True, text=True)
    if completed.returncode:
        raise SystemExit(f"corpus synthesis failed ({completed.returncode}): {completed.stderr.strip()}")
    seconds = time.perf_counter() - started
    partial.rename(corpus)
    summary = completed.stdout.splitlines()[0].replace(str(partial), str(corpus))
    marker.write_text(json.dumps({"arguments": arguments, "synth_seconds": seconds, "summary": summary}, indent=1))
    print(f"corpus: {summary} ({seconds:.0f} s)")
    return corpus_info(corpus, seconds)


# --------------------------------------------------------------------------------------------
# Dagster runs, one per stage
# --------------------------------------------------------------------------------------------


@dataclass
class Stage:
    name: str
    estimate_s: float
    wall_s: float = 0.0
    runs: list[str] = field(default_factory=list)  # what each `dagster asset materialize` selected


class GraphRunner:
    """Dagster runs of the real code location against one fresh instance: ``dagster asset
    materialize`` processes (``cli``, as scripts/materialize_all.sh) or runs executed in this
    process (each a real run in the instance, without a CLI start-up and a step process each)."""

    def __init__(self, root: Path, corpus: Path, settings: Path | None, cli: bool) -> None:
        self.root, self.cli = root, cli
        self.home, self.data, self.logs = root / "dagster_home", root / "data", root / "logs"
        for folder in (self.home, self.data, self.logs):
            folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / "dagster.yaml", self.home / "dagster.yaml")
        self.env = {
            **os.environ,
            "DAGSTER_HOME": str(self.home),
            "SPEECH_ASSETS_CORPUS": str(corpus),
            "SPEECH_ASSETS_DATA_DIR": str(self.data),
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONWARNINGS": "ignore:Function `asset_materialize_command` is superseded",
        }
        self.env.pop("MLFLOW_TRACKING_URI", None)  # MLflow in <data>/mlflow.db, never a shared server
        if settings is not None:
            self.env["SPEECH_ASSETS_SETTINGS"] = str(settings)
        self.count = 0
        self.instance: Any = None
        self.defs: Any = None
        if not cli:
            import dagster as dg

            os.environ.update({k: v for k, v in self.env.items() if k != "PYTHONWARNINGS"})
            os.environ.pop("MLFLOW_TRACKING_URI", None)
            from speech_assets.definitions import build_definitions

            self.defs = build_definitions()  # paths and settings from the variables just set
            self.instance = dg.DagsterInstance.from_config(str(self.home))

    def close(self) -> None:
        if self.instance is not None:
            self.instance.dispose()

    def partitions(self, kind: str) -> Any:
        """Every registered partition of ``kind``: a FIRST...LAST range for the CLI, a list in process."""
        if not self.cli:
            return list(self.instance.get_dynamic_partitions(kind))
        command = [str(BIN / "speech-assets"), "partitions", kind, "--range"]
        return subprocess.run(
            command, env=self.env, cwd=REPO, check=True, capture_output=True, text=True
        ).stdout.strip()

    def materialize(self, stage: Stage, select: str, partitions: Any = None, config: dict | None = None) -> None:
        """One run (in process: one run per selected asset); its output goes to ``logs/NN_<select>.log``;
        raises SystemExit on failure."""
        self.count += 1
        log = self.logs / f"{self.count:02d}_{select.replace(',', '+')}.log"
        started = time.perf_counter()
        try:
            if self.cli:
                self._cli(select, partitions, config, log)
            else:
                self._in_process(select, partitions, config, log)
        finally:
            stage.wall_s += time.perf_counter() - started
            stage.runs.append(select)
            leftovers(None, self.root)

    def _cli(self, select: str, partition_range: str | None, config: dict | None, log: Path) -> None:
        command = [str(BIN / "dagster"), "asset", "materialize", "-m", CODE_LOCATION, "--select", select]
        if partition_range:
            command += ["--partition-range", partition_range]
        if config:
            command += ["--config-json", json.dumps(config)]
        with log.open("w") as out:
            out.write("$ " + " ".join(command) + "\n")
            out.flush()
            code = run_group(command, self.env, out, self.root)
        if code:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
            raise SystemExit(f"`dagster asset materialize --select {select}` failed ({code}); {log}:\n{tail}")

    def _in_process(self, select: str, partitions: list[str] | None, config: dict | None, log: Path) -> None:
        from speech_assets_tests.support.local_runs import materialize_in_process

        with log.open("a") as out, redirected(out):
            for asset in select.split(","):
                ops = {k: v for k, v in ((config or {}).get("ops") or {}).items() if k == asset}
                print(f"materialize {asset} {partitions or ''} run config {ops}", flush=True)
                try:
                    result = materialize_in_process(
                        self.defs, self.instance, asset, partitions, {"ops": ops} if ops else None
                    )
                except Exception as error:  # noqa: BLE001  (any failure of the run: reported with its log, then exit)
                    failure = f"materializing {asset} failed: {type(error).__name__}: {error}"
                    print(failure, flush=True)
                    break
                print(f"run {result.run_id}: {asset} succeeded", flush=True)
            else:
                return
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise SystemExit(f"{failure}; {log}:\n{tail}")


@contextmanager
def redirected(out: Any) -> Iterator[None]:
    """This process's stdout and stderr (file descriptors: its subprocesses' too) into ``out``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def run_group(command: list[str], env: dict[str, str], out: Any, work: Path) -> int:
    """Run ``command`` in its own process group; on any exit, end whatever it left behind."""
    process = subprocess.Popen(command, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return process.wait()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
        leftovers(process.pid, work)


def end_children() -> None:
    """End any process this benchmark started that is still running (none should be)."""
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        print(f"  (ending leftover child {child.pid}: {' '.join(child.cmdline())[:120]})")
        child.terminate()
    _, alive = psutil.wait_procs(children, timeout=15)
    for child in alive:
        child.kill()


def leftovers(pgid: int | None, work: Path) -> list[str]:
    """End processes of group ``pgid`` or whose command line names ``work`` (SuperNodes, torchrun
    workers in their own sessions); returns what was found. Only this benchmark's processes match."""
    import psutil

    found = []
    mine = {os.getpid(), *(parent.pid for parent in psutil.Process().parents())}  # this process and what started it
    for process in psutil.process_iter(["pid", "cmdline"]):
        try:
            if process.pid in mine:
                continue
            in_group = pgid is not None and os.getpgid(process.pid) == pgid
            if in_group or str(work) in " ".join(process.info["cmdline"] or []):
                found.append(process)
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    for process in found:
        try:
            process.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(found, timeout=15)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            pass
    names = [f"{p.pid} {' '.join(p.info['cmdline'] or [])[:120]}" for p in found]
    if names:
        print(f"  (ended {len(names)} leftover process(es): {'; '.join(names)})")
    return names


# --------------------------------------------------------------------------------------------
# Reading results
# --------------------------------------------------------------------------------------------


def latest_metadata(home: Path, asset: str) -> dict[str, Any]:
    """The newest materialization's metadata of ``asset`` in the instance at ``home`` (plain values)."""
    import dagster as dg

    os.environ["DAGSTER_HOME"] = str(home)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        event = instance.get_latest_materialization_event(dg.AssetKey(asset))
        if event is None or event.asset_materialization is None:
            return {}
        return {key: getattr(value, "value", value) for key, value in event.asset_materialization.metadata.items()}


def training_result(home: Path, asset: str) -> dict[str, Any]:
    """The training run's ``result.json`` (its run folder is in the materialization metadata), over
    the metadata's own scalars."""
    metadata = latest_metadata(home, asset)
    result = {k: v for k, v in metadata.items() if isinstance(v, (int, float, str, bool))}
    run_dir = metadata.get("run_dir")
    if run_dir and (Path(run_dir) / "result.json").is_file():
        result.update(json.loads((Path(run_dir) / "result.json").read_text()))
    return result


def masked_accuracy(result: dict[str, Any]) -> dict[str, Any]:
    """Held-out masked accuracy and majority-class rate: leak-free frames when recorded, else all masked frames."""
    for kind, accuracy, majority in (
        ("leak-free", "heldout_leak_free_masked_accuracy", "heldout_leak_free_majority_accuracy"),
        ("all masked frames", "heldout_masked_accuracy", "heldout_majority_accuracy"),
    ):
        if result.get(accuracy) is not None and result.get(majority) is not None:
            return {
                "frames": kind,
                "accuracy": float(result[accuracy]),
                "majority": float(result[majority]),
                "plain_accuracy": result.get("heldout_masked_accuracy"),
                "plain_majority": result.get("heldout_majority_accuracy"),
            }
    return {}


def federated_audio_measured(run_dir: str | None) -> float | None:
    """Audio seconds the clients reported training on: ``audio_seconds`` in the round records, else
    the round's weighted mean ``audio-seconds`` times its clients (approximate); None if neither."""
    if not run_dir or not (Path(run_dir) / "rounds").is_dir():
        return None
    total, seen = 0.0, False

    def walk(value: Any) -> None:
        nonlocal total, seen
        if isinstance(value, dict):
            for key, item in value.items():
                if key == "audio_seconds" and isinstance(item, (int, float)):
                    total, seen = total + float(item), True
                else:
                    walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    estimate = 0.0
    for record in sorted((Path(run_dir) / "rounds").glob("round_*.json")):
        data = json.loads(record.read_text())
        walk(data)
        # the round record keeps only the examples-weighted mean over clients: x clients ~ the sum
        mean = (data.get("aggregated_train") or {}).get("audio-seconds")
        if mean is not None:
            estimate += float(mean) * len(data.get("rows") or [])
    return total if seen else (estimate or None)


def probe_rows(data: Path, seed: int) -> list[dict[str, Any]]:
    """The held-out rows of ``results.parquet``; a row without a ``seed`` column gets ``seed``."""
    import pyarrow.parquet as pq

    rows = pq.read_table(data / "probe" / "results.parquet").to_pylist()
    return [
        {**row, "seed": row.get("seed", seed) if row.get("seed") is not None else seed}
        for row in rows
        if row["split"] == "heldout"
    ]


@dataclass(frozen=True)
class Summary:
    """One model's held-out figure over seeds."""

    mean: float
    sd: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        return cls(
            statistics.fmean(values),
            statistics.stdev(values) if len(values) > 1 else 0.0,
            min(values),
            max(values),
            len(values),
        )

    def text(self) -> str:
        return f"{self.mean:.3f} ± {self.sd:.3f}"


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per model: CER and WER over seeds (mean, sd, range), seeds, utterances."""
    models: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        models.setdefault(row["model"], []).append(row)
    out = {}
    for model, group in models.items():
        out[model] = {
            "cer": asdict(Summary.of([r["cer"] for r in group])),
            "wer": asdict(Summary.of([r["wer"] for r in group])),
            "seeds": sorted({r["seed"] for r in group}),
            "utterances": max(r["utterances"] for r in group),
            "steps": group[0].get("steps"),
            "lr": group[0].get("lr"),  # the probe's, chosen per model on the development split
            **{k: group[0][k] for k in ("normalisation", "normalization", "cmvn") if k in group[0]},
        }
    return out


# --------------------------------------------------------------------------------------------
# Targets (issue 22, item 2)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    name: str
    status: str  # PASS, MISS or UNMEASURED
    detail: str


def check_targets(probe: dict[str, dict[str, Any]], accuracy: dict[str, dict[str, Any]]) -> list[Target]:
    """The targets of issue 22 item 2, on means over seeds (spreads shown)."""

    def cer(model: str) -> Summary | None:
        return Summary(**probe[model]["cer"]) if model in probe else None

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "MISS"

    targets = []
    central, fbank, rand = cer("pretrained"), cer("fbank"), cer("random")
    if central and fbank and rand:
        ratio = central.mean / fbank.mean
        # "clearly below random": the mean +- sd intervals do not overlap
        clear = central.mean + central.sd < rand.mean - rand.sd
        targets.append(
            Target(
                "centralised CER <= 0.85x fbank and clearly below random",
                verdict(ratio <= 0.85 and clear),
                f"centralised {central.text()}, fbank {fbank.text()} (ratio {ratio:.3f}, target <= 0.85), "
                f"random {rand.text()} "
                f"({'clearly below' if clear else 'NOT clearly below: intervals overlap or above'})",
            )
        )
    for model, label, limit, reference in (
        ("federated", "federated CER within 10% of centralised (equal audio seconds)", 1.10, "pretrained"),
        ("distilled", "distilled CER within 15% of its teacher (the centralised)", 1.15, "pretrained"),
        ("iteration2", "iteration 2 CER <= iteration 1 (same budget)", 1.0, "pretrained"),
    ):
        this, ref = cer(model), cer(reference)
        if this is None or ref is None:
            targets.append(Target(label, "UNMEASURED", f"no probe rows for {model if this is None else reference}"))
            continue
        ratio = this.mean / ref.mean
        targets.append(
            Target(
                label,
                verdict(ratio <= limit),
                f"{this.text()} vs {ref.text()} (ratio {ratio:.3f}, target <= {limit:.2f})",
            )
        )
    for model in ("pretrained", "federated"):
        label = (
            f"{'centralised' if model == 'pretrained' else model}: held-out leak-free masked accuracy >= 3x majority"
        )
        found = accuracy.get(model) or {}
        if not found:
            targets.append(Target(label, "UNMEASURED", "no held-out masked accuracy recorded"))
            continue
        ratio = found["accuracy"] / found["majority"] if found["majority"] else math.inf
        numbers = f"{found['accuracy']:.4f} vs majority {found['majority']:.4f} ({ratio:.2f}x, target >= 3x)"
        if found["frames"] != "leak-free":
            targets.append(
                Target(label, "UNMEASURED", f"the run records no leak-free figure; on all masked frames: {numbers}")
            )
        else:
            targets.append(Target(label, verdict(ratio >= 3.0), numbers))
    return targets


# --------------------------------------------------------------------------------------------
# Fine-tuning (issues 38 and 44): finetuned_asr's results.parquet, summarised as the asset does
# --------------------------------------------------------------------------------------------

FINETUNE_RATIO_MINUTES = (5.0, 20.0)  # the budgets where pretrained must be <= 0.7x a trained scratch
FINETUNE_RATIO = 0.7  # pretrained held-out greedy CER <= 0.7x scratch's
SCRATCH_TRAINED_CER = 0.5  # scratch counts as trained below this greedy CER on its own labelled set
# per-run columns of results.parquet (issue 44): the same value on every row of one run
RUN_COLUMNS = ("dev_cer", "lr", "heldout_speakers", "text_overlap", "oov_rate")


def _stats(values: Sequence[float | None]) -> dict[str, Any] | None:
    """Summary of the values that are there (None when none is)."""
    present = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return asdict(Summary.of(present)) if present else None


def finetune_run_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per run (model, budget, seed): its selected step, peak lr, dev CER, greedy CER on
    its own labelled set (split ``train``), held-out greedy CER, text overlap, OOV rate and held-out
    speakers (None where results.parquet predates the column)."""
    runs: dict[tuple[str, float, int], dict[str, Any]] = {}
    for row in rows:
        key = (row["model"], float(row["labelled_minutes"]), int(row["seed"]))
        run = runs.setdefault(
            key,
            {
                "model": key[0],
                "minutes": key[1],
                "seed": key[2],
                "steps": row["steps"],
                "labelled_seconds": row["labelled_seconds"],
                **{column: row.get(column) for column in RUN_COLUMNS},
            },
        )
        if row["decoder"] == "greedy":
            run[f"{row['split']}_row_cer"] = row["cer"]  # train_row_cer, dev_row_cer, heldout_row_cer
    for run in runs.values():
        run["train_cer"] = run.get("train_row_cer")  # greedy CER on its own labelled set
        if run.get("dev_cer") is None:
            run["dev_cer"] = run.get("dev_row_cer")
    return list(runs.values())


def finetune_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (labelled budget, model, decoder): held-out CER and WER over seeds (mean, sd,
    range) with the labelled seconds, the selected steps, the peak lrs, dev CER, greedy CER on the
    labelled set, text overlap, OOV rate and held-out speakers; summarised with the asset's own
    grouping (:func:`speech_assets.evaluation.finetune_results.as_probe_results`)."""
    from speech_assets.evaluation.finetune_results import as_probe_results, budgets
    from speech_assets.evaluation.finetune_results import summarise as summarise_results

    runs = finetune_run_table(rows)
    out = []
    for minutes in budgets(rows):
        for decoder in sorted({r["decoder"] for r in rows}, key=lambda d: (d != "greedy", d)):
            for model, held in summarise_results(as_probe_results(rows, decoder, minutes)).items():
                mine = [r for r in runs if r["model"] == model and r["minutes"] == minutes]
                held_rows = [
                    r
                    for r in rows
                    if r["model"] == model
                    and r["labelled_minutes"] == minutes
                    and r["decoder"] == decoder
                    and r["split"] == "heldout"
                ]
                overlaps = [r["text_overlap"] for r in mine if r.get("text_overlap") is not None]
                speakers = [r["heldout_speakers"] for r in mine if r.get("heldout_speakers") is not None]
                out.append(
                    {
                        "minutes": minutes,
                        "model": model,
                        "decoder": decoder,
                        "cer": asdict(Summary.of([r["cer"] for r in held_rows])),
                        "wer": asdict(Summary.of([r["wer"] for r in held_rows])),
                        "seeds": list(held.seeds),
                        "utterances": held.utterances,
                        "labelled_seconds": statistics.fmean(r["labelled_seconds"] for r in mine),
                        "steps": max(r["steps"] for r in mine),
                        "selected_steps": sorted(r["steps"] for r in mine),
                        "lr": sorted({r["lr"] for r in mine if r.get("lr") is not None}),
                        "dev_cer": _stats([r.get("dev_cer") for r in mine]),
                        "train_cer": _stats([r.get("train_cer") for r in mine]),
                        "text_overlap": max(overlaps) if overlaps else None,
                        "oov_rate": _stats([r.get("oov_rate") for r in mine]),
                        "heldout_speakers": min(speakers) if speakers else None,
                    }
                )
    return out


def finetune_verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """The asset's own verdict lines (beat scratch, lost, did not train, indicative only, too small to tell)."""
    from speech_assets.evaluation.finetune_results import verdicts

    return verdicts(rows) if rows else []


def check_finetune_targets(entries: list[dict[str, Any]], probe: dict[str, dict[str, Any]]) -> list[Target]:
    """The fine-tuning targets of issue 44 on held-out greedy means over seeds:

    - at 5 and 20 labelled minutes (the budgets of `FINETUNE_RATIO_MINUTES` there are; else every
      budget but the largest) pretrained CER <= 0.7x scratch's, scratch trained (greedy CER on its
      own labelled set below 0.5: a scratch that did not train makes the comparison a MISS);
    - the fine-tuned pretrained encoder below the frozen probe's CER at every budget;
    - the gap narrows: the ratio at the largest budget >= the ratio at the smallest;
    - and, as issue 38 had it, beam WER below greedy (with the held-out OOV rate beside it)."""
    if not entries:
        return [Target("fine-tuning targets", "UNMEASURED", "no fine-tuning results (stage not run)")]

    def get(minutes: float, model: str, decoder: str = "greedy") -> dict[str, Any] | None:
        return next(
            (e for e in entries if e["minutes"] == minutes and e["model"] == model and e["decoder"] == decoder), None
        )

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "MISS"

    def ratio(minutes: float) -> float | None:
        p, s = get(minutes, "pretrained"), get(minutes, "scratch")
        if not p or not s:
            return None
        return p["cer"]["mean"] / s["cer"]["mean"] if s["cer"]["mean"] else math.inf

    minutes = sorted({e["minutes"] for e in entries})
    checked = [m for m in FINETUNE_RATIO_MINUTES if m in minutes] or minutes[:-1] or minutes
    targets = []
    for m in checked:
        pre, scratch, r = get(m, "pretrained"), get(m, "scratch"), ratio(m)
        name = f"{m:g} labelled min: pretrained CER <= {FINETUNE_RATIO}x scratch's, scratch trained"
        if pre is None or scratch is None or r is None:
            targets.append(Target(name, "UNMEASURED", "no pretrained or scratch rows"))
            continue
        a, b = Summary(**pre["cer"]), Summary(**scratch["cer"])
        labelled = scratch.get("train_cer")
        trained = labelled is not None and labelled["mean"] < SCRATCH_TRAINED_CER
        own = f"scratch's labelled-set CER {labelled['mean']:.3f}" if labelled else "scratch's labelled-set CER unknown"
        targets.append(
            Target(
                name,
                verdict(r <= FINETUNE_RATIO and trained),
                f"pretrained {a.text()}, scratch {b.text()} (ratio {r:.3f}, target <= {FINETUNE_RATIO}); {own} "
                f"({'trained' if trained else f'NOT trained: needs < {SCRATCH_TRAINED_CER}'})",
            )
        )
    frozen = probe.get("pretrained")
    pairs = [(m, get(m, "pretrained")) for m in minutes]
    pairs = [(m, e) for m, e in pairs if e]
    if frozen and pairs:
        f = Summary(**frozen["cer"])
        targets.append(
            Target(
                "fine-tuned pretrained CER below the frozen probe's at every budget",
                verdict(all(e["cer"]["mean"] < f.mean for _, e in pairs)),
                "; ".join(f"{m:g} min: {Summary(**e['cer']).text()}" for m, e in pairs)
                + f" vs frozen linear probe {f.text()}",
            )
        )
    else:
        targets.append(
            Target(
                "fine-tuned pretrained CER below the frozen probe's at every budget",
                "UNMEASURED",
                "no probe rows for the pretrained encoder (the probe stage has not run)",
            )
        )
    ratios = [(m, ratio(m)) for m in minutes]
    ratios = [(m, r) for m, r in ratios if r is not None]
    if len(ratios) >= 2:
        (first, r0), (last, r1) = ratios[0], ratios[-1]
        targets.append(
            Target(
                f"the gap narrows: ratio at {last:g} min >= ratio at {first:g} min",
                verdict(r1 >= r0),
                "; ".join(f"{m:g} min: pretrained/scratch CER {r:.3f}" for m, r in ratios),
            )
        )
    beams = sorted({e["decoder"] for e in entries} - {"greedy"})
    if not beams:
        targets.append(Target("beam WER below greedy", "UNMEASURED", "no beam decoder rows (flashlight-text missing?)"))
    for beam in beams:
        both = [(m, get(m, "pretrained"), get(m, "pretrained", beam)) for m in minutes]
        both = [(m, g, b) for m, g, b in both if g and b]

        def oov(entry: dict[str, Any]) -> str:
            return f", OOV {entry['oov_rate']['mean']:.1%}" if entry.get("oov_rate") else ""

        targets.append(
            Target(
                f"pretrained: {beam} WER below greedy at every budget",
                verdict(all(b["wer"]["mean"] < g["wer"]["mean"] for _, g, b in both)),
                "; ".join(f"{m:g} min: {b['wer']['mean']:.3f} vs {g['wer']['mean']:.3f}{oov(b)}" for m, g, b in both),
            )
        )
    return targets


def _cell(stats: dict[str, Any] | None, percent: bool = False) -> str:
    if not stats:
        return "—"
    return f"{stats['mean']:.1%}" if percent else Summary(**stats).text()


def finetune_markdown(report: dict[str, Any]) -> list[str]:
    entries = report.get("finetune") or []
    if not entries:
        return []
    settings = report.get("finetune_settings") or {}
    grid = settings.get("lr_grid") or [settings.get("lr")]
    lines = [
        "",
        f"Fine-tuning (`finetuned_asr`): each run dev-selected (dev CER every {settings.get('eval_every')} steps on "
        f"{settings.get('dev_speakers')} dev speaker(s), at most {settings.get('max_dev_utterances')} utterances; "
        f"stops after {settings.get('patience')} evaluations without a better one; at most "
        f"{settings.get('max_steps')} steps); peak lr chosen per model on dev from {grid} at the smallest budget, "
        f"first seed; pretrained encoder frozen {settings.get('freeze_steps')} steps, scratch trains everything "
        f"from step 0; batch {settings.get('batch_seconds')} s, mask_prob {settings.get('mask_prob')}; the same "
        f"labelled subset for pretrained and scratch; {settings.get('lm_order')}-gram LM and lexicon of the "
        "labelled transcripts for the beam decoder (weights tuned on dev). Held-out CER / WER, mean ± sd over seeds:",
        "",
        "| labelled budget (used) | model | seeds | lr | selected steps | dev CER | labelled-set CER | greedy CER | "
        "greedy WER | beam CER | beam WER | overlap | held-out OOV | held-out utts (speakers) |",
        "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for minutes in sorted({e["minutes"] for e in entries}):
        for model in dict.fromkeys(e["model"] for e in entries if e["minutes"] == minutes):
            greedy = next(
                e for e in entries if e["minutes"] == minutes and e["model"] == model and e["decoder"] == "greedy"
            )
            beam = next(
                (e for e in entries if e["minutes"] == minutes and e["model"] == model and e["decoder"] != "greedy"),
                None,
            )
            cells = [Summary(**greedy["cer"]).text(), Summary(**greedy["wer"]).text()]
            cells += [Summary(**beam["cer"]).text(), Summary(**beam["wer"]).text()] if beam else ["—", "—"]
            lrs = ", ".join(f"{lr:g}" for lr in greedy.get("lr") or []) or "—"
            steps = ", ".join(str(s) for s in greedy.get("selected_steps") or [greedy["steps"]])
            overlap = "—" if greedy.get("text_overlap") is None else str(greedy["text_overlap"])
            speakers = "" if greedy.get("heldout_speakers") is None else f" ({greedy['heldout_speakers']})"
            lines.append(
                f"| {minutes:g} min ({greedy['labelled_seconds'] / 60:.1f} min) | {model} | {len(greedy['seeds'])} | "
                f"{lrs} | {steps} | {_cell(greedy.get('dev_cer'))} | {_cell(greedy.get('train_cer'))} | "
                f"{' | '.join(cells)} | {overlap} | {_cell(greedy.get('oov_rate'), percent=True)} | "
                f"{greedy['utterances']}{speakers} |"
            )
    frozen = (report.get("probe") or {}).get("pretrained")
    if frozen:
        lines.append(
            f"| — | frozen linear probe (pretrained) | {len(frozen['seeds'])} | | | | | "
            f"{Summary(**frozen['cer']).text()} | {Summary(**frozen['wer']).text()} | | | | | {frozen['utterances']} |"
        )
    else:
        lines.append("| — | frozen linear probe (pretrained) | the probe has not run | | | | | | | | | | | |")
    speakers = [e["heldout_speakers"] for e in entries if e.get("heldout_speakers") is not None]
    least = report.get("min_heldout_speakers") or 3
    if speakers and min(speakers) < least:
        lines += [
            "",
            f"**Indicative only**: {min(speakers)} held-out speaker(s) < [probe] min_heldout_speakers {least}.",
        ]
    lines += ["", "| target (issue 44) | status | measured |", "| --- | --- | --- |"]
    lines += [f"| {t['name']} | **{t['status']}** | {t['detail']} |" for t in report.get("finetune_targets") or []]
    lines += [f"- asset verdict: {line}" for line in report.get("finetune_verdicts") or []]
    return lines


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    from machine import cpu_model  # bench/machine.py

    model = cpu_model()
    import torch

    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_average_start": os.getloadavg(),
    }


def markdown(report: dict[str, Any]) -> str:
    b, m, c = report["budgets"], report["machine"], report["corpus"]
    lines = [
        f"## Learning benchmark (`bench/learning.py{' --smoke' if report['smoke'] else ''}`), {report['date']}",
        (
            f"Machine: {m['cpu_model']}, {m['cpu_count']} CPUs{', ' + m['cuda'] if m['cuda'] else ''}; torch "
            f"{m['torch']}; "
            f"load average {m['load_average_start'][0]:.1f} at start, {m['load_average_end'][0]:.1f} at end."
        ),
        (
            f"Corpus: {c['hours']:.2f} h, {c['speakers']} speakers, {c['distinct_voices']} distinct voices from "
            f"{c['base_voices']} engine voices ({', '.join(c['sources'])})."
        ),
        f"Budgets: centralised {b['steps']} steps x {b['batch_seconds']:g} s ({b['nproc']} processes) = "
        f"{report['equal_compute']['central_budget_s']:,.0f} audio s; federated {b['rounds']} rounds x "
        f"{report['equal_compute']['local_steps']} local steps x {report['equal_compute']['clients']} clients x "
        f"{b['fed_batch_seconds']:g} s = {report['equal_compute']['federated_budget_s']:,.0f} audio s; iteration 2 "
        f"{b['steps']} steps; distilled {b['distill_steps']} steps x {b['distill_batch_seconds']:g} s; probe "
        f"{b['probe_steps']} steps x seeds {', '.join(map(str, b['probe_seeds']))}."
        + (f" Overrides: {report['overrides']}." if report["overrides"] else ""),
        "",
        "| encoder | probed with | held-out CER | held-out WER | seeds | held-out utterances | masked acc "
        "(frames) | majority rate | ratio |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for model, label in MODEL_LABELS.items():
        row = report["probe"].get(model)
        if row is None:
            lines.append(f"| {label} | — | — | — | — | — | — | — | — |")
            continue
        acc = report["masked_accuracy"].get(model) or {}
        accuracy = f"{acc['accuracy']:.4f} ({acc['frames']})" if acc else "—"
        majority = f"{acc['majority']:.4f}" if acc else "—"
        ratio = f"{acc['accuracy'] / acc['majority']:.2f}x" if acc and acc["majority"] else "—"
        cer, wer = Summary(**row["cer"]), Summary(**row["wer"])
        norm = row.get("normalisation") or row.get("normalization") or row.get("cmvn") or "—"
        if row.get("lr") is not None:
            norm += f"; probe lr {row['lr']:g}, {row.get('steps')} steps"
        lines.append(
            f"| {label} | {norm} | {cer.text()} | {wer.text()} | {cer.n} | {row['utterances']} | {accuracy} | "
            f"{majority} | {ratio} |"
        )
    lines += [
        "",
        "CER/WER: mean ± standard deviation over the probe seeds (linear CTC probe on characters; each "
        "model's probe lr "
        "and stopping step chosen on a development split of the training speakers).",
        "",
        "| target (issue 22, item 2) | status | measured |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {t['name']} | **{t['status']}** | {t['detail']} |" for t in report["targets"]]
    lines += finetune_markdown(report)
    eq = report["equal_compute"]
    measured = (
        f"; measured: centralised {eq['central_measured_s']:,.0f} s" if eq.get("central_measured_s") else ""
    ) + (f", federated {eq['federated_measured_s']:,.0f} s" if eq.get("federated_measured_s") else "")
    lines += [
        "",
        (
            f"Equal compute: centralised {eq['central_budget_s']:,.0f} audio s, federated "
            f"{eq['federated_budget_s']:,.0f} audio s (budget){measured}. The federated batch is padded audio, "
            "the centralised one unpadded, so the federation sees slightly less speech per second budgeted."
        ),
        "",
        "| stage | estimate | wall | runs |",
        "| --- | ---: | ---: | --- |",
    ]
    for stage in report["stages"]:
        lines.append(
            f"| {stage['name']} | {stage['estimate_s'] / 60:.1f} min | {stage['wall_s'] / 60:.1f} min | "
            f"{', '.join(stage['runs'])} |"
        )
    lines.append(f"| **total** | {report['estimate_s'] / 60:.1f} min | {report['wall_s'] / 60:.1f} min | |")
    if report.get("resumed"):
        lines.append("\nA resumed run (`--resume`): stage times count only what was left to do.")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def overrides(items: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``asset.key=value`` items -> {asset: {key: value}} (values parsed as JSON where they parse)."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        name, _, value = item.partition("=")
        asset, _, key = name.partition(".")
        if not key or not _:
            raise SystemExit(f"--set {item!r}: expected asset.key=value, e.g. federated_checkpoint.eta=0.1")
        out.setdefault(asset, {})[key] = parse_value(value)
    return out


def probe_configs(seeds: Sequence[int], steps: int) -> list[tuple[list[int], dict[str, Any]]]:
    """Run configs of ``downstream_probe`` covering ``seeds``: one run when the probe's settings take
    several seeds (a ``seeds`` field), else one run per seed."""
    from speech_assets.defs.resources import ProbeSettings

    multi = ProbeSettings.model_fields.get("seeds")
    if multi is not None:
        default = multi.default
        value: Any = list(seeds) if isinstance(default, (list, tuple)) else len(seeds)
        return [(list(seeds), {"steps": steps, "seed": seeds[0], "seeds": value})]
    return [([seed], {"steps": steps, "seed": seed}) for seed in seeds]


def run_benchmark(args: argparse.Namespace, budgets: Budgets, root: Path, corpus: CorpusInfo) -> dict[str, Any]:
    sets = overrides(args.set)
    runner = GraphRunner(root, Path(corpus.path), args.settings, cli=args.cli)
    try:
        return run_stages(args, budgets, root, corpus, runner, sets)
    finally:
        runner.close()


def run_stages(
    args: argparse.Namespace,
    budgets: Budgets,
    root: Path,
    corpus: CorpusInfo,
    runner: GraphRunner,
    sets: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    from speech_assets.defs.resources import PipelineSettings

    settings = PipelineSettings.load(args.settings) if args.settings else PipelineSettings.load()
    planned_clients = settings.clients.num_clients
    probe_runs = len(probe_configs(budgets.probe_seeds, budgets.probe_steps))
    estimates = stage_estimates(
        budgets, corpus.hours, planned_clients, Rates(launch_s=30.0 if args.cli else 10.0), probe_runs
    )
    selected = set(args.stages)
    estimates = {name: seconds for name, seconds in estimates.items() if name in selected}
    stages = {name: Stage(name, estimate) for name, estimate in estimates.items()}
    print_plan(budgets, planned_clients, estimates)

    def config(asset: str, values: dict[str, Any]) -> dict[str, Any] | None:
        merged = {**values, **sets.get(asset, {})}
        return {"ops": {asset: {"config": merged}}} if merged else None

    def stage(name: str, body: Callable[[Stage], None]) -> None:
        if name not in stages:
            print(f"[{time.strftime('%H:%M:%S')}] {name}: skipped (--stages)", flush=True)
            return
        current = stages[name]
        print(f"[{time.strftime('%H:%M:%S')}] {name} (planned {current.estimate_s / 60:.1f} min) ...", flush=True)
        body(current)
        print(f"  {name}: {current.wall_s / 60:.1f} min", flush=True)

    def data(s: Stage) -> None:
        runner.materialize(s, "manifest")
        runner.materialize(s, "vad_features", runner.partitions("speakers"))
        runner.materialize(s, "cmvn_stats,client_partitions")
        runner.materialize(s, "kmeans_targets", runner.partitions("clients"))

    train = {
        "max_steps": budgets.steps,
        "batch_seconds": budgets.batch_seconds / budgets.nproc,
        "nproc": budgets.nproc,
        "target_batch_seconds": budgets.batch_seconds,
        "checkpoint_every": max(1, budgets.steps // 4),
    }
    stage("data", data)
    client_rows = _read_table(runner.data / "clients" / "clients.parquet", ["client_id", "hours", "heldout"])
    clients = len({row["client_id"] for row in client_rows})
    training_hours = sum(row["hours"] for row in client_rows if not row["heldout"])
    print(
        f"training-side speakers' audio: {training_hours:.2f} h "
        f"({sum(not row['heldout'] for row in client_rows)} speakers; {sum(row['heldout'] for row in client_rows)} "
        "held out)",
        flush=True,
    )
    if "finetune" in stages and not args.smoke and training_hours < MIN_FINETUNE_TRAINING_HOURS:
        print(
            f"warning: {training_hours:.2f} h of training-speaker audio < {MIN_FINETUNE_TRAINING_HOURS} h: the "
            f"{max(budgets.finetune_minutes):g}-minute budget and the dev speakers will not both fit",
            file=sys.stderr,
        )
    local_steps = budgets.local_steps(clients)
    federated = {"rounds": budgets.rounds, "local_steps": local_steps, "batch_seconds": budgets.fed_batch_seconds}
    stage(
        "centralised",
        lambda s: runner.materialize(s, "pretrained_checkpoint", config=config("pretrained_checkpoint", train)),
    )
    stage(
        "federated",
        lambda s: runner.materialize(s, "federated_checkpoint", config=config("federated_checkpoint", federated)),
    )
    distill = {"max_steps": budgets.distill_steps, "batch_seconds": budgets.distill_batch_seconds}
    stage(
        "distilled",
        lambda s: runner.materialize(s, "distilled_checkpoint", config=config("distilled_checkpoint", distill)),
    )
    stage(
        "iteration2_targets",
        lambda s: runner.materialize(
            s, "kmeans_targets_iter2", runner.partitions("clients"), config("kmeans_targets_iter2", {})
        ),
    )
    stage(
        "iteration2",
        lambda s: runner.materialize(
            s, "pretrained_checkpoint_iter2", config=config("pretrained_checkpoint_iter2", train)
        ),
    )

    rows: list[dict[str, Any]] = []

    def probe(s: Stage) -> None:
        for seeds, values in probe_configs(budgets.probe_seeds, budgets.probe_steps):
            runner.materialize(s, "downstream_probe", config=config("downstream_probe", values))
            found = probe_rows(runner.data, seeds[0])
            shutil.copy(
                runner.data / "probe" / "results.parquet",
                root / f"probe_results_seed{'_'.join(map(str, seeds))}.parquet",
            )
            rows.extend(found)

    stage("probe", probe)
    if "probe" not in stages and (runner.data / "probe" / "results.parquet").is_file():
        rows.extend(probe_rows(runner.data, budgets.probe_seeds[0]))  # a resumed run's earlier probe

    finetune_rows: list[dict[str, Any]] = []
    # issue 44: dev-selected runs up to a ceiling of steps; the lr grid of [finetune] is tried once per
    # model (smallest budget, first seed) and its choice reused; one launch trains the runs a core each
    finetune_values = {
        "labelled_minutes": list(budgets.finetune_minutes),
        "seeds": list(budgets.finetune_seeds),
        "encoders": ["pretrained"],
        "max_steps": budgets.finetune_steps,
        "eval_every": budgets.finetune_eval_every,
        "patience": budgets.finetune_patience,
        "dev_speakers": budgets.finetune_dev_speakers,
        "max_dev_utterances": budgets.finetune_dev_utterances,
        # the pretrained model's freeze phase (scratch trains everything from step 0), within the ceiling
        "freeze_steps": min(settings.finetune.freeze_steps, max(1, budgets.finetune_steps // 6)),
        "checkpoint_every": budgets.finetune_eval_every,
    }

    def finetune(s: Stage) -> None:
        runner.materialize(s, "finetuned_asr", config=config("finetuned_asr", finetune_values))
        shutil.copy(runner.data / "finetune" / "results.parquet", root / "finetune_results.parquet")
        finetune_rows.extend(_read_table(runner.data / "finetune" / "results.parquet", None))

    stage("finetune", finetune)

    results = {model: training_result(runner.home, asset) for model, asset in TRAINING_ASSETS.items()}
    accuracy = {model: masked_accuracy(result) for model, result in results.items()}
    summary = summarize(rows)
    central_measured = results["pretrained"].get("train_audio_seconds")
    finetuned = finetune_summary(finetune_rows)
    return {
        "finetune": finetuned,
        "finetune_targets": [asdict(t) for t in check_finetune_targets(finetuned, summary)],
        "finetune_runs": finetune_run_table(finetune_rows),
        "finetune_verdicts": finetune_verdicts(finetune_rows),
        "training_speaker_hours": training_hours,
        "min_heldout_speakers": settings.probe.min_heldout_speakers,
        "finetune_settings": {
            **{k: v for k, v in settings.finetune.model_dump().items() if k in FINETUNE_KNOBS},
            **finetune_values,
            **sets.get("finetuned_asr", {}),
        },
        "stages": [asdict(s) for s in stages.values()],
        "probe": summary,
        "probe_rows": rows,
        "masked_accuracy": accuracy,
        "targets": [asdict(t) for t in check_targets(summary, accuracy)],
        "equal_compute": {
            "clients": clients,
            "local_steps": local_steps,
            "central_budget_s": budgets.central_audio_seconds,
            "federated_budget_s": budgets.federated_audio_seconds(clients),
            "central_measured_s": central_measured,
            "federated_measured_s": federated_audio_measured(results["federated"].get("run_dir")),
        },
        "training_results": {
            m: {k: v for k, v in r.items() if isinstance(v, (int, float, str, bool)) or v is None}
            for m, r in results.items()
        },
        "distilled": {
            k: v for k, v in latest_metadata(runner.home, "distilled_checkpoint").items() if isinstance(v, (int, float))
        },
        "estimate_s": sum(estimates.values()),
        "work": str(root),
    }


def _read_table(path: Path, columns: list[str] | None) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    return pq.read_table(path, columns=columns).to_pylist()


def print_plan(budgets: Budgets, clients: int, estimates: dict[str, float]) -> None:
    local = budgets.local_steps(clients)
    if "finetune" in estimates:
        print(
            f"fine-tuning: {finetune_runs(budgets, 3)} runs (pretrained and scratch x "
            f"{len(budgets.finetune_minutes)} budgets x {len(budgets.finetune_seeds)} seeds, + the other lrs of a "
            f"3-value grid at the smallest budget), each at most {budgets.finetune_steps} steps, dev CER every "
            f"{budgets.finetune_eval_every}, patience {budgets.finetune_patience}"
        )
    print(
        f"equal compute: centralised {budgets.steps} steps x {budgets.batch_seconds:g} s = "
        f"{budgets.central_audio_seconds:,.0f} audio s; "
        f"federated {budgets.rounds} rounds x {local} local steps x {clients} clients x "
        f"{budgets.fed_batch_seconds:g} s = "
        f"{budgets.federated_audio_seconds(clients):,.0f} audio s"
    )
    print("time budget per stage (planned for an idle 2-core machine; rough):")
    for name, seconds in estimates.items():
        print(f"  {name:<20} {seconds / 60:5.1f} min")
    print(f"  {'total':<20} {sum(estimates.values()) / 60:5.1f} min", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="a tiny corpus and budgets (checks the script end to end)")
    parser.add_argument(
        "--work", type=Path, default=Path("/tmp/speech_assets_learning"), help="runs go to <work>/run-<time>/"
    )
    parser.add_argument(
        "--corpus-cache",
        type=Path,
        default=Path.home() / ".cache" / "speech_assets" / "corpora",
        help="synthesized corpora, reused when built with the same arguments",
    )
    parser.add_argument("--corpus", type=Path, help="use this corpus instead of synthesizing one")
    parser.add_argument("--sources", help="synth's --sources (default: every engine installed here)")
    parser.add_argument("--speakers", type=int)
    parser.add_argument("--utterances", type=int, help="per speaker")
    parser.add_argument("--corpus-seed", type=int, default=0)
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply the training budgets (centralised, iteration 2, distilled; federated follows)",
    )
    parser.add_argument("--steps", type=int, help="centralised (and iteration-2) optimizer steps")
    parser.add_argument("--batch-seconds", type=float, help="centralised audio seconds per optimizer step")
    parser.add_argument("--nproc", type=int, help="centralised torchrun processes")
    parser.add_argument("--rounds", type=int, help="Flower rounds (local steps follow from equal compute)")
    parser.add_argument("--fed-batch-seconds", type=float)
    parser.add_argument("--distill-steps", type=int)
    parser.add_argument("--probe-steps", type=int)
    parser.add_argument("--probe-seeds", type=int, help="number of probe seeds (0, 1, ...)")
    parser.add_argument(
        "--finetune-minutes", help="labelled budgets, comma-separated minutes of the training speakers' audio"
    )
    parser.add_argument(
        "--finetune-steps", type=int, help="the ceiling of optimizer steps of each fine-tuning run (it stops early)"
    )
    parser.add_argument("--finetune-eval-every", type=int, help="fine-tuning steps between dev evaluations")
    parser.add_argument("--finetune-patience", type=int, help="dev evaluations without improvement before a stop")
    parser.add_argument("--finetune-seeds", type=int, help="number of fine-tuning seeds (0, 1, ...)")
    parser.add_argument(
        "--stages",
        type=lambda text: [name.strip() for name in text.split(",") if name.strip()],
        default=list(STAGES),
        help=f"comma-separated stages to run, of {','.join(STAGES)} (default: all); a skipped stage's "
        "asset must not be needed by a later one (the probe needs only centralised; finetune centralised)",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="ASSET.KEY=VALUE", help="one run-config knob of one asset"
    )
    parser.add_argument(
        "--settings", type=Path, help="pipeline settings TOML (default: the repository's pipeline.toml)"
    )
    parser.add_argument("--out", type=Path, help="markdown report")
    parser.add_argument("--json", type=Path, help="JSON report (default: --out with .json)")
    parser.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="go on in this <work>/run-* folder (its instance and data dir): finished stages are reused, "
        "stage times then count only what was left",
    )
    parser.add_argument(
        "--cli",
        action="store_true",
        help="each stage a `dagster asset materialize` process (default: runs in this process)",
    )
    parser.add_argument("--plan", action="store_true", help="print the budgets and time plan, run nothing")
    args = parser.parse_args(argv)

    budgets = SMOKE if args.smoke else FULL
    changes = {
        "speakers": args.speakers,
        "utterances": args.utterances,
        "steps": args.steps,
        "batch_seconds": args.batch_seconds,
        "nproc": args.nproc,
        "rounds": args.rounds,
        "fed_batch_seconds": args.fed_batch_seconds,
        "distill_steps": args.distill_steps,
        "probe_steps": args.probe_steps,
        "probe_seeds": tuple(range(args.probe_seeds)) if args.probe_seeds else None,
        "finetune_minutes": tuple(float(m) for m in args.finetune_minutes.split(","))
        if args.finetune_minutes
        else None,
        "finetune_steps": args.finetune_steps,
        "finetune_eval_every": args.finetune_eval_every,
        "finetune_patience": args.finetune_patience,
        "finetune_seeds": tuple(range(args.finetune_seeds)) if args.finetune_seeds else None,
    }
    if unknown := sorted(set(args.stages) - set(STAGES)):
        parser.error(f"--stages: unknown {unknown}; known: {','.join(STAGES)}")
    budgets = replace(budgets, **{k: v for k, v in changes.items() if v is not None}).scaled(args.scale)
    if len(budgets.probe_seeds) < 3 and not args.smoke:
        print("warning: fewer than 3 probe seeds: the issue asks for at least 3", file=sys.stderr)
    if args.plan:
        hours = budgets.speakers * budgets.utterances * 4.9 / 3600  # synth utterances average ~4.9 s with padding
        estimates = stage_estimates(budgets, hours, 4)
        print_plan(budgets, 4, {k: v for k, v in estimates.items() if k in args.stages})
        return 0

    started = time.perf_counter()
    info = machine()
    if args.corpus:
        corpus = (
            corpus_info(args.corpus, None)
            if (args.corpus / "SPEAKERS.TXT").is_file()
            else CorpusInfo(str(args.corpus), 0, 0, 0, 0.0, [], None)
        )
    else:
        corpus = build_corpus(args.corpus_cache, budgets.speakers, budgets.utterances, args.corpus_seed, args.sources)
    print(
        f"corpus: {corpus.hours:.2f} h, {corpus.speakers} speakers, {corpus.distinct_voices} distinct voices "
        f"from {corpus.base_voices} engine voices ({', '.join(corpus.sources)})"
    )
    if (
        not args.smoke
        and not args.corpus
        and (corpus.hours < MIN_FULL_HOURS or corpus.distinct_voices < MIN_FULL_VOICES)
    ):
        raise SystemExit(
            f"the corpus has {corpus.hours:.2f} h and {corpus.distinct_voices} voices; the benchmark needs "
            f">= {MIN_FULL_HOURS} h and >= {MIN_FULL_VOICES}: raise --speakers / --utterances"
        )
    root = args.resume or args.work / f"run-{time.strftime('%Y%m%d-%H%M%S')}"
    root.mkdir(parents=True, exist_ok=bool(args.resume))
    print(f"work: {root}")
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "smoke": args.smoke,
        "machine": info,
        "corpus": asdict(corpus),
        "budgets": asdict(budgets),
        "stages_selected": args.stages,
        "overrides": args.set,
        "settings": str(args.settings or REPO / "pipeline.toml"),
        "resumed": bool(args.resume),
    }
    try:
        report.update(run_benchmark(args, budgets, root, corpus))
    finally:
        end_children()
    report["machine"]["load_average_end"] = os.getloadavg()
    report["wall_s"] = time.perf_counter() - started
    text = markdown(report)
    print("\n" + text)
    out = args.out or root / "learning.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    json_path = args.json or out.with_suffix(".json")
    json_path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"wrote {out} and {json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
