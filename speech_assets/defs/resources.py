"""Resources: where the corpus and every output live, and the pipeline settings users set once."""

from __future__ import annotations

import copy
import functools
import os
import shlex
import tomllib
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Optional, Self

import dagster as dg
import pyarrow.parquet as pq
import pydantic
from pydantic import create_model, model_validator

from speech_assets import layout, locations
from speech_assets.corpus.ids import check_safe_id
from speech_assets.corpus.manifest import ValidationConfig
from speech_assets.corpus.publish import SpeakerRows
from speech_assets.defs.dagster_internals import NamedSectionTypes
from speech_assets.evaluation.probe_options import Probe, ProbeOptions
from speech_assets.features.shards import ShardFiles
from speech_assets.features.vad import VadConfig
from speech_assets.federated import config as federation
from speech_assets.federated.launch import Deployment
from speech_assets.hosts import check_endpoint, check_host
from speech_assets.targets.config import ITERATION2_KMEANS, KMeansConfig
from speech_assets.train.config import DistillConfig, FinetuneConfig, Normalisation, Precision, RunConfig, TrainConfig
from speech_assets.utils import from_fields, sha256_strings


class StoragePaths(dg.ConfigurableResource):
    """The corpus location and the data dir (every asset writes under it); relative paths resolve
    against the repository root."""

    corpus: str
    data_dir: str
    mlflow_tracking_uri: str

    @classmethod
    def from_environment(cls) -> StoragePaths:
        data = locations.data_dir()
        uri = locations.mlflow_tracking_uri(data)
        return cls(
            corpus=str(locations.corpus_location()),
            data_dir=str(data),
            # a URI with credentials by its variable's name, which the UI shows instead of the value
            mlflow_tracking_uri=dg.EnvVar(locations.TRACKING_URI_ENV) if locations.redact_uri(uri) != uri else uri,
        )

    @property
    def mlflow_artifact_location(self) -> str | None:
        """A new experiment's artifact location: the server's default for an http(s) URI, else under the data dir."""
        return locations.mlflow_artifact_location(self.mlflow_tracking_uri, self.root)

    @property
    def corpus_path(self) -> Path:
        return locations.resolve(self.corpus)

    @property
    def root(self) -> Path:
        return locations.resolve(self.data_dir)

    @property
    def layout(self) -> layout.DataLayout:
        return layout.DataLayout(self.root)

    def shard_file(self, speaker_id: str) -> Path:
        return self.shard_files(speaker_id).shard

    def shard_files(self, speaker_id: str) -> ShardFiles:
        return ShardFiles.of(self.layout.shards_dir, check_safe_id(speaker_id, "speaker_id"))

    def targets(self, client_id: str, iteration: int = 1) -> layout.TargetFiles:
        return self.layout.targets(check_safe_id(client_id, "client_id"), iteration)

    def federated_run(self, run_name: str) -> layout.FederatedPaths:
        return self.layout.federated_run(check_safe_id(run_name, "run_name"))

    def listed_speakers(self) -> dict[str, SpeakerRows]:
        """speakers.parquet as published (empty before the first manifest)."""
        if not self.layout.manifest.speakers.exists():
            return {}
        rows = pq.read_table(self.layout.manifest.speakers).to_pylist()
        return {r["speaker_id"]: SpeakerRows(r.get("manifest_hash"), r.get("utterances"), r.get("hours")) for r in rows}

    def published_shards(self) -> dict[str, dict]:
        """``{speaker: shard meta}`` of the listed speakers whose meta vouches for their shard (never
        inferred from file names: a speaker id could look like another file's suffix)."""
        return {
            s: meta for s in sorted(self.listed_speakers()) if (meta := self.shard_files(s).read_meta()) is not None
        }


# Pipeline settings: one file sets every stage's knobs for every run; a manual run may override them by run config.

SETTINGS_ENV = "SPEECH_ASSETS_SETTINGS"
SETTINGS_FILE = "pipeline.toml"


