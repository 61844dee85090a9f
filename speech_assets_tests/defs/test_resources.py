"""Pipeline settings: one TOML file the user sets once, read by every run; run config overrides it."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pydantic
import pytest

from speech_assets.defs.resources import (
    SETTINGS_ENV,
    KMeansSettings,
    PipelineSettings,
    effective,
    overrides_of,
)
from speech_assets_tests.conftest import REPO


def test_the_committed_file_states_every_default() -> None:
    """pipeline.toml names every knob of every section, so users see what they can set, and
    nothing else (a key the settings do not know would be refused at load time anyway)."""
    PipelineSettings.load(REPO / "pipeline.toml")
    written = tomllib.loads((REPO / "pipeline.toml").read_text())
    for section, values in PipelineSettings().model_dump(exclude={"source"}).items():
        assert set(written.get(section, {})) == set(values), f"[{section}] of pipeline.toml differs from its settings"


def test_environment_variable_selects_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from speech_assets.definitions import build_definitions

    file = tmp_path / "mine.toml"
    file.write_text("[kmeans]\nk = 37\n[clients]\nnum_clients = 2\n")
    monkeypatch.setenv(SETTINGS_ENV, str(file))
    settings = build_definitions().resources["settings"]
    assert isinstance(settings, PipelineSettings)
    assert (settings.kmeans.k, settings.clients.num_clients, settings.source) == (37, 2, str(file))
    assert settings.kmeans.refit_growth == KMeansSettings().refit_growth  # unset keys keep defaults


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("[kmean]\nk = 3\n", "unknown section"),
        ("[kmeans]\nkk = 3\n", "unknown key"),
        ("[kmeans]\nk = 'many'\n", "validation error"),
        ("[kmeans\nk = 3\n", "Expected"),
    ],
)
def test_a_bad_file_is_a_clear_error(tmp_path: Path, text: str, error: str) -> None:
    file = tmp_path / "bad.toml"
    file.write_text(text)
    with pytest.raises((ValueError, pydantic.ValidationError), match=error):
        PipelineSettings.load(file)


def test_a_missing_named_file_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SETTINGS_ENV, str(tmp_path / "nope.toml"))
    with pytest.raises(FileNotFoundError, match="nope.toml"):
        PipelineSettings.load()


def test_run_config_overrides_only_what_it_sets() -> None:
    overrides = overrides_of(KMeansSettings)
    base = KMeansSettings(k=50, seed=3)
    assert effective(base, overrides()) == base
    assert effective(base, overrides(k=7)) == KMeansSettings(k=7, seed=3)
