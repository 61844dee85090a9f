"""One rule, one place: a worker config's checks (pydantic field constraints and model
validators) are what its settings section checks too, so a bad value in
``pipeline.toml`` is refused when the settings load, with the message the worker gives, instead
of when a run reaches the worker; and each default a section shares with its worker is the worker's."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import pydantic
import pytest
from pydantic import Field

from speech_assets.corpus.manifest import ValidationConfig
from speech_assets.defs.resources import (
    ClientSettings,
    DistillSettings,
    FeatureSettings,
    FederatedSettings,
    FinetuneSettings,
    Iteration2Settings,
    KMeansSettings,
    ManifestSettings,
    PipelineSettings,
    ProbeSettings,
    TrainingSettings,
    WorkerSettings,
)
from speech_assets.evaluation.probe_options import ProbeOptions
from speech_assets.features.vad import VadConfig
from speech_assets.federated.config import FederatedConfig
from speech_assets.targets.kmeans import KMeansConfig
from speech_assets.train.config import DistillConfig, FinetuneConfig, TrainConfig

RUN = {"run_dir": "/tmp/run", "shards": ["a.parquet"], "cmvn": "cmvn.npz"}


def train_config(**values: Any) -> TrainConfig:
    return TrainConfig(**RUN, clients={"c": {"labels": "l.parquet", "k": 4}}, **values)


def federated_config(**values: Any) -> FederatedConfig:
    return FederatedConfig(run_dir="/tmp/run", run_name="run", clients=["c0", "c1", "c2"], **values)


def distill_config(**values: Any) -> DistillConfig:
    return DistillConfig(**RUN, clients={}, teacher="final.pt", **values)


def finetune_config(**values: Any) -> FinetuneConfig:
    return FinetuneConfig(**RUN, clients={}, encoder="final.pt", labelled="labelled.json", **values)


WORKERS = {
    "training": train_config,
    "clients": train_config,
    "federated": federated_config,
    "distill": distill_config,
    "finetune": finetune_config,
    "kmeans": KMeansConfig,
    "iteration2": KMeansConfig,
    "manifest": ValidationConfig,
    "probe": ProbeOptions,
}
SECTIONS = {
    "training": TrainingSettings,
    "clients": ClientSettings,
    "federated": FederatedSettings,
    "distill": DistillSettings,
    "finetune": FinetuneSettings,
    "kmeans": KMeansSettings,
    "iteration2": Iteration2Settings,
    "manifest": ManifestSettings,
    "probe": ProbeSettings,
}

GE0, GE1, GT0 = (f"Input should be greater {than}" for than in ("than or equal to 0", "than or equal to 1", "than 0"))
BAD = [
    ("training", "max_steps", 0, GE1),
    ("training", "precision", "fp8", "Input should be 'auto', 'fp32', 'bf16' or 'fp16'"),
    ("training", "preset", "huge", "preset must be one of"),
    ("training", "lr", 0.0, GT0),
    ("training", "mask_prob", 1.5, "Input should be less than or equal to 1"),
    ("training", "normalisation", "speaker", "Input should be 'utterance' or 'global'"),
    ("clients", "heldout_fraction", 1.0, "Input should be less than 1"),
    ("federated", "fraction_train", 1.5, "Input should be less than or equal to 1"),
    ("federated", "client_lr_schedule", "cosine", "Input should be 'linear' or 'constant'"),
    ("federated", "beta_2", 1.0, "Input should be less than 1"),
    ("federated", "secagg_num_shares", 4, "secagg_num_shares must be 0 (every sampled client) or an odd number >= 3"),
    ("federated", "round_timeout_s", float("inf"), "Input should be a finite number"),
    ("distill", "cosine_weight", -1.0, GE0),
    ("distill", "max_steps", 0, GE1),
    ("distill", "lr", -1e-3, GT0),
    ("finetune", "max_steps", 0, GE1),
    ("finetune", "stages", [0.5, 0.5], "stages must be three shares >= 0 adding up to 1"),
    ("finetune", "precision", "fp8", "Input should be 'auto', 'fp32', 'bf16' or 'fp16'"),
    ("finetune", "mask_prob", 1.5, "Input should be less than or equal to 1"),
    ("finetune", "batch_seconds", 0.0, GT0),
    ("finetune", "freeze_steps", -1, GE0),
    ("finetune", "lm_weights", [], "List should have at least 1 item"),
    ("kmeans", "k", 0, "Input should be greater than or equal to 1"),
    ("kmeans", "k", 40_000, "Input should be less than or equal to 32768"),  # labels are int16
    ("kmeans", "max_fit_frames", 0, "Input should be greater than or equal to 1"),
    ("iteration2", "k", 0, "Input should be greater than or equal to 1"),
    ("iteration2", "max_fit_frames", -5, "Input should be greater than or equal to 1"),
    ("manifest", "min_duration_s", 40.0, "need 0 <= min_duration_s < max_duration_s"),
    ("manifest", "max_duration_s", 0.1, "need 0 <= min_duration_s < max_duration_s"),
    ("manifest", "max_transcript_chars", 0, "Input should be greater than or equal to 1"),
    ("probe", "probe", "transformer", "Input should be 'linear' or 'bilstm'"),
    ("probe", "steps", 0, "Input should be greater than or equal to 1"),
    ("probe", "lr", 0.0, "Input should be greater than 0"),
    ("probe", "seeds", [1, 1], "seeds must be distinct and at least one"),
    ("probe", "seeds", [], "seeds must be distinct and at least one"),
]
GOOD = [
    ("training", "max_steps", 1),
    ("training", "precision", "bf16"),
    ("training", "preset", "base"),
    ("training", "mask_prob", 0.0),
    ("clients", "heldout_fraction", 0.0),
    ("federated", "fraction_train", 0.5),
    ("federated", "secagg_num_shares", 3),
    ("federated", "beta_2", 0.0),
    ("distill", "cosine_weight", 0.0),
    ("finetune", "stages", [0.0, 0.5, 0.5]),
    ("finetune", "freeze_steps", 0),
    ("kmeans", "k", 32_768),
    ("kmeans", "max_fit_frames", 1),
    ("iteration2", "k", 1),
    ("manifest", "min_duration_s", 0.0),
    ("probe", "probe", "bilstm"),
    ("probe", "seeds", [3]),
    ("probe", "lrs", []),
]


@pytest.mark.parametrize(("section", "name", "value", "message"), BAD, ids=[f"{s}.{n}={v}" for s, n, v, _ in BAD])
def test_a_bad_value_is_refused_with_one_message_by_the_section_and_the_worker(
    section: str, name: str, value: object, message: str
) -> None:
    with pytest.raises(ValueError) as from_worker:
        WORKERS[section](**{name: value})
    with pytest.raises(pydantic.ValidationError) as from_settings:
        SECTIONS[section](**{name: value})
    assert message in str(from_worker.value)
    # a rule's message names the section; a pydantic constraint's error, the section's class and the field
    said = str(from_settings.value)
    assert f"[{section}] {message}" in said or f"for {SECTIONS[section].__name__}\n{name}\n" in said
    assert message in said


@pytest.mark.parametrize(("section", "name", "value"), GOOD, ids=[f"{s}.{n}={v}" for s, n, v in GOOD])
def test_a_good_value_passes_both(section: str, name: str, value: object) -> None:
    WORKERS[section](**{name: value})
    assert getattr(SECTIONS[section](**{name: value}), name) == value


def test_a_bad_value_in_the_settings_file_is_refused_when_it_loads(tmp_path: Path) -> None:
    file = tmp_path / "pipeline.toml"
    file.write_text("[training]\nmax_steps = 0\n\n[federated]\nfraction_train = 0.5\n")
    with pytest.raises(pydantic.ValidationError, match=rf"for \[training\] of {file}\nmax_steps\n  {GE1}"):
        PipelineSettings.load(file)


def test_a_worker_rule_across_fields_checks_the_section() -> None:
    """FederatedConfig's model validator (clipping needs a norm under DP) refuses the section's
    values too, and one reading a field the section lacks (TrainConfig's inputs) is not applied."""
    with pytest.raises(ValueError, match="dp_clipping_norm must be > 0"):
        federated_config(dp_noise_multiplier=1.0, dp_clipping_norm=0.0)
    with pytest.raises(pydantic.ValidationError, match=r"\[federated\] dp_clipping_norm must be > 0"):
        FederatedSettings(dp_noise_multiplier=1.0, dp_clipping_norm=0.0)
    assert FederatedSettings(dp_noise_multiplier=1.0).dp_clipping_norm == 1.0
    assert TrainingSettings().max_steps == TrainConfig.max_steps


def test_a_field_the_section_gives_its_own_meaning_is_left_to_the_run() -> None:
    """``batch_seconds = 0`` means automatic in `[training]` (the worker's ``None``), so the
    worker's ``> 0`` rule is not applied to it there."""
    assert TrainingSettings(batch_seconds=0.0).batch_seconds == 0.0
    with pytest.raises(ValueError, match="batch_seconds\n  Input should be greater than 0"):
        train_config(batch_seconds=0.0)


def iteration2_kmeans() -> KMeansConfig:
    from speech_assets.targets.config import ITERATION2_KMEANS

    return ITERATION2_KMEANS


# every settings section filled into a worker's config, that config (an instance whose values are
# the defaults), and the prefix the section puts before the worker's names
PAIRS: list[tuple[type[pydantic.BaseModel], Callable[[], object], str]] = [
    (ManifestSettings, ValidationConfig, ""),
    (FeatureSettings, VadConfig, "vad_"),
    (ClientSettings, train_config, ""),
    (KMeansSettings, KMeansConfig, ""),
    (TrainingSettings, train_config, ""),
    (FederatedSettings, federated_config, ""),
    (ProbeSettings, ProbeOptions, ""),
    (DistillSettings, distill_config, ""),
    (Iteration2Settings, iteration2_kmeans, ""),
    (FinetuneSettings, finetune_config, ""),
]

# The one list of fields whose section default deliberately differs from the worker's: in the
# settings 0 means "automatic" (resolved by the run, from the hardware or the teacher), where the
# worker holds the resolved value or None/"auto".
# a section whose worker is no pydantic dataclass (VadConfig checks its values in __post_init__):
# defaults compared only
PLAIN: set[type] = set()  # sections whose worker is a plain dataclass (none since VadConfig is pydantic)
AUTOMATIC = {
    TrainingSettings: {"batch_seconds", "nproc", "threads"},
    DistillSettings: {"dim", "layers", "heads", "ffn_dim", "threads"},
    FinetuneSettings: {"threads"},
}


def as_settings(value: object) -> object:
    """A worker's tuple as a settings file spells it (TOML has no tuples)."""
    return list(value) if isinstance(value, tuple) else value


def bounds(field: object) -> list[object]:
    """A pydantic field's constraints (``Ge``, ``Interval``, an ``AfterValidator``...), or [] for a plain field."""
    return list(getattr(field, "metadata", []))


def kind(field: object) -> object:
    """A pydantic field's type as a settings file gives it (a ``Literal`` stays one; a tuple is a list)."""
    annotation = getattr(field, "annotation", None)
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return list[args[0]]
    return annotation


def section_worker_drift(section: type[pydantic.BaseModel], worker: object, prefix: str) -> list[str]:
    """Where ``section``'s fields differ from the same-named fields of ``worker`` (an instance), a
    line each: a default, a type or a constraint (bounds, choices, validators) written twice."""
    theirs = {item.name: item for item in dataclasses.fields(worker)}
    their_fields = getattr(type(worker), "__pydantic_fields__", {})
    drift = [] if their_fields or section in PLAIN else [f"{type(worker).__name__} has no pydantic fields"]
    automatic = set().union(*(names for cls, names in AUTOMATIC.items() if issubclass(section, cls)))
    for name, field in section.model_fields.items():
        worker_name = name.removeprefix(prefix) if prefix and name.startswith(prefix) else name
        if worker_name not in theirs or name in automatic:
            continue
        default = as_settings(getattr(worker, worker_name))
        if field.get_default(call_default_factory=True) != default:
            drift.append(f"{section.__name__}.{name} = {field.default!r}; the worker's is {default!r}")
        if not their_fields:
            continue
        ours, others = bounds(field), bounds(their_fields.get(worker_name))
        if ours != others:
            drift.append(f"{section.__name__}.{name} bounds {ours}; the worker's {others}")
        if kind(field) != kind(their_fields.get(worker_name)):
            drift.append(
                f"{section.__name__}.{name} is {kind(field)}; the worker's {kind(their_fields.get(worker_name))}"
            )
    return drift


@pytest.mark.parametrize(("section", "worker", "prefix"), PAIRS, ids=[s.__name__ for s, *_ in PAIRS])
def test_each_section_matches_worker(
    section: type[pydantic.BaseModel], worker: Callable[[], object], prefix: str
) -> None:
    """Every field a section shares with its worker's config has the worker's default, type and
    constraints (bounds, choices, validators): written once, so the settings and a run built
    without them agree; every worker is a pydantic dataclass. The
    exceptions are the fields where 0 means automatic (:data:`AUTOMATIC`); each one still differs,
    so the list holds no stale entry. pipeline.toml states exactly the section defaults
    (``test_resources.test_the_committed_file_states_every_default``). Mutation seen
    failing: the old ``[probe] lrs = [0.002, 0.01]`` beside ``ProbeOptions.lrs = ()``, and
    ``[finetune] max_frames = 3000`` / ``decoders = ["greedy", "beam"]`` beside FinetuneConfig's
    1500 / ``["greedy"]``; and a section taking ProbeOptions' defaults without its constraints
    (``setattr(cls, name, default)`` in ``WorkerSettings``, again with every worker pydantic:
    ``ManifestSettings.max_transcript_chars bounds []; the worker's [Ge(ge=1)]``); and the
    run configs of before (stdlib dataclasses whose ``RULES`` the sections restated:
    ``TrainConfig has no pydantic fields``)."""
    config = worker()
    assert section_worker_drift(section, config, prefix) == []
    for name in AUTOMATIC.get(section, ()):
        assert getattr(section(), name) == 0 != getattr(config, name)


def test_a_section_that_drifts_from_its_worker_is_named() -> None:
    """The comparison itself finds a default written twice with two values, a field declared
    again without the worker's constraints, with other ones or with them twice, and another type."""

    class Drifted(ProbeSettings):
        steps: int = 401

    assert section_worker_drift(Drifted, ProbeOptions(), "") == [
        "Drifted.steps = 401; the worker's is 400",
        "Drifted.steps bounds []; the worker's [Ge(ge=1)]",
    ]

    class Loosened(TrainingSettings):  # a bound written again, and differently
        max_steps: Annotated[int, Field(ge=0)] = 300
        precision: str = "auto"

    assert section_worker_drift(Loosened, train_config(), "") == [
        "Loosened.max_steps bounds [Ge(ge=0)]; the worker's [Ge(ge=1)]",
        "Loosened.precision is <class 'str'>; the worker's typing.Literal['auto', 'fp32', 'bf16', 'fp16']",
    ]

    class Twice(WorkerSettings, worker=TrainConfig, section="training"):  # the worker's bound stated again
        max_steps: Annotated[int, Field(ge=1)]

    assert section_worker_drift(Twice, train_config(), "") == [
        "Twice.max_steps bounds [Ge(ge=1), Ge(ge=1)]; the worker's [Ge(ge=1)]"
    ]


def test_a_bad_k_means_value_in_the_settings_file_is_refused_when_it_loads(tmp_path: Path) -> None:
    """The error names the section and the file, and the field with pydantic's message (mutation
    seen failing: ``PipelineSettings.load`` letting the section's own error through, titled
    ``KMeansSettings``)."""
    file = tmp_path / "pipeline.toml"
    file.write_text("[kmeans]\nk = 0\n\n[finetune]\nstages = [0.5, 0.5]\n")
    with pytest.raises(pydantic.ValidationError) as refused:
        PipelineSettings.load(file)
    assert f"1 validation error for [kmeans] of {file}\nk\n  Input should be greater than or equal to 1" in str(
        refused.value
    )