class WorkerSettings(dg.Config):
    """A settings section filled into a worker's config (``class S(WorkerSettings, worker=TrainConfig)``).

    A field written ``name: type`` takes the worker's default (an instance's value) and constraints, so a
    bad value gets the same message in both; the worker's "after" validators check the section too. A field
    with a value of its own must differ from the worker's: it means something else here."""

    section: ClassVar[str] = ""  # its name in the settings file, for messages
    worker_fields: ClassVar[tuple[str, ...]] = ()
    worker_validators: ClassVar[tuple[Callable[[Any], Any], ...]] = ()

    def __init_subclass__(cls, worker: object = None, section: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if worker is not None:
            taken = worker_fields(cls, worker)
            for name, field in taken.items():
                setattr(cls, name, field)  # before pydantic collects the fields
            worker_type = worker if isinstance(worker, type) else type(worker)
            after = worker_type.__pydantic_decorators__.model_validators.values()
            cls.section, cls.worker_fields = section, tuple(taken)
            cls.worker_validators = tuple(item.func for item in after if item.info.mode == "after")

    @model_validator(mode="after")
    def _worker_validators(self) -> Self:
        values = types.SimpleNamespace(**{name: getattr(self, name) for name in self.worker_fields})
        problems = []
        for check in self.worker_validators:
            try:
                check(values)
            except AttributeError:  # it reads a field the section does not take from the worker
                continue
            except ValueError as error:
                problems.append(str(error))
        if problems:
            raise ValueError(f"[{self.section}] " + "; ".join(problems))
        return self


def worker_fields(section: type, worker: object) -> dict[str, Any]:
    """``{field: pydantic Field}`` with ``worker``'s default and constraints for each field ``section``
    declares without a value; TypeError for a declaration that restates or contradicts ``worker``."""
    declared = section.__dict__.get("__annotations__", {})
    # this section's own annotations, resolved in its module (the class itself is not built yet)
    kinds = typing.get_type_hints(type("Declared", (), {"__annotations__": declared, "__module__": section.__module__}))
    worker_type = worker if isinstance(worker, type) else type(worker)
    theirs = worker_type.__pydantic_fields__
    types_ = typing.get_type_hints(worker_type)
    where = f"{section.__name__} (from {worker_type.__name__})"
    taken = {}
    for name, annotation in declared.items():
        kind = kinds[name]
        if typing.get_origin(kind) is ClassVar:
            continue
        item = theirs.get(name)
        if item is not None:
            default = item.get_default(call_default_factory=True) if isinstance(worker, type) else getattr(worker, name)
            args = typing.get_args(types_[name])
            if typing.get_origin(types_[name]) is tuple and args[1:] == (Ellipsis,) and kind == list[args[0]]:
                default, kind = list(default), types_[name]  # a settings file gives a list for the worker's tuple
        if name in section.__dict__:
            if item is not None and kind == types_[name] and section.__dict__[name] == default:
                raise TypeError(
                    f"{where}: {name} restates {worker_type.__name__}'s default; write `{name}: {annotation}`"
                )
            continue
        if item is None or item.is_required():
            raise TypeError(f"{where}: {name} has no default here nor in {worker_type.__name__}")
        if kind != types_[name]:
            raise TypeError(f"{where}: {name} is {types_[name]} in {worker_type.__name__}, not {annotation}")
        taken[name] = pydantic.Field(default=default)
        taken[name].metadata = list(item.metadata)
    return taken


class ManifestSettings(WorkerSettings, worker=ValidationConfig, section="manifest"):
    """The manifest (`manifest`): which audio files are kept, and the reject ratio that blocks the build."""

    min_duration_s: float
    max_duration_s: float
    max_reject_ratio: float = 0.2
    max_transcript_chars: int  # a longer (normalised) transcript: reject transcript_too_long
    min_sample_rate: int  # Hz; a rate or channel count outside these bounds: reject unsupported_format
    max_sample_rate: int
    max_channels: int
    workers: int = 0  # 0: one decoder per core


def _vad(name: str) -> Any:
    """VadConfig's field ``name``, its default and constraints (the section prefixes its names)."""
    return copy.copy(VadConfig.__pydantic_fields__[name])


class FeatureSettings(dg.Config):
    """Features (`vad_features`): voice activity detection, speed perturbation and the shard builders."""

    vad_aggressiveness: int = _vad("aggressiveness")  # WebRTC VAD mode 0..3
    vad_frame_ms: int = _vad("frame_ms")  # 10, 20 or 30
    vad_padding_ms: int = _vad("padding_ms")
    min_speech_s: float = _vad("min_speech_s")
    min_speech_ratio: float = _vad("min_speech_ratio")
    # processes, this one included; 0: one more per ~4 h of audio, at most one per core; 1: here alone
    workers: int = 0
    # speed perturbation as data: one extra utterance per factor (<utt_id>-sp0_9, -sp1_1), e.g. [0.9, 1.1]
    speed_perturb: list[float] = []


class ClientSettings(WorkerSettings, worker=RunConfig, section="clients"):
    """Clients (`client_partitions`): how speakers split into non-IID clients and who is held out."""

    num_clients: int = 4
    # the share of speakers held out of everything a model trains on, chosen once by their id's hash
    heldout_fraction: float


class KMeansSettings(WorkerSettings, worker=KMeansConfig, section="kmeans"):
    """k-means targets (`kmeans_targets`): clusters per client, frames fitted, when to refit."""

    k: int  # clusters per client (shrinks for small clients)
    max_fit_frames: int  # frames sampled (as whole utterances) for the fit
    seed: int
    # new speakers adding at most this share of a client's frames are labelled with its codebook; more refits
    refit_growth: float = 0.2


NOISE_SOURCES = ("", "coloured", "babble", "folder")


class TrainingSettings(WorkerSettings, worker=TrainConfig, section="training"):
    """The trainer's settings and how its torchrun job is launched."""

    preset: str
    max_steps: int
    batch_seconds: float = 0.0  # per device; 0 = chosen by the auto-configuration
    target_batch_seconds: float  # effective batch, reached with gradient accumulation
    lr: float
    warmup_steps: int
    seed: int
    checkpoint_every: int
    log_every: int
    precision: Precision
    nproc: int = 0  # 0 = auto
    nnodes: str = "1"
    rdzv_endpoint: str = ""  # host:port on the Dagster host (node 0) for multi-node runs
    # how nodes 1..nnodes-1 start (an argument list, no shell): {command} their torchrun command,
    # {host} node_hosts[rank-1]
    node_command: str = "ssh {host} 'cd /srv/speech_assets && {command}'"
    node_hosts: list[str] = []
    threads: int = 0  # intra-op threads per process; 0: this node's cores shared among its processes
    max_restarts: int
    normalisation: Normalisation  # "utterance" or "global" (the training speakers' CMVN)
    max_frames: int
    mask_prob: float  # probability that a 50 Hz frame starts a masked span
    mask_length: int  # span length in 50 Hz frames
    unmasked_weight: float  # weight of the loss on unmasked frames (masked: 1)
    crop_batches: bool  # batches cut to their shortest utterance (no attention padding mask)
    # online augmentation (speech_assets/train/augment.py); HuBERT pretraining uses neither
    noise: str  # "", "coloured", "babble" (same client only) or "folder" (the audio in noise_dir)
    noise_dir: str = ""  # a folder of noise audio (MUSAN's noise/); settings file only
    noise_prob: float
    noise_snr_db: list[float]
    specaugment: bool
    # GPUs the training pod asks for under a Kubernetes executor (0: none); read when the code location loads
    gpus_per_node: int = 0

    # what runs commands, reads files anywhere or names an endpoint, and what a run could not change
    settings_only: ClassVar[frozenset[str]] = frozenset(
        {"node_command", "node_hosts", "noise_dir", "rdzv_endpoint", "gpus_per_node"}
    )

    @model_validator(mode="after")
    def _launch_and_noise(self) -> TrainingSettings:
        for host in self.node_hosts:
            check_host(host, "[training] node_hosts entry")
        if self.rdzv_endpoint:
            check_endpoint(self.rdzv_endpoint, "[training] rdzv_endpoint")
        if "{command}" not in " ".join(shlex.split(self.node_command)):
            raise ValueError(f"[training] node_command must contain {{command}}, got {self.node_command!r}")
        if self.noise not in NOISE_SOURCES:
            folder = f' (a folder: noise_dir = "{self.noise}" and noise = "folder" in the settings file)'
            hint = folder if "/" in self.noise else ""
            raise ValueError(f"[training] noise must be one of {NOISE_SOURCES}, got {self.noise!r}{hint}")
        if self.noise == "folder" and not self.noise_dir:
            raise ValueError('[training] noise = "folder" needs noise_dir, the folder of noise audio')
        return self


class FederatedSettings(WorkerSettings, worker=federation.FederatedConfig, section="federated"):
    """Federated pretraining (`federated_checkpoint`): Flower rounds of local training and server-side aggregation."""

    engine: str = "simulation"  # Flower's simulation runtime here, or "deployment" (local SuperLink + SuperNodes)
    rounds: int
    local_steps: int  # optimizer steps per client per round
    strategy: federation.Strategy  # fedadam, fedavg or fedprox (flwr.serverapp.strategy)
    fraction_train: float  # seeded sample of the clients each round
    evaluate_every: int  # held-out evaluation every k rounds and after the last
    proximal_mu: float  # fedprox's proximal term, on the clients
    dp_noise_multiplier: float  # > 0: differential privacy
    dp_clipping_norm: float
    dp_delta: float
    dp_share_client_metrics: bool  # under DP: clients send their training metrics
    secure_aggregation: bool  # the server sees only the sum of updates
    secagg_clipping_range: float
    secagg_threshold: int  # 0 = floor(2k/3) + 1 of the k shares
    secagg_num_shares: int  # 0 = every sampled client
    eta: float  # FedAdam server learning rate
    beta_1: float
    beta_2: float
    tau: float
    min_train_nodes: int  # clients that must reply for a round to count; 0 = all
    preset: str
    client_lr: float  # sent to the clients with every round
    client_lr_schedule: federation.ClientLrSchedule  # linear (decays to 0 over all rounds) or constant
    batch_seconds: float  # padded audio per local step
    seed: int
    max_frames: int
    mask_prob: float
    mask_length: int
    unmasked_weight: float
    precision: Precision
    superlink: str = ""  # host:port of an existing SuperLink (remote SuperNodes); empty = start one here
    superlink_root_certificates: str = ""  # CA file the remote SuperLink's TLS is verified against
    threads_per_client: int = 0  # torch threads per client; 0 = 1 (simulation) or cores / clients (deployment)
    device: str = "auto"  # local SuperNodes: auto, cpu or cuda
    round_timeout_s: float  # a client silent this long is counted missing for the round
    connect_timeout_s: float  # how long a round waits for its clients (training and evaluation)
    max_update_norm: float  # L2 bound on a client's update (its encoder minus the global); 0 = automatic
    # local SuperNodes' state root (<this>/<client>); "" = <data>/federated_clients
    client_state_root: str = ""
    insecure: bool = False  # a remote SuperLink without TLS is refused unless this is true (settings file only)
    # the local clients' own limits (their node config, never from the server: docs/PRIVACY.md)
    secagg_min_shares: int = federation.SECAGG_MIN_SHARES  # refuse a secure round where fewer clients share with it
    secagg_threshold_floor: str = federation.SECAGG_THRESHOLD_FLOOR  # refuse a threshold of at most this fraction of k
    # refuse a larger DP clipping norm; 0 = dp_clipping_norm
    dp_max_clipping_norm: float = federation.DP_MAX_CLIPPING_NORM

    settings_only: ClassVar[frozenset[str]] = frozenset(federation.SETTINGS_FILE_ONLY)

    @model_validator(mode="after")
    def _superlink_and_client_limits(self) -> FederatedSettings:
        if self.superlink:
            check_endpoint(self.superlink, "[federated] superlink")
        problems = Deployment.of(self).limit_problems(self.dp_clipping_norm)
        if problems:
            raise ValueError("[federated] " + "; ".join(problems))
        return self


class ProbeSettings(WorkerSettings, worker=ProbeOptions, section="probe"):
    """The downstream CTC probe (`downstream_probe`): its options, the utterances it reads, how the verdict is drawn."""

    probe: Probe  # linear, or bilstm (one BiLSTM layer of `hidden` per direction, then linear)
    steps: int  # at most this many AdamW steps per probe (it stops once its development CER stalls)
    batch_size: int
    lr: float
    # each model's lr is the one with the lowest CER on a dev split of the training speakers; [] = lr
    lrs: list[float]
    hidden: int
    seed: int = 0  # the random encoder's initialisation and the utterance subsample
    seeds: list[int]  # one probe per seed and model: the table shows mean and spread over seeds
    max_train_utterances: int = 400  # a seeded subsample of the training speakers' utterances; 0 = all
    max_eval_utterances: int = 200  # of the held-out speakers' utterances; 0 = all
    threads: int = 0  # torch intra-op threads; 0 = torch's default
    # below this many held-out speakers the verdict is "indicative only" (few speakers say little in general)
    min_heldout_speakers: int = 3


class ExportSettings(dg.Config):
    """The exported encoder (`encoder_export`)."""

    layer: int = -1  # hidden states of this layer (0 = the Transformer's input); -1 = the last
    opset: int = 0  # ONNX opset; 0 = the exporter's default
    parity_utterances: int = 8  # real shard utterances the parity check runs on


class DistillSettings(WorkerSettings, worker=DistillConfig, section="distill"):
    """The distilled student (`distilled_checkpoint`): 0 for dim/heads/layers/ffn_dim means three
    quarters of the teacher's width, its heads, half its depth, 4 x dim (576, 12, 6, 2304 for `base`)."""

    dim: int = 0
    layers: int = 0
    heads: int = 0
    ffn_dim: int = 0
    teacher_layers: list[int]  # 1-based teacher layers to predict; empty = three evenly spaced, ending at the last
    cosine_weight: float
    max_steps: int
    batch_seconds: float
    lr: float
    warmup_steps: int
    seed: int
    max_frames: int
    nproc: int = 1  # torchrun processes
    threads: int = 0  # intra-op threads per process; 0 = cores / processes


class Iteration2Settings(WorkerSettings, worker=ITERATION2_KMEANS, section="iteration2"):
    """HuBERT iteration 2: k-means targets of one layer of the iteration-1 encoder; training uses `[training]`."""

    encoder: str = "pretrained"  # pretrained (centralised) or federated
    layer: int = 0  # 1-based encoder layer; 0 = the middle one (6 of 12 for base)
    k: int  # clusters per client (shrinks with a warning for small clients)
    max_fit_frames: int  # 50 Hz frames sampled (as whole utterances) for the fit
    seed: int


class FinetuneSettings(WorkerSettings, worker=FinetuneConfig, section="finetune"):
    """CTC fine-tuning (`finetuned_asr`): each encoder, and its architecture from scratch, per budget and seed."""

    labelled_minutes: list[float] = [10.0]  # labelled budgets (minutes of the training speakers' audio)
    seeds: list[int] = [0, 1]  # one subset and one run per model, budget and seed: mean and spread
    encoders: list[str] = ["pretrained"]  # of pretrained, federated, iteration2, distilled (those materialized)
    max_steps: int
    lr: float
    # peak lrs each model chooses from on the dev set (smallest budget, first seed); empty: `lr`
    lr_grid: list[float] = [5e-4, 1.5e-3, 4.5e-3]
    dev_speakers: int = 1  # training-side speakers never labelled: their utterances are the dev set
    max_dev_utterances: int = 100  # dev utterances scored at each evaluation (a seeded subsample); 0 = all
    eval_every: int
    patience: int
    lm_weights: list[float]
    word_scores: list[float]
    stages: list[float]  # tri-stage lr: shares of max_steps warming up, holding, decaying
    init_lr_scale: float
    final_lr_scale: float
    freeze_steps: int  # only the CTC head trains for these first steps
    freeze_frontend: bool  # the convolutional front end never trains
    mask_prob: float  # probability that a 50 Hz frame starts a masked span
    mask_length: int
    channel_mask_prob: float  # the same over the 80 log-mel bands
    channel_mask_length: int
    batch_seconds: float
    max_frames: int  # longer utterances (100 Hz frames) are not labelled
    max_eval_utterances: int = 200  # held-out utterances scored (a seeded subsample); 0 = all
    decoders: list[str]  # beam: lexicon beam search with the n-gram LM (needs flashlight-text)
    lm_order: int
    checkpoint_every: int
    precision: Precision
    nproc: int = 1  # torchrun processes
    threads: int = 0  # intra-op threads per process; 0 = cores / processes
    # with nproc = 1: runs trained at once, one process each; 0 = one per CPU core, 1 on a GPU
    parallel_runs: int = 0


class PipelineSettings(NamedSectionTypes, dg.ConfigurableResource):
    """Every stage's settings, from `pipeline.toml` (or ``$SPEECH_ASSETS_SETTINGS``); missing keys keep
    their defaults. ``source`` says which file was read."""

    source: str = ""
    manifest: ManifestSettings = ManifestSettings()
    features: FeatureSettings = FeatureSettings()
    clients: ClientSettings = ClientSettings()
    kmeans: KMeansSettings = KMeansSettings()
    training: TrainingSettings = TrainingSettings()
    federated: FederatedSettings = FederatedSettings()
    probe: ProbeSettings = ProbeSettings()
    export: ExportSettings = ExportSettings()
    distill: DistillSettings = DistillSettings()
    iteration2: Iteration2Settings = Iteration2Settings()
    finetune: FinetuneSettings = FinetuneSettings()

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None) -> PipelineSettings:
        explicit = path or os.environ.get(SETTINGS_ENV)
        file = locations.resolve(explicit or SETTINGS_FILE)
        if not file.is_file():
            if explicit:
                raise FileNotFoundError(f"settings file {file} (from ${SETTINGS_ENV}) does not exist")
            return cls()
        with open(file, "rb") as handle:
            data = tomllib.load(handle)
        sections = {name for name, field in cls.model_fields.items() if name != "source"}
        if unknown := sorted(set(data) - sections):
            raise ValueError(f"{file}: unknown section(s) {unknown}; known: {sorted(sections)}")
        parsed: dict[str, Any] = {}
        for name, values in data.items():
            section_cls = cls.model_fields[name].annotation
            if extra := sorted(set(values) - set(section_cls.model_fields)):
                raise ValueError(
                    f"{file}: unknown key(s) {extra} in [{name}]; known: {sorted(section_cls.model_fields)}"
                )
            try:
                parsed[name] = section_cls(**values)
            except pydantic.ValidationError as error:
                # titled by the section and the file rather than the section's class
                raise pydantic.ValidationError.from_exception_data(
                    f"[{name}] of {file}", error.errors(include_url=False)
                ) from None
        return cls(source=str(file), **parsed)

    def digest(self) -> str:
        """sha256 of every stage's settings (not of the file they came from): equal settings, equal hash."""
        return sha256_strings([self.model_dump_json(exclude={"source"})])


