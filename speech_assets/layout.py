"""Where every output lives: the one module that names the folders and files the graph writes
(``test_layout.py`` fails on a literal copy of a name elsewhere), under the data dir ``D``.

Ids that become path parts are checked by the caller (``StoragePaths``) before they reach here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

# ``D/features/shards/<speaker>.*``
SHARD_REJECTS_SUFFIX = ".rejects.parquet"
SHARD_STATS_SUFFIX = ".stats.npz"
SHARD_META_SUFFIX = ".meta.json"
SHARD_LOCK_SUFFIX = ".lock"

# ``D/kmeans/<client>/`` (iteration 1) and ``D/kmeans_iter2/<client>/`` (iteration 2)
TARGETS_DIRS = {1: "kmeans", 2: "kmeans_iter2"}

# a training run's folder: ``D/training/<run>/``, ``D/training_iter2/<run>/``, ``D/distill/<run>/``
RUN_LOCK = ".run.lock"
WORKERS_LOCK = ".workers.lock"

# ``D/federated/<run>/flower/`` (:class:`FlowerFiles`): the local federation's processes and the ``flwr`` CLI
FLOWER_HOME_DIR = "home"  # a Flower process's ``FLWR_HOME``, inside its folder
SUPERNODE_DIR = "supernode-{}"  # by client id
SUPERNODE_LOG = "supernode.log"
NODE_PRIVATE_KEY = "{}.key"  # by client id
NODE_PUBLIC_KEY = "{}.pub"

PROBE_DIR = "probe"  # ``D/probe/``
FINETUNE_DIR = "finetune"  # ``D/finetune/``
PLOT_SUFFIX = ".png"  # a plot in the report's plot cache: ``<input hash>.png``

# an MLflow run's artifacts, beside its run folder's config.json and result.json
MLFLOW_AUTOCONFIG = "autoconfig.json"
MLFLOW_ENVIRONMENT = "environment.txt"
MLFLOW_INPUTS = "inputs.json"
MLFLOW_CHECKPOINT_DIR = "checkpoint"

# the temp file of an atomic write, beside its target: ``.<target>.<random>.tmp``
TEMP_SUFFIX = ".tmp"


@dataclass(frozen=True)
class Numbered:
    """Files named by a number: ``template`` has one field (``"round_{:05d}.pt"``)."""

    template: str

    def name(self, number: int) -> str:
        return self.template.format(int(number))

    def number(self, name: str) -> int | None:
        """``None`` for any other name, also a non-canonical one (``round_7.pt`` for ``round_00007.pt``)."""
        head, _, tail = self.template.partition("{")
        suffix = tail.partition("}")[2]
        digits = name[len(head) : len(name) - len(suffix)]
        if not (name.startswith(head) and name.endswith(suffix) and digits.isascii() and digits.isdigit()):
            return None
        return int(digits) if self.name(int(digits)) == name else None

    def numbers(self, folder: Path) -> list[int]:
        if not folder.is_dir():
            return []
        return sorted(n for path in folder.iterdir() if (n := self.number(path.name)) is not None)


def lock_beside(path: Path) -> Path:
    """Held by whoever rewrites ``path``."""
    return path.with_name(path.name + SHARD_LOCK_SUFFIX)


class Under:
    """``labels = Under("labels.parquet")`` reads as ``self.root / "labels.parquet"``, ``probe =
    Under("probe", ProbeFiles)`` as ``ProbeFiles(self.root / "probe")``; on the class
    (``TargetFiles.labels``) it holds the ``.name``, for a glob or a message."""

    def __init__(self, name: str, kind: Callable[[Path], Any] = Path) -> None:
        self.name, self.kind = name, kind

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else self.kind(obj.root / self.name)


@dataclass(frozen=True)
class Folder:
    """A family of files and folders under ``root``."""

    root: Path

    def __init__(self, root: str | os.PathLike[str]) -> None:
        object.__setattr__(self, "root", Path(root))


class ManifestFiles(Folder):
    """``D/manifest/``."""

    manifest = Under("manifest.parquet")
    rejects = Under("rejects.parquet")
    speakers = Under("speakers.parquet")  # D/manifest/: per-speaker manifest hashes; D/cmvn/: per-speaker table
    decode_cache = Under("decode_cache.parquet")
    publish_lock = Under(".publish.lock")
    staging = Under(".staging")  # one subfolder per manifest run, removed after it


@dataclass(frozen=True)
class ShardPaths:
    """One speaker's feature shard ``<speaker>.parquet`` and the files beside it."""

    shard: Path
    rejects: Path
    stats: Path
    meta: Path
    lock: Path

    @classmethod
    def of(cls, shards_dir: str | os.PathLike[str], speaker_id: str) -> Self:
        shard = Path(shards_dir) / f"{speaker_id}.parquet"
        meta = shard.with_name(speaker_id + SHARD_META_SUFFIX)
        return cls(shard, *sidecar_paths(shard), meta, shard.with_name(f".{speaker_id}{SHARD_LOCK_SUFFIX}"))


