"""One rule, one place: a worker config's rules (``RULES`` beside its fields) are what its
settings section checks too, so a bad value in ``pipeline.toml`` is refused when the settings
load, with the message the worker gives, instead of when a run reaches the worker."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pydantic
import pytest

from speech_assets.corpus.manifest import ValidationConfig
from speech_assets.defs.resources import (
    ClientSettings,
    DistillSettings,
    FederatedSettings,
    FinetuneSettings,
    Iteration2Settings,
    KMeansSettings,
    ManifestSettings,
    PipelineSettings,
    ProbeSettings,
    TrainingSettings,
)
from speech_assets.evaluation.probe_options import ProbeOptions
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

BAD = [
    ("training", "max_steps", 0, "max_steps must be >= 1"),
    ("training", "precision", "fp8", "precision must be one of"),
    ("training", "preset", "huge", "preset must be one of"),
    ("training", "lr", 0.0, "lr must be > 0"),
    ("training", "mask_prob", 1.5, "mask_prob must be in [0, 1]"),
    ("training", "normalisation", "speaker", "normalisation must be 'utterance' or 'global'"),
    ("clients", "heldout_fraction", 1.0, "heldout_fraction must be in [0, 1)"),
    ("federated", "fraction_train", 1.5, "fraction_train must be in (0, 1]"),
    ("federated", "client_lr_schedule", "cosine", "client_lr_schedule must be one of"),
    ("federated", "beta_2", 1.0, "beta_2 must be in [0, 1)"),
    ("federated", "secagg_num_shares", 4, "secagg_num_shares must be 0 (every sampled client) or an odd number >= 3"),
    ("federated", "round_timeout_s", float("inf"), "round_timeout_s must be > 0"),
    ("distill", "cosine_weight", -1.0, "cosine_weight must be >= 0"),
    ("distill", "max_steps", 0, "max_steps must be >= 1"),
    ("distill", "lr", -1e-3, "lr must be > 0"),
    ("finetune", "max_steps", 0, "max_steps must be >= 1"),
    ("finetune", "stages", [0.5, 0.5], "stages must be three shares >= 0 adding up to 1"),
    ("finetune", "precision", "fp8", "precision must be one of"),
    ("finetune", "mask_prob", 1.5, "mask_prob must be in [0, 1]"),
    ("finetune", "batch_seconds", 0.0, "batch_seconds must be > 0"),
    ("finetune", "freeze_steps", -1, "freeze_steps must be >= 0"),
    ("kmeans", "k", 0, "k must be in [1, 32768]"),
    ("kmeans", "k", 40_000, "k must be in [1, 32768]"),  # labels are int16
    ("kmeans", "max_fit_frames", 0, "max_fit_frames must be >= 1"),
    ("iteration2", "k", 0, "k must be in [1, 32768]"),
    ("iteration2", "max_fit_frames", -5, "max_fit_frames must be >= 1"),
    ("manifest", "min_duration_s", 40.0, "need 0 <= min_duration_s < max_duration_s"),
    ("manifest", "max_duration_s", 0.1, "need 0 <= min_duration_s < max_duration_s"),
    ("manifest", "max_transcript_chars", 0, "max_transcript_chars must be >= 1"),
    ("probe", "probe", "transformer", "probe must be one of"),
    ("probe", "steps", 0, "steps must be >= 1"),
    ("probe", "lr", 0.0, "lr must be > 0"),
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
    assert f"[{section}] {message}" in str(from_settings.value)


@pytest.mark.parametrize(("section", "name", "value"), GOOD, ids=[f"{s}.{n}={v}" for s, n, v in GOOD])
def test_a_good_value_passes_both(section: str, name: str, value: object) -> None:
    WORKERS[section](**{name: value})
    assert getattr(SECTIONS[section](**{name: value}), name) == value


def test_a_bad_value_in_the_settings_file_is_refused_when_it_loads(tmp_path: Path) -> None:
    file = tmp_path / "pipeline.toml"
    file.write_text("[training]\nmax_steps = 0\n\n[federated]\nfraction_train = 0.5\n")
    with pytest.raises(pydantic.ValidationError, match=r"\[training\] max_steps must be >= 1"):
        PipelineSettings.load(file)


def test_a_field_the_section_gives_its_own_meaning_is_left_to_the_run() -> None:
    """``batch_seconds = 0`` means automatic in `[training]` (the worker's ``None``), so the
    worker's ``> 0`` rule is not applied to it there."""
    assert TrainingSettings(batch_seconds=0.0).batch_seconds == 0.0
    with pytest.raises(ValueError, match="batch_seconds must be > 0"):
        train_config(batch_seconds=0.0)


def iteration2_kmeans() -> KMeansConfig:
    from speech_assets.targets.config import ITERATION2_KMEANS

    return ITERATION2_KMEANS


# each section, the worker config holding its defaults, and the fields the section gives a meaning
# or default of its own
DEFAULTS: list[tuple[str, Callable[[], object], set[str]]] = [
    ("finetune", finetune_config, {"max_frames", "decoders", "threads"}),
    ("kmeans", KMeansConfig, set()),
    ("iteration2", iteration2_kmeans, set()),
    ("manifest", ValidationConfig, set()),
    ("probe", ProbeOptions, {"lrs"}),
]


def as_settings(value: object) -> object:
    """A worker's tuple as a settings file spells it (TOML has no tuples)."""
    return list(value) if isinstance(value, tuple) else value


@pytest.mark.parametrize(("section", "worker", "own"), DEFAULTS, ids=[s for s, *_ in DEFAULTS])
def test_a_section_takes_every_default_it_shares_from_its_worker(
    section: str, worker: Callable[[], object], own: set[str]
) -> None:
    """Each default the section and the worker share is the worker's value, taken from it (so it
    is written once, and checked by the worker's rules), except where the section says otherwise."""
    config = worker()
    shared = {item.name for item in dataclasses.fields(config)} & set(SECTIONS[section].model_fields)
    settings = SECTIONS[section]()
    assert shared > own
    assert {name: getattr(settings, name) for name in shared - own} == {
        name: as_settings(getattr(config, name)) for name in shared - own
    }
    assert set(getattr(SECTIONS[section], "worker_fields", ())) == shared - own


def test_a_bad_k_means_value_in_the_settings_file_is_refused_when_it_loads(tmp_path: Path) -> None:
    file = tmp_path / "pipeline.toml"
    file.write_text("[kmeans]\nk = 0\n\n[finetune]\nstages = [0.5, 0.5]\n")
    with pytest.raises(pydantic.ValidationError, match=r"\[kmeans\] k must be in \[1, 32768\]"):
        PipelineSettings.load(file)