@functools.cache  # one class per section: assets launched alike share their run-config type
def overrides_of(section: type[dg.Config], **extra: Any) -> type[dg.Config]:
    """A manual run's config: every field of ``section`` optional (unset: the settings') but its
    ``settings_only`` ones, plus ``extra`` (pydantic's ``(type, default)``). Built here: pydantic
    has no partial model and the Launchpad needs a field per knob."""
    excluded = getattr(section, "settings_only", frozenset())
    fields = dict(extra)
    for name, field in section.model_fields.items():
        kind = field.annotation
        if typing.get_origin(kind) is typing.Literal:  # Dagster has no optional enum; effective() checks the value
            kind = type(typing.get_args(kind)[0])
        if name not in excluded:
            # a type built at run time from an annotation object: Optional[] takes any of them
            fields[name] = (Optional[kind], None)  # noqa: UP045
    name = f"{section.__name__.removesuffix('Settings')}Overrides"
    doc = f"Run-config overrides of the {section.__name__} for one manual run."
    return create_model(name, __base__=dg.Config, __doc__=doc, **fields)


def effective(section: dg.Config, overrides: dg.Config) -> Any:
    """``section`` with the fields a manual run set in ``overrides`` replaced, and checked (its
    ``settings_only`` fields are not in ``overrides_of``'s type: no run config reaches them)."""
    changed = {k: v for k, v in overrides.model_dump().items() if v is not None and k in type(section).model_fields}
    return type(section).model_validate({**section.model_dump(), **changed}) if changed else section


def vad_config(features: FeatureSettings) -> VadConfig:
    renamed = {name: getattr(features, f"vad_{name}") for name in ("aggressiveness", "frame_ms", "padding_ms")}
    return from_fields(VadConfig, features, **renamed)
