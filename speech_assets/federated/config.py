"""The knobs of a federated run and how they travel through Flower (no torch, no flwr: the code
location imports it). Kept apart on purpose: :class:`FederatedConfig` (the server's, as Flower run
config), :class:`LocalConfig` (a round's instructions to the clients, in every message's
``ConfigRecord``) and :class:`NodeConfig` (each SuperNode's own, never sent anywhere). A name from
the server becomes a path on a client only after passing the safe-id rule.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, field, fields
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any, Literal, Self

import tomli_w
from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, model_validator

from speech_assets import layout
from speech_assets.corpus.ids import check_safe_id, why_unsafe
from speech_assets.train import config as train
from speech_assets.train.config import (
    DEVICES,
    AtLeast0,
    AtLeast1,
    NonNegative,
    Positive,
    Precision,
    Preset,
    Probability,
    Text,
    TrainConfig,
)
from speech_assets.utils import from_fields

Strategy = Literal["fedadam", "fedavg", "fedprox"]
ClientLrSchedule = Literal["linear", "constant"]
Scalar = int | float | str | bool
# a client's own floors under secure aggregation (NodeConfig): the fewest clients it shares with
# (k) and the fraction of k its threshold must exceed; docs/PRIVACY.md gives the collusion bound
SECAGG_MIN_SHARES = 3
SECAGG_THRESHOLD_FLOOR = "2/3"
# the largest DP clipping norm a client accepts (NodeConfig); 0 = no bound of its own (the
# launcher gives its clients the run's dp_clipping_norm)
DP_MAX_CLIPPING_NORM = 0.0


def client_limit_problems(
    min_shares: object, threshold_floor: object, max_clipping_norm: object, separator: str = "-"
) -> list[str]:
    """What is wrong with a client's own limits (``separator`` "_" names them as the settings do)."""
    problems = []
    if isinstance(min_shares, bool) or not isinstance(min_shares, int) or min_shares < 2:
        problems.append(f"secagg-min-shares must be an int of at least 2, got {min_shares!r:.40}")
    try:
        floor = Fraction(str(threshold_floor))
    except (ValueError, ZeroDivisionError):
        floor = Fraction(-1)
    if not Fraction(1, 2) <= floor < 1:
        problems.append(f"secagg-threshold-floor must be a fraction in [1/2, 1), got {threshold_floor!r:.40}")
    if (
        isinstance(max_clipping_norm, bool)
        or not isinstance(max_clipping_norm, int | float)
        or not (math.isfinite(max_clipping_norm) and max_clipping_norm >= 0)
    ):
        problems.append(f"dp-max-clipping-norm must be a number >= 0 (0 = no bound), got {max_clipping_norm!r:.40}")
    return [name.replace("-", separator) + " " + rest for name, rest in (p.split(" ", 1) for p in problems)]