def sidecar_paths(shard_path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """``<dir>/<stem>.rejects.parquet`` and ``<dir>/<stem>.stats.npz`` beside ``<dir>/<stem>.parquet``."""
    shard_path = Path(shard_path)
    stem = shard_path.name.removesuffix(".parquet")
    return shard_path.with_name(stem + SHARD_REJECTS_SUFFIX), shard_path.with_name(stem + SHARD_STATS_SUFFIX)


class CmvnFiles(Folder):
    """``D/cmvn/`` (also the ``cmvn.npz`` copied into an export)."""

    cmvn = Under("cmvn.npz")
    speaker_sums = Under("speaker_sums.npz")
    speakers = ManifestFiles.speakers


class TargetFiles(Folder):
    """One client's k-means targets of one iteration: ``D/kmeans/<client>/`` or ``D/kmeans_iter2/<client>/``."""

    labels = Under("labels.parquet")
    quality = Under("quality.json")  # the publish record, written last
    codebook = Under("codebook.npy")  # (K, D)
    state = Under("state.npz")  # the fit's resumable state

    @property
    def lock(self) -> Path:
        """Held by whoever writes the folder."""
        return self.root.parent / f".{self.root.name}{SHARD_LOCK_SUFFIX}"


class RunRecord(Folder):
    """What every run's folder holds, centralised or federated."""

    final = Under("final.pt")
    result = Under("result.json")
    provenance = Under("provenance.json")  # beside a run's result.json: its git commit, MLflow and Dagster runs
    settings = Under("settings.json")
    mlflow_run_id = Under("mlflow_run_id")


class RunFiles(RunRecord):
    """A training run's folder (centralised, iteration 2, distilled, fine-tuning)."""

    config = Under("config.json")
    launch_config = Under("launch_config.json")
    plan = Under("plan.json")  # beside config.json: the launcher's plan for that attempt, which its workers take
    metrics = Under("metrics.jsonl")
    log = Under("train.log")
    oom = Under("oom.json")
    speed = Under("speed.json")  # beside a distilled run's result.json: student and teacher forward speed
    labelled = Under("labelled.json")  # in a fine-tuning run's folder: the labelled subset it trains on
    checkpoints = Under("checkpoints")  # a run's resumable checkpoints, one per step:
    checkpoint_steps = Numbered("step_{:08d}.pt")

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / self.checkpoint_steps.name(step)

    node_logs = Numbered("node{}.log")  # the output of node N (1..nnodes-1) that the asset started

    def node_log(self, rank: int) -> Path:
        return self.root / self.node_logs.name(rank)

    rank_results = Numbered("result.rank{}.json")  # a parallel fine-tuning batch: the result of rank N > 0

    def rank_result(self, rank: int) -> Path:
        """The result of rank ``rank`` of a fine-tuning batch: ``result.json`` on rank 0."""
        return self.result if rank == 0 else self.root / self.rank_results.name(rank)


class FlowerHome(Folder):
    """A ``FLWR_HOME``: Flower's ``config.toml`` (its SuperLink connections)."""

    config = Under("config.toml")  # Flower's own name for the connections file of a ``FLWR_HOME``


class FlowerTls(Folder):
    """``flower/tls/``: the local federation's throw-away CA and the SuperLink's certificate and key."""

    ca = Under("ca.crt")
    cert = Under("superlink.crt")
    key = Under("superlink.key")


class NodeKeys(Folder):
    """``flower/auth/``: each SuperNode's key pair, ``<client>.key`` (private, 0600) and ``<client>.pub``."""

    def private(self, client_id: str) -> Path:
        return self.root / NODE_PRIVATE_KEY.format(client_id)

    def public(self, client_id: str) -> Path:
        return self.root / NODE_PUBLIC_KEY.format(client_id)

    def all_private(self) -> list[Path]:
        return sorted(self.root.glob(NODE_PRIVATE_KEY.format("*")))


class FlowerFiles(Folder):
    """``D/federated/<run>/flower/``: one folder per process of the local federation (its log and
    ``FLWR_HOME``), TLS and node keys."""

    cli = Under("cli")  # the FLWR_HOME of flwr commands
    pids = Under("pids.json")  # each daemon's supervisor pid and Flower pid
    nodes = Under("nodes.json")  # deleted on stop, as auth/
    run_log = Under("flwr-run.log")
    simulation_log = Under("simulation.log")
    simulation_nodes = Under("simulation_nodes.json")
    superlink_log = Under("superlink/superlink.log")
    superlink_home = Under(f"superlink/{FLOWER_HOME_DIR}")
    tls_dir = Under("tls")
    tls = Under(tls_dir.name, FlowerTls)
    auth_dir = Under("auth")
    auth = Under(auth_dir.name, NodeKeys)

    def supernode_log(self, client_id: str) -> Path:
        return self.root / SUPERNODE_DIR.format(client_id) / SUPERNODE_LOG

    def supernode_home(self, client_id: str) -> Path:
        return self.root / SUPERNODE_DIR.format(client_id) / FLOWER_HOME_DIR


class FederatedPaths(RunRecord):
    """``D/federated/<run>/``; no client state: that lives under each SuperNode's root (:class:`ClientRunFiles`)."""

    rounds_dir = Under("rounds")
    round_checkpoints = Numbered("round_{:05d}.pt")  # global encoder + server optimiser, the last keep_rounds
    round_records = Numbered("round_{:05d}.json")  # that round's rows, missing clients, hashes; all kept

    def round_checkpoint(self, round_number: int) -> Path:
        return self.rounds_dir / self.round_checkpoints.name(round_number)

    def round_record(self, round_number: int) -> Path:
        return self.rounds_dir / self.round_records.name(round_number)

    rounds_table = Under("rounds.parquet")
    evaluation_table = Under("evaluation.parquet")
    received = Under("received.jsonl")  # what the server received: record names, keys and shapes
    failure = Under("failure.json")
    server_log = Under("server.log")
    run_config = Under("run_config.toml")
    flower_dir = Under("flower")
    flower = Under(flower_dir.name, FlowerFiles)
    # ``{node id: client id}`` registered with the local SuperLink; absent for a remote one
    nodes = Under(f"{flower_dir.name}/nodes.json")


class ClientRunFiles(Folder):
    """One client's state of one federated run, ``<state root>/<run>/``: its head after each round
    and its secure-aggregation secrets of each round (owner-only)."""

    heads_dir = Under("heads")
    heads = Numbered("round_{:05d}.pt")
    secagg_dir = Under("secagg")
    secagg_rounds = Numbered("round-{}.json")
    # held while a stage reads and writes its round state
    secagg_lock = Under(f"{secagg_dir.name}/.lock")

    def head(self, round_number: int) -> Path:
        return self.heads_dir / self.heads.name(round_number)

    def secagg_round(self, round_number: int) -> Path:
        return self.secagg_dir / self.secagg_rounds.name(round_number)


class ProbeFiles(Folder):
    """``D/probe/``; the results are written last: their hash is the data version."""

    @classmethod
    def beside(cls, results: str | os.PathLike[str]) -> ProbeFiles:
        return cls(Path(results).parent)

    results = Under("results.parquet")
    utterances = Under("utterances.parquet")
    leaderboard = Under("leaderboard.parquet")
    speakers = Under("speakers.json")


class ExportedModel(Folder):
    """An exported model's folder; ``card`` is the JSON that says how to feed it and read its output."""

    onnx: Path
    torch: Path
    card: Path

    @property
    def published(self) -> tuple[Path, Path, Path]:
        """What the export's data version hashes."""
        return self.onnx, self.torch, self.card


class ExportFiles(ExportedModel):
    """One export: ``D/export/<sha16>-layer<N>/``."""

    @staticmethod
    def folder_name(encoder_sha256: str, layer: int) -> str:
        """Named after the layer's index (``-1`` for "the last" resolved first: ``layer4``)."""
        if layer < 0:
            raise ValueError(f"an export folder names a layer's index, not {layer}: resolve it first")
        return f"{encoder_sha256[:16]}-layer{layer}"

    onnx = Under("encoder.onnx")
    torch = Under("encoder.pt")
    card = Under("encoder.json")
    cmvn = CmvnFiles.cmvn


class RecogniserFiles(ExportedModel):
    """``D/finetune/recogniser/``."""

    onnx = Under("recogniser.onnx")
    torch = Under("recogniser.pt")
    card = Under("recogniser.json")
    frontend = Under("frontend.onnx")  # 16 kHz audio -> the recogniser's CMVN-normalised log-mel


class FinetuneFiles(Folder):
    """``D/finetune/``."""

    results = Under("results.parquet")
    recogniser = Under("recogniser")
    runs = Under("runs")  # one folder per fine-tuning run (:class:`RunFiles`)
    batches = Under("batches")  # one folder per launch of several runs: its result.json, result.rank<N>.json


class ReportFiles(Folder):
    """``D/report/``."""

    index = Under("index.html")
    audio = Under("audio")
    input_versions = Under("input_versions.json")  # the lineage the stats were built from
    plots = Under(".plots")  # the report's plots' PNGs by input hash (PLOT_SUFFIX), reused while unchanged


class DecoderFiles(Folder):
    """A beam decoder's files in a recogniser's folder."""

    lexicon = Under("lexicon.txt")
    lms = Numbered("{}gram.arpa")

    def lm(self, order: int) -> Path:
        return self.root / self.lms.name(order)


class DataLayout(Folder):
    """Every output folder under the data dir ``root``."""

    manifest = Under("manifest", ManifestFiles)
    shards_dir = Under("features/shards")
    verified = Under(f"{shards_dir.name}/.verified.json")  # what shards_are_consistent already read
    cmvn = Under("cmvn", CmvnFiles)
    clients_file = Under("clients/clients.parquet")

    def targets_root(self, iteration: int = 1) -> Path:
        return self.root / TARGETS_DIRS[iteration]

    def targets(self, client_id: str, iteration: int = 1) -> TargetFiles:
        return TargetFiles(self.targets_root(iteration) / client_id)

    def all_targets(self, iteration: int = 1) -> list[TargetFiles]:
        """Every client's published targets of ``iteration``, by client."""
        return [
            TargetFiles(q.parent) for q in sorted(self.targets_root(iteration).glob(f"*/{TargetFiles.quality.name}"))
        ]

    training_dir = Under("training")
    training_iter2_dir = Under("training_iter2")
    distill_dir = Under("distill")
    federated_dir = Under("federated")

    def federated_run(self, run_name: str) -> FederatedPaths:
        return FederatedPaths(self.federated_dir / run_name)

    client_state_dir = Under("federated_clients")  # one state root per local SuperNode: ``<this>/<client>/``

    def results_of(self, runs_dir: Path) -> list[Path]:
        """The ``result.json`` of every finished run, by path."""
        return sorted(runs_dir.glob(f"*/{RunRecord.result.name}"))

    probe = Under(PROBE_DIR, ProbeFiles)

    export_dir = Under("export")

    def export(self, encoder_sha256: str, layer: int) -> ExportFiles:
        return ExportFiles(self.export_dir / ExportFiles.folder_name(encoder_sha256, layer))

    finetune = Under(FINETUNE_DIR, FinetuneFiles)
    report = Under("report", ReportFiles)

    stats_db = Under("stats.duckdb")
    mlflow_db = Under("mlflow.db")
    mlflow_artifacts = Under("mlartifacts")
