"""Training configuration: one JSON file fully describes a run (inputs, model, optimisation, tracking)."""

from __future__ import annotations

import functools
import json
import os
import typing
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Self

from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from speech_assets.layout import RunFiles
from speech_assets.locations import redact_uri
from speech_assets.model.presets import PRESETS
from speech_assets.utils import atomic_write_text

if TYPE_CHECKING:  # torch: the code location reads these defaults (defs/resources.py) without it
    from speech_assets.train.augment import Augmentation

Precision = Literal["auto", "fp32", "bf16", "fp16"]
Device = Literal["auto", "cpu", "cuda"]
Normalisation = Literal["utterance", "global"]  # global: the CMVN of the training speakers only
PRECISIONS, DEVICES = typing.get_args(Precision), typing.get_args(Device)
# pydantic constraints: a settings section filled into one of these configs takes them with the
# defaults (speech_assets.defs.resources.WorkerSettings), so each bound is written once, here
AtLeast0 = Annotated[int, Field(ge=0)]
AtLeast1 = Annotated[int, Field(ge=1)]
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Probability = Annotated[float, Field(ge=0, le=1)]
# a path given as a Path is stored as its string (configs are JSON)
Text = Annotated[str, BeforeValidator(lambda value: os.fspath(value) if isinstance(value, os.PathLike) else value)]
# every config of a run refuses bad values with their field's name, never echoing a value (a
# tracking URI may hold credentials until to_dict() redacts it)
config_dataclass = functools.partial(pydantic_dataclass, config=ConfigDict(hide_input_in_errors=True))


def _preset(name: str) -> str:
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}")
    return name


Preset = Annotated[str, AfterValidator(_preset)]


@dataclass
class ClientTargets:
    labels: str
    k: int


class JsonFile:
    """A dataclass stored as one JSON file, refusing unknown fields when read."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields: {unknown}")
        return cls(**data)

    def to_json(self, path: str | os.PathLike[str] | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"
        if path is not None:
            atomic_write_text(path, text)
        return text

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> Self:
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


@config_dataclass(kw_only=True)
class RunConfig(JsonFile):
    """What every training run's config has: its inputs, what the engine and tracker read, and the stored form."""

    run_dir: Text
    shards: list[Text]
    cmvn: Text
    clients: dict[str, ClientTargets]
    heldout_fraction: Annotated[float, Field(ge=0, lt=1)] = 0.1
    # the held-out speakers when the caller chose them; None: heldout_speakers() at heldout_fraction
    heldout_speakers: list[str] | None = None
    normalisation: Normalisation = "utterance"
    weight_decay: float = 0.01
    clip_norm: float = 10.0
    seed: int = 0
    max_frames: AtLeast1 = 1500
    log_every: AtLeast1 = 10
    device: Device = "auto"
    threads: AtLeast1 | None = None
    data_versions: dict[str, str] = field(default_factory=dict)
    git_sha: str | None = None
    mlflow_tracking_uri: str | None = None
    mlflow_experiment: str = "speech_assets"
    mlflow_artifact_location: str | None = None
    mlflow_run_name: str | None = None
    # the MLflow run's ``mode`` tag ("" = centralised) and the Dagster run that launched it (tags, never params)
    mode: str = ""
    dagster_run_id: str | None = None

    def __post_init__(self) -> None:
        self.clients = dict(sorted(self.clients.items()))

    def to_dict(self) -> dict[str, Any]:
        """The config as stored: the tracking URI without credentials (they travel in ``$MLFLOW_TRACKING_URI`` only)."""
        data = asdict(self)
        if data["mlflow_tracking_uri"]:
            data["mlflow_tracking_uri"] = redact_uri(data["mlflow_tracking_uri"])
        return data