def derive_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed from ``seed`` and ``parts`` (sha256; independent of PYTHONHASHSEED)."""
    digest = hashlib.sha256(":".join(map(str, (seed, *parts))).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _key(name: str) -> str:
    return name.replace("_", "-")


def _scalar(value: Any) -> Scalar:
    """What a Flower record holds: a list as one comma-separated string, a mapping as JSON."""
    if isinstance(value, list):
        return ",".join(value)
    return json.dumps(value, sort_keys=True) if isinstance(value, dict) else value


def _odd_shares(shares: int) -> int:
    if shares != 0 and (shares < 3 or shares % 2 == 0):
        raise ValueError("secagg_num_shares must be 0 (every sampled client) or an odd number >= 3")
    return shares


Beta = Annotated[float, Field(ge=0, lt=1)]
# a list travels through Flower's run config and ConfigRecords as one comma-separated string
Csv = Annotated[list[str], BeforeValidator(lambda v: [c for c in v.split(",") if c] if isinstance(v, str) else v)]
FromJson = BeforeValidator(lambda v: json.loads(v or "{}") if isinstance(v, str) else v)


@train.config_dataclass
class FederatedConfig:
    """One federated run, as the server sees it. A round succeeds when ``min_train_nodes`` (0: all)
    clients reply within ``round_timeout_s``. ``client_weights`` are the weights the server knows
    from the clients table, never a client's self-reported count."""

    run_dir: Text
    run_name: str
    clients: Annotated[Csv, AfterValidator(sorted)]
    rounds: AtLeast1 = 3
    local_steps: AtLeast1 = 50
    strategy: Strategy = "fedadam"
    eta: Positive = 0.1  # Flower's default; 0.01 kept a fifth of the clients' round-1 progress (BENCHMARKS)
    beta_1: Beta = 0.9
    beta_2: Beta = 0.99
    tau: Positive = 1e-3
    min_train_nodes: AtLeast0 = 0
    # each round trains a seeded sample of max(1, int(fraction_train * clients), min_train_nodes)
    # clients (a pure function of seed and round: a resumed run samples the same clients)
    fraction_train: Annotated[float, Field(gt=0, le=1)] = 1.0
    # the global encoder is scored on every client's held-out utterances after every
    # evaluate_every-th round and after the last (an evaluation is a message of its own)
    evaluate_every: AtLeast1 = 5
    # FedProx's proximal term on the client (strategy "fedprox"): mu / 2 * ||w - w_global||^2
    proximal_mu: NonNegative = 0.01
    # differential privacy (off at 0): clients clip to dp_clipping_norm, the server adds Gaussian
    # noise to the uniform mean. Client metrics and update norms stay private unless
    # dp_share_client_metrics: epsilon does not cover them (docs/PRIVACY.md)
    dp_noise_multiplier: NonNegative = 0.0
    dp_clipping_norm: float = 1.0
    dp_delta: Annotated[float, Field(gt=0, lt=1)] = 1e-5
    dp_share_client_metrics: bool = False
    # secure aggregation (SecAgg+): the server sees only the sum of updates; each value is bounded by
    # secagg_clipping_range (0 = 2 * client_lr * local_steps); secrets go to secagg_num_shares
    # clients (0 = all sampled; else odd), any secagg_threshold of which rebuild them (0 = floor(2k/3) + 1)
    secure_aggregation: bool = False
    secagg_clipping_range: NonNegative = 0.0
    secagg_threshold: AtLeast0 = 0
    secagg_num_shares: Annotated[int, AfterValidator(_odd_shares)] = 0
    preset: Preset = TrainConfig.preset
    client_lr: Positive = 2e-3
    # "linear": decays to 0 over all rounds x local_steps (benchmark CER 0.570 +- 0.010, constant 0.561 +- 0.004)
    client_lr_schedule: ClientLrSchedule = "constant"
    batch_seconds: Positive = 16.0
    # a local round trains as the centralised trainer does: its defaults
    weight_decay: float = TrainConfig.weight_decay
    clip_norm: float = TrainConfig.clip_norm
    seed: int = TrainConfig.seed
    # the pipeline's held-out speakers, left out of training by every client; train_speakers is recorded
    heldout_speakers: Csv = field(default_factory=list)
    train_speakers: Csv = field(default_factory=list)
    max_frames: AtLeast1 = TrainConfig.max_frames
    mask_prob: Probability = TrainConfig.mask_prob
    mask_length: AtLeast1 = TrainConfig.mask_length
    unmasked_weight: float = TrainConfig.unmasked_weight
    precision: Precision = TrainConfig.precision
    round_timeout_s: Positive = 3600.0
    connect_timeout_s: Positive = 300.0
    keep_rounds: AtLeast1 = 2
    max_update_norm: NonNegative = 0.0  # 0 = automatic
    client_weights: Annotated[dict[str, float], FromJson] = field(default_factory=dict)
    data_versions: Annotated[dict[str, str], FromJson] = field(default_factory=dict)

    @model_validator(mode="after")
    def _dp_clipping(self) -> Self:
        if self.dp_noise_multiplier > 0 and not (self.dp_clipping_norm > 0 and math.isfinite(self.dp_clipping_norm)):
            raise ValueError("dp_clipping_norm must be > 0")
        return self

    @property
    def required_clients(self) -> int:
        return self.min_train_nodes or self.sample_size

    @property
    def sample_size(self) -> int:
        """How many clients a round samples (Flower's rule)."""
        return min(len(self.clients), max(1, int(self.fraction_train * len(self.clients)), self.min_train_nodes))

    @property
    def differential_privacy(self) -> bool:
        return self.dp_noise_multiplier > 0

    def secagg_shares(self) -> int:
        return min(self.secagg_num_shares or self.sample_size, self.sample_size)

    def evaluates(self, round_number: int) -> bool:
        return round_number % self.evaluate_every == 0 or round_number == self.rounds

    def __post_init__(self) -> None:
        problems = []
        if not self.clients:
            problems.append("clients is empty")
        if len(set(self.clients)) != len(self.clients):
            problems.append("clients has duplicates")
        problems += [f"client id {c!r} {why}" for c in self.clients if (why := why_unsafe(c))]
        if self.min_train_nodes > len(self.clients):
            problems.append(f"min_train_nodes must be in [0, {len(self.clients)}] (0 = all clients)")
        if self.secure_aggregation and (self.sample_size < 2 or self.min_train_nodes == 1):
            problems.append(
                "secure_aggregation needs at least 2 clients per round and min_train_nodes 0 or >= 2 "
                "(a sum of one is the update)"
            )
        shares = self.secagg_shares()
        if (
            self.secagg_threshold > 0
            and self.secure_aggregation
            and not shares < 2 * self.secagg_threshold <= 2 * shares
        ):
            problems.append(
                f"secagg_threshold must be 0 (automatic) or more than half of, and at most, the {shares} "
                "shares each client makes (a threshold of half or less lets a server rebuild both "
                "secrets of a client)"
            )
        problems += [f"speaker id {s!r} {why}" for s in self.heldout_speakers if (why := why_unsafe(s))]
        if why := why_unsafe(self.run_name):
            problems.append(f"run_name {self.run_name!r} {why}")
        if self.client_weights:
            if set(self.client_weights) != set(self.clients):
                problems.append("client_weights must name exactly the clients")
            if not all(w > 0 and math.isfinite(w) for w in self.client_weights.values()):
                problems.append("client_weights must be > 0")
        if problems:
            raise ValueError("invalid FederatedConfig: " + "; ".join(problems))

    def to_run_config(self) -> dict[str, Scalar]:
        """The run config for ``flwr run --run-config``."""
        return {_key(name): _scalar(value) for name, value in asdict(self).items()}

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> FederatedConfig:
        """Parse a Flower run config (unknown keys ignored), refusing :data:`SETTINGS_FILE_ONLY`."""
        named = sorted(set(map(_key, SETTINGS_FILE_ONLY)) & set(run_config))
        if named:
            raise ValueError(f"run config may not set {named}: they are set in the settings file only ([federated])")
        return cls(**{f.name: run_config[_key(f.name)] for f in fields(cls) if _key(f.name) in run_config})

    def settings(self) -> dict[str, Any]:
        """What a run computes depends on (a run folder may resume with other timeouts)."""
        return {k: v for k, v in self.to_dict().items() if k not in NOT_SETTINGS}

    def local(self, round_number: int = 1) -> LocalConfig:
        """What every client is told in round ``round_number`` (linear: lr at its first and last step)."""
        start, end = self.client_lr, self.client_lr
        if self.client_lr_schedule == "linear":
            start = self.client_lr * (1 - (round_number - 1) / self.rounds)
            end = self.client_lr * (1 - round_number / self.rounds)
        mu = self.proximal_mu if self.strategy == "fedprox" else 0.0
        return from_fields(LocalConfig, self, lr=start, lr_end=end, proximal_mu=mu)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Where a federation connects, what it trusts and where its SuperNodes write: the launcher's
