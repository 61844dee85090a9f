"""The knobs of a federated run, how they travel through Flower, and the layout of its folder.

Pure Python (no torch, no flwr): the Dagster code location imports it for its config schema.

Three kinds of settings, kept apart on purpose:

- :class:`FederatedConfig` (the server's): strategy, rounds, who takes part, where the server
  writes. It reaches the ServerApp as Flower *run config* (``[tool.flwr.app.config]`` of the app's
  pyproject.toml, overridden by ``flwr run --run-config``): flat keys, hyphenated, scalar values.
- :class:`LocalConfig` (a round's instructions to the clients): local steps, client learning rate,
  model preset, masking, precision. The server sends it in every train/evaluate message's
  ``ConfigRecord``; Flower's own ``eta_l`` is not used (Flower's strategies do not apply it either).
- :class:`NodeSettings` (each SuperNode's own, never sent anywhere): its client id, where its data
  lives, where it keeps its head between rounds, its threads and device. Set with
  ``flower-supernode --node-config 'client-id="client_00" data-dir="/data/out"'``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

STRATEGIES = ("fedadam", "fedavg")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")
Scalar = int | float | str | bool


def _key(name: str) -> str:
    return name.replace("_", "-")


@dataclass
class FederatedConfig:
    """One federated run, as the server sees it.

    ``clients`` are the client ids expected to take part (the SuperNodes' ``client-id``);
    ``min_train_nodes`` = 0 means all of them. A round succeeds when at least
    ``min_train_nodes`` clients reply within ``round_timeout_s``; the others are logged as missing.
    ``keep_rounds`` bounds the round checkpoints kept (each holds the encoder and the server
    optimiser's moments); every round's record (rows, missing clients, hashes) is always kept.
    """

    run_dir: str
    run_name: str
    clients: list[str]
    rounds: int = 3
    local_steps: int = 50
    strategy: str = "fedadam"
    eta: float = 1e-2
    beta_1: float = 0.9
    beta_2: float = 0.99
    tau: float = 1e-3
    min_train_nodes: int = 0
    preset: str = "tiny"
    client_lr: float = 2e-3
    batch_seconds: float = 16.0
    weight_decay: float = 0.01
    clip_norm: float = 10.0
    seed: int = 0
    heldout_fraction: float = 0.1
    max_frames: int = 1500
    mask_prob: float = 0.08
    mask_length: int = 10
    unmasked_weight: float = 0.0
    precision: str = "auto"
    round_timeout_s: float = 3600.0
    connect_timeout_s: float = 300.0
    keep_rounds: int = 2
    data_versions: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.clients, str):
            self.clients = [c for c in self.clients.split(",") if c]
        self.clients = sorted(str(c) for c in self.clients)
        self.validate()

    @property
    def required_clients(self) -> int:
        """How many clients must reply for a round to count."""
        return self.min_train_nodes or len(self.clients)

    def validate(self) -> None:
        from speech_assets.model.presets import get_preset

        get_preset(self.preset)
        problems = []
        if not self.clients:
            problems.append("clients is empty")
        if len(set(self.clients)) != len(self.clients):
            problems.append("clients has duplicates")
        if any("," in c or not c for c in self.clients):
            problems.append("client ids must be non-empty and contain no comma")
        if self.strategy not in STRATEGIES:
            problems.append(f"strategy must be one of {STRATEGIES}")
        if self.precision not in PRECISIONS:
            problems.append(f"precision must be one of {PRECISIONS}")
        if not 0 <= self.min_train_nodes <= len(self.clients):
            problems.append(f"min_train_nodes must be in [0, {len(self.clients)}] (0 = all clients)")
        for name in ("rounds", "local_steps", "keep_rounds", "mask_length", "max_frames"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1")
        for name in ("eta", "client_lr", "batch_seconds", "tau", "round_timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                problems.append(f"{name} must be > 0")
        for name in ("beta_1", "beta_2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                problems.append(f"{name} must be in [0, 1)")
        if not 0.0 <= self.heldout_fraction < 1.0:
            problems.append("heldout_fraction must be in [0, 1)")
        if not self.run_name or "/" in self.run_name:
            problems.append("run_name must be a non-empty folder name")
        if problems:
            raise ValueError("invalid FederatedConfig: " + "; ".join(problems))

    # -- Flower run config: flat, hyphenated, scalar values --------------------------------
    def to_run_config(self) -> dict[str, Scalar]:
        """The run config for ``flwr run --run-config`` (``data_versions`` as a JSON string)."""
        values: dict[str, Scalar] = {}
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name == "clients":
                values["clients"] = ",".join(value)
            elif item.name == "data_versions":
                values["data-versions"] = json.dumps(value, sort_keys=True)
            else:
                values[_key(item.name)] = value
        return values

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> FederatedConfig:
        """Parse a Flower run config (unknown keys are ignored: the app's defaults may hold more)."""
        known = {_key(item.name): item for item in fields(cls) if item.name != "data_versions"}
        values: dict[str, Any] = {}
        for key, item in known.items():
            if key in run_config:
                values[item.name] = _coerce(run_config[key], item.type)
        values["data_versions"] = json.loads(str(run_config.get("data-versions") or "{}"))
        return cls(**values)

    def local(self) -> LocalConfig:
        """What every client is told in a round's ConfigRecord."""
        return LocalConfig(
            run_name=self.run_name,
            local_steps=self.local_steps,
            lr=self.client_lr,
            preset=self.preset,
            batch_seconds=self.batch_seconds,
            weight_decay=self.weight_decay,
            clip_norm=self.clip_norm,
            seed=self.seed,
            heldout_fraction=self.heldout_fraction,
            max_frames=self.max_frames,
            mask_prob=self.mask_prob,
            mask_length=self.mask_length,
            unmasked_weight=self.unmasked_weight,
            precision=self.precision,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _coerce(value: Any, annotation: Any) -> Any:
    text = str(annotation)
    if text.startswith("list"):
        return [c for c in str(value).split(",") if c]
    if text == "int":
        return int(value)
    if text == "float":
        return float(value)
    if text == "bool":
        return bool(value)
    return str(value)


@dataclass(frozen=True)
class LocalConfig:
    """A round's instructions to a client: ``local_steps`` optimizer steps of at most
    ``batch_seconds`` of padded audio each, AdamW at constant ``lr`` (fresh optimizer state every
    round), the same masking, loss and precision as the centralised trainer."""

    run_name: str
    local_steps: int
    lr: float
    preset: str
    batch_seconds: float
    weight_decay: float
    clip_norm: float
    seed: int
    heldout_fraction: float
    max_frames: int
    mask_prob: float
    mask_length: int
    unmasked_weight: float
    precision: str

    def to_record(self) -> dict[str, Scalar]:
        return {_key(k): v for k, v in asdict(self).items()}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> LocalConfig:
        values = {}
        for item in fields(cls):
            if _key(item.name) not in record:
                raise ValueError(f"the round's config lacks {_key(item.name)!r}")
            values[item.name] = _coerce(record[_key(item.name)], item.type)
        return cls(**values)


@dataclass(frozen=True)
class NodeSettings:
    """A SuperNode's own settings (``--node-config``); they never leave the client.

    ``data-dir`` is the client's data folder in the pipeline's layout (``kmeans/<client-id>/``,
    ``features/shards/``); only this client's own files in it are read. ``state-dir`` is where it
    keeps its prediction head between rounds (default: ``<data-dir>/federated/<run>/clients/<id>``).
    ``threads``: intra-op threads (0 = all cores); ``device``: auto, cpu or cuda.
    """

    client_id: str
    data_dir: str
    state_dir: str = ""
    threads: int = 0
    device: str = "auto"

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> NodeSettings:
        missing = [k for k in ("client-id", "data-dir") if k not in node_config]
        if missing:
            raise ValueError(
                f"this SuperNode has no {missing} in its --node-config: start it with "
                "--node-config 'client-id=\"client_00\" data-dir=\"/path/to/data\"'"
            )
        device = str(node_config.get("device", "auto"))
        if device not in DEVICES:
            raise ValueError(f"node config device must be one of {DEVICES}")
        return cls(
            client_id=str(node_config["client-id"]),
            data_dir=str(node_config["data-dir"]),
            state_dir=str(node_config.get("state-dir", "")),
            threads=int(node_config.get("threads", 0)),
            device=device,
        )

    def to_node_config(self) -> str:
        """The ``--node-config`` argument of ``flower-supernode``."""
        parts = [f'client-id="{self.client_id}"', f'data-dir="{self.data_dir}"']
        if self.state_dir:
            parts.append(f'state-dir="{self.state_dir}"')
        if self.threads:
            parts.append(f"threads={self.threads}")
        if self.device != "auto":
            parts.append(f'device="{self.device}"')
        return " ".join(parts)

    def client_dir(self, run_name: str) -> Path:
        """Where this client keeps its state for run ``run_name``."""
        if self.state_dir:
            return Path(self.state_dir)
        return Path(self.data_dir) / "federated" / run_name / "clients" / self.client_id


@dataclass(frozen=True)
class FederatedPaths:
    """The layout of ``<data>/federated/<run>/``.

    ``rounds/round_NNNNN.pt`` (global encoder + server optimiser state, the last ``keep_rounds``)
    and ``rounds/round_NNNNN.json`` (that round's rows, missing clients, hashes; all kept),
    ``rounds.parquet``, ``evaluation.parquet``, ``final.pt``, ``result.json``, ``received.jsonl``
    (what the server received: record names, keys and shapes), ``failure.json``,
    ``clients/<id>/`` (each local client's state: heads, its CMVN), ``flower/`` (Flower homes,
    logs and the run config of the local federation), ``run_config.toml``.
    """

    root: Path

    def __init__(self, root: str | os.PathLike[str]) -> None:
        object.__setattr__(self, "root", Path(root))

    @property
    def rounds_dir(self) -> Path:
        return self.root / "rounds"

    def round_checkpoint(self, round_number: int) -> Path:
        return self.rounds_dir / f"round_{round_number:05d}.pt"

    def round_record(self, round_number: int) -> Path:
        return self.rounds_dir / f"round_{round_number:05d}.json"

    @property
    def rounds_table(self) -> Path:
        return self.root / "rounds.parquet"

    @property
    def evaluation_table(self) -> Path:
        return self.root / "evaluation.parquet"

    @property
    def final(self) -> Path:
        return self.root / "final.pt"

    @property
    def result(self) -> Path:
        return self.root / "result.json"

    @property
    def received(self) -> Path:
        return self.root / "received.jsonl"

    @property
    def failure(self) -> Path:
        return self.root / "failure.json"

    @property
    def server_log(self) -> Path:
        return self.root / "server.log"

    @property
    def run_config(self) -> Path:
        return self.root / "run_config.toml"

    @property
    def flower_dir(self) -> Path:
        return self.root / "flower"

    def client_dir(self, client_id: str) -> Path:
        return self.root / "clients" / client_id