@config_dataclass
class TrainConfig(RunConfig):
    """Everything a training run needs; ``"auto"``/``None`` values are resolved by autoconfig. Batch
    sizes are seconds of unpadded audio: ``batch_seconds`` per device and micro-batch,
    ``target_batch_seconds`` per optimizer step over all devices."""

    preset: Preset = "tiny"
    max_steps: AtLeast1 = 300
    batch_seconds: Positive | None = None
    target_batch_seconds: Positive = 60.0
    grad_accum: Literal["auto"] | AtLeast1 = "auto"
    lr: Positive = 2e-3
    warmup_steps: AtLeast0 = 30
    checkpoint_every: AtLeast1 = 100
    # also a checkpoint at the first log step this many minutes after the last one (0: steps only)
    checkpoint_minutes: Annotated[float, Field(ge=0)] = 0.0
    # hash and write checkpoints in a background thread (the step waits for a copy to host memory)
    background_checkpoints: bool = True
    keep_checkpoints: AtLeast1 = 3
    precision: Precision = "auto"
    # the encoder through torch.compile (dynamic shapes); off: eager
    compile: bool = False
    # the loss on unmasked frames too (HuBERT's is 0): 1.0 took the probe's CER from 0.83x to 0.70x
    # fbank's at the learning benchmark's budget (docs/BENCHMARKS.md)
    unmasked_weight: float = 1.0
    mask_prob: Probability = 0.08
    mask_length: AtLeast1 = 10
    # each batch cut to its shortest utterance at random per-utterance offsets (fairseq), so attention
    # needs no padding mask; off: batches padded to their longest utterance
    crop_batches: bool = True
    # DataLoader workers per process; -1: auto (engine.default_workers)
    num_workers: Annotated[int, Field(ge=-1)] = -1
    max_restarts: AtLeast0 = 2
    nproc: Literal["auto"] | AtLeast1 = "auto"
    # online augmentation of the training utterances (speech_assets/train/augment.py); off by default
    noise: str = ""  # "", "coloured", "babble" or a folder of noise audio (MUSAN)
    noise_prob: float = 0.5
    noise_snr_db: list[float] = field(default_factory=lambda: [5.0, 20.0])
    specaugment: bool = False

    @model_validator(mode="after")
    def _inputs(self) -> Self:
        problems = []
        if not self.shards:
            problems.append("shards is empty")
        if not self.clients:
            problems.append("clients is empty")
        problems += [f"client {name}: k must be >= 2" for name, c in self.clients.items() if c.k < 2]
        try:
            self.augmentation()
        except (TypeError, ValueError) as error:
            problems.append(f"augmentation: {error}")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def augmentation(self) -> Augmentation:
        from speech_assets.train.augment import Augmentation

        low, high = self.noise_snr_db
        return Augmentation(
            noise=self.noise, noise_prob=self.noise_prob, snr_db=(float(low), float(high)), specaugment=self.specaugment
        )

    @property
    def chance_accuracy(self) -> float:
        """The accuracy of guessing uniformly, averaged over clients."""
        return sum(1.0 / c.k for c in self.clients.values()) / len(self.clients)


@config_dataclass
class DistillConfig(RunConfig):
    """One distillation run of a training ``final.pt``; ``teacher_layers`` empty = three spaced evenly to the last."""

    teacher: Text
    dim: int = 384
    layers: AtLeast1 = 6
    heads: AtLeast1 = 6
    ffn_dim: int = 1536
    teacher_layers: list[int] = field(default_factory=list)
    cosine_weight: Annotated[float, Field(ge=0)] = 1.0
    max_steps: AtLeast1 = 200
    batch_seconds: Positive = 16.0
    grad_accum: AtLeast1 = 1
    precision: Precision = "auto"
    lr: Positive = 5e-4
    warmup_steps: AtLeast0 = 20
    checkpoint_every: AtLeast1 = 50
    keep_checkpoints: AtLeast1 = 2
    num_workers: AtLeast0 = 0

    @model_validator(mode="after")
    def _heads_divide_dim(self) -> Self:
        if self.dim % self.heads:
            raise ValueError("dim must be divisible by heads")
        return self

    @property
    def preset(self) -> str:
        """The student's name (MLflow tags runs by it, as it does training presets)."""
        return f"student-{self.dim}x{self.layers}"


def _three_shares(stages: list[float]) -> list[float]:
    if len(stages) != 3 or min(stages) < 0 or abs(sum(stages) - 1) > 1e-6:
        raise ValueError("stages must be three shares >= 0 adding up to 1")
    return stages