# settings (the settings file, or the command line of whoever starts it), never a run config's.
SETTINGS_FILE_ONLY = ("superlink", "superlink_root_certificates", "insecure", "client_state_root")
# Not compared when a run folder is resumed: where it lives, and how long the server waits.
NOT_SETTINGS = ("run_dir", "run_name", "round_timeout_s", "connect_timeout_s")


def settings_changes(before: Mapping[str, Any], now: Mapping[str, Any], *, resuming: bool) -> list[str]:
    """``"name: old -> new"`` for each difference; ``resuming`` allows other rounds (a run may be extended)."""
    names = sorted((set(before) | set(now)) - ({"rounds"} if resuming else set()))
    pairs = ((name, before.get(name, "<unset>"), now.get(name, "<unset>")) for name in names)
    return [f"{name}: {_short(old)} -> {_short(new)}" for name, old, new in pairs if old != new]


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True) if isinstance(value, dict | list) else repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


# Under DP the server refuses an update norm above dp_clipping_norm by more than this share: the
# update travels as global + update in float32 (measured rounding: a few 1e-6 of the norm). What is
# accepted is scaled to the clipping norm exactly, so the tolerance never enters the guarantee.
DP_NORM_TOLERANCE = 1e-3


def update_norm_bound(config: FederatedConfig, encoder_values: int) -> float:
    """The largest update norm the server accepts. Automatic: AdamW moves each value by about
    ``client_lr`` per step at most, so an honest client stays within half of this bound."""
    if config.differential_privacy:
        clip = config.dp_clipping_norm * (1.0 + DP_NORM_TOLERANCE)
        return min(clip, config.max_update_norm) if config.max_update_norm > 0 else clip
    if config.max_update_norm > 0:
        return config.max_update_norm
    return 2.0 * config.client_lr * config.local_steps * math.sqrt(max(encoder_values, 1))