@config_dataclass(kw_only=True)
class FinetuneConfig(RunConfig):
    """One CTC fine-tuning run of a training ``final.pt`` (``init``: its weights or a random ``scratch``).

    ``labelled``: JSON ``{"train": {utt_id: text}, "heldout": {...}}``, optionally ``dev``. The recipe
    is fairseq's at this scale: only the CTC head trains for ``freeze_steps``; a tri-stage lr
    (``stages``); span masking of frames and log-mel channels. ``scratch`` never freezes. Every
    ``eval_every`` steps the dev CER picks the best weights; ``patience`` stalls stop the run."""

    encoder: Text
    labelled: Text
    init: Literal["pretrained", "scratch"] = "pretrained"
    # the labelled budget the plan drew ``labelled`` for (a tag of the run; the subset is at least this long)
    budget_minutes: float | None = None
    # a ceiling: the run stops early once dev CER has not improved for ``patience`` evaluations
    max_steps: AtLeast1 = 2000
    lr: Positive = 2e-3
    stages: Annotated[list[float], AfterValidator(_three_shares)] = field(default_factory=lambda: [0.1, 0.4, 0.5])
    init_lr_scale: float = 0.01
    final_lr_scale: float = 0.05
    freeze_steps: AtLeast0 = 100
    freeze_frontend: bool = True
    mask_prob: Probability = 0.03
    mask_length: AtLeast1 = 5
    channel_mask_prob: Probability = 0.02
    channel_mask_length: AtLeast1 = 8
    weight_decay: float = 0.0
    batch_seconds: Positive = 16.0
    grad_accum: AtLeast1 = 1
    precision: Precision = "auto"
    checkpoint_every: AtLeast1 = 100
    keep_checkpoints: AtLeast1 = 2
    max_frames: int = 3000  # 100 Hz frames; the pipeline labels no longer utterance
    # beam: flashlight-text's lexicon beam search with the n-gram LM (greedy only, with a warning, without it)
    decoders: list[str] = field(default_factory=lambda: ["greedy", "beam"])
    lm_order: int = 3  # the n-gram LM of the beam decoder, from the labelled transcripts only
    eval_every: AtLeast1 = 50  # steps between dev CER evaluations (each also a checkpoint)
    patience: AtLeast1 = 4  # evaluations without a better dev CER before the run stops
    # the beam decoder's weights are chosen on the dev set from these grids (best dev WER)
    lm_weights: Annotated[list[float], Field(min_length=1)] = field(default_factory=lambda: [0.5, 1.0, 2.0])
    word_scores: Annotated[list[float], Field(min_length=1)] = field(default_factory=lambda: [-1.0, 0.0, 1.0])

    @property
    def preset(self) -> str:
        return f"ctc-{self.init}"


@dataclass
class FinetuneBatch(JsonFile):
    """Several fine-tuning runs in one torchrun launch, each run folder with its own ``config.json``
    and outputs as if launched alone. ``batch_seconds`` and ``grad_accum`` replace every run's (the
    launcher halves the batch after a CUDA out-of-memory error). ``parallel``: each process trains
    its share alone (on a CPU a small model trains faster per core in one thread), else DDP."""

    run_dir: str
    runs: list[str]
    batch_seconds: float
    grad_accum: int = 1
    parallel: bool = False
    device: str = "auto"
    dagster_run_id: str | None = None
    git_sha: str | None = None

    def __post_init__(self) -> None:
        self.runs = [str(r) for r in self.runs]
        if not self.runs or len(set(self.runs)) != len(self.runs):
            raise ValueError(f"a fine-tuning batch needs distinct run folders, got {self.runs}")
        if self.batch_seconds <= 0 or self.grad_accum < 1:
            raise ValueError(
                f"batch_seconds must be > 0 and grad_accum >= 1, got {self.batch_seconds}, {self.grad_accum}"
            )

    def run_config(self, folder: str) -> FinetuneConfig:
        """``folder``'s run config with the batch's batch size; refused unless it names ``folder``."""
        config = FinetuneConfig.from_json(RunFiles(folder).config)
        if Path(config.run_dir).resolve() != Path(folder).resolve():
            raise ValueError(f"{folder}/config.json names another run folder: {config.run_dir}")
        return replace(config, batch_seconds=self.batch_seconds, grad_accum=self.grad_accum)