@train.config_dataclass(frozen=True)
class LocalConfig:
    """A round's instructions to a client: ``local_steps`` AdamW steps (fresh state each round), lr
    going linearly from ``lr`` to ``lr_end``, masking and loss as the centralised trainer's."""

    run_name: str
    local_steps: int
    lr: float
    lr_end: float
    preset: str
    batch_seconds: float
    weight_decay: float
    clip_norm: float
    seed: int
    heldout_speakers: Csv
    max_frames: int
    mask_prob: float
    mask_length: int
    unmasked_weight: float
    precision: str
    proximal_mu: float = 0.0  # FedProx's mu ("proximal-mu", the key Flower's FedProx sends too)

    def to_record(self) -> dict[str, Scalar]:
        return {_key(name): _scalar(value) for name, value in asdict(self).items()}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> LocalConfig:
        """Parse a round's instructions; the run name becomes a folder there, so it must be a safe id."""
        values = {item.name: record[_key(item.name)] for item in fields(cls) if _key(item.name) in record}
        missing = [_key(item.name) for item in fields(cls) if item.name not in values and item.name != "proximal_mu"]
        if missing:
            raise ValueError(f"the round's config lacks {missing[0]!r}")
        check_safe_id(values["run_name"], "the run name sent by the server")
        return cls(**values)


def _flag(value: object) -> object:
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        raise ValueError(f"must be true or false (got {value!r:.40})")
    return value


# a number where a text is due (client-id=3, secagg-threshold-floor=0.75) is taken as its text
@train.config_dataclass(frozen=True, config=ConfigDict(hide_input_in_errors=True, coerce_numbers_to_str=True))
class NodeConfig:
    """A SuperNode's own settings (``--node-config``), never sent nor taken from the server.
    ``state-root`` holds its heads between rounds (never inside a server's run folder); ``node-keys``
    (:class:`~speech_assets.layout.NodeKeys`) is needed for any secure round. It refuses a round of
    fewer than ``secagg-min-shares`` clients, a threshold of at most ``secagg-threshold-floor`` x k,
    a DP clipping norm above ``dp-max-clipping-norm`` (a huge norm switches clipping off), and with
    ``require-*`` a round whose update would leave in the clear or unclipped."""

    client_id: str
    data_dir: str
    state_root: str = ""
    threads: int = 0
    device: str = "auto"
    node_keys: str = ""
    secagg_min_shares: int = SECAGG_MIN_SHARES
    secagg_threshold_floor: str = SECAGG_THRESHOLD_FLOOR
    dp_max_clipping_norm: float = DP_MAX_CLIPPING_NORM
    require_secure_aggregation: Annotated[bool, BeforeValidator(_flag)] = False
    require_dp: Annotated[bool, BeforeValidator(_flag)] = False

    def __post_init__(self) -> None:
        check_safe_id(self.client_id, "this SuperNode's client-id")
        problems = client_limit_problems(self.secagg_min_shares, self.secagg_threshold_floor, self.dp_max_clipping_norm)
        if problems:
            raise ValueError("; ".join(problems))

    def min_threshold(self, num_shares: int) -> int:
        """The lowest threshold this node accepts for ``num_shares`` shares (exact arithmetic), at least 2."""
        return max(2, math.floor(Fraction(str(self.secagg_threshold_floor)) * num_shares) + 1)

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> NodeConfig:
        missing = [k for k in ("client-id", "data-dir") if k not in node_config]
        if missing:
            raise ValueError(
                f"this SuperNode has no {missing} in its --node-config: start it with "
                '--node-config \'client-id="client_00" data-dir="/path/to/data"\''
            )
        if "state-dir" in node_config:
            raise ValueError("node config state-dir is gone: name the folder this SuperNode owns with state-root")
        if str(node_config.get("device", "auto")) not in DEVICES:
            raise ValueError(f"node config device must be one of {DEVICES}")
        return cls(**{f.name: node_config[_key(f.name)] for f in fields(cls) if _key(f.name) in node_config})

    def to_node_config(self) -> str:
        """``flower-supernode``'s ``--node-config``: the values other than the defaults, as TOML pairs."""
        changed = {_key(f.name): getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}
        return " ".join(line.replace(" = ", "=", 1) for line in tomli_w.dumps(changed).splitlines())

    @property
    def root(self) -> Path:
        if self.state_root:
            return Path(self.state_root)
        return layout.DataLayout(self.data_dir).client_state_dir / self.client_id

    def client_dir(self, run_name: str) -> Path:
        """This client's state folder for ``run_name`` (a name from the server, so checked)."""
        return self.root / check_safe_id(run_name, "the run name sent by the server")
