"""Pipeline settings: one TOML file the user sets once, read by every run; run config overrides it."""

from __future__ import annotations

import re
import tomllib
from dataclasses import field
from pathlib import Path

import pydantic
import pydantic.dataclasses
import pytest

from speech_assets.defs.resources import (
    SETTINGS_ENV,
    KMeansSettings,
    PipelineSettings,
    WorkerSettings,
    effective,
    overrides_of,
)
from speech_assets_tests.conftest import REPO


def test_the_committed_file_states_every_default() -> None:
    """pipeline.toml names every knob of every section, so users see what they can set, and
    nothing else (a key the settings do not know would be refused at load time anyway), each with
    its default: the value and its TOML type (``1`` is not ``1.0``) that the definitions hold."""
    PipelineSettings.load(REPO / "pipeline.toml")
    assert default_drift(REPO / "pipeline.toml") == []


def default_drift(file: Path) -> list[str]:
    """Where ``file`` differs from the defaults of :class:`PipelineSettings`, a line each."""
    written = tomllib.loads(file.read_text())
    drift = []
    for section, values in PipelineSettings().model_dump(exclude={"source"}).items():
        keys = written.get(section, {})
        drift += [f"[{section}] lacks {key}" for key in values if key not in keys]
        drift += [f"[{section}] {key} is no setting" for key in keys if key not in values]
        drift += [
            f"[{section}] {key} = {keys[key]!r}; the default is {value!r}"
            for key, value in values.items()
            if key in keys and not _same(keys[key], value)
        ]
    return drift


def _same(written: object, default: object) -> bool:
    """Equal values of one type, element by element in lists (pydantic would turn 3 into 3.0)."""
    if isinstance(default, list):
        return isinstance(written, list) and len(written) == len(default) and all(map(_same, written, default))
    return type(written) is type(default) and written == default


@pytest.mark.parametrize(
    ("default", "written", "drift"),
    [
        ("k = 100", "k = 101", "[kmeans] k = 101; the default is 100"),
        ("refit_growth = 0.2", "refit_growth = 0.25", "[kmeans] refit_growth = 0.25; the default is 0.2"),
        ("seed = 0\nrefit", "seed = 0.0\nrefit", "[kmeans] seed = 0.0; the default is 0"),
        ("node_hosts = []", 'node_hosts = ["a"]', "[training] node_hosts = ['a']; the default is []"),
        (
            "noise_snr_db = [5.0, 20.0]",
            "noise_snr_db = [5.0, 20]",
            "[training] noise_snr_db = [5.0, 20]; the default is [5.0, 20.0]",
        ),
        ("specaugment = false", "specaugment = true", "[training] specaugment = True; the default is False"),
        ('strategy = "fedadam"', 'strategy = "fedavg"', "[federated] strategy = 'fedavg'; the default is 'fedadam'"),
        ("dp_delta = 1e-5", "dp_delta = 1e-6", "[federated] dp_delta = 1e-06; the default is 1e-05"),
        ("max_steps = 200\n", "", "[distill] lacks max_steps"),
        ("k = 500 ", "k = 100 ", "[iteration2] k = 100; the default is 500"),
        (
            "stages = [0.1, 0.4, 0.5]",
            "stages = [0.2, 0.3, 0.5]",
            "[finetune] stages = [0.2, 0.3, 0.5]; the default is [0.1, 0.4, 0.5]",
        ),
    ],
)
def test_a_committed_default_that_drifts_is_found(default: str, written: str, drift: str, tmp_path: Path) -> None:
    """One value written differently in the file (or with another type), as a default that moved
    in the code but not in the file would be, is named."""
    text = (REPO / "pipeline.toml").read_text()
    assert text.count(default) == 1
    (tmp_path / "pipeline.toml").write_text(text.replace(default, written))
    assert default_drift(tmp_path / "pipeline.toml") == [drift]


@pydantic.dataclasses.dataclass
class _Worker:
    """A worker's config (a pydantic dataclass): the one place its defaults are written."""

    inputs: str
    steps: int = 300
    lr: float = 2e-3
    bands: list[float] = field(default_factory=lambda: [5.0, 20.0])
    threads: int | None = None


def test_a_section_takes_its_workers_defaults_where_it_names_them() -> None:
    """``name: type`` in a section is the worker's default in the settings, in run config's
    overrides and in the config schema Dagster shows in the Launchpad."""

    class Section(WorkerSettings, worker=_Worker):
        steps: int
        bands: list[float]
        threads: int = 0  # its own meaning: 0 = automatic, where the worker says None
        nodes: int = 1  # the section's own

    assert Section().model_dump() == {"steps": 300, "bands": [5.0, 20.0], "threads": 0, "nodes": 1}
    assert Section().bands is not Section().bands  # each its own list
    assert effective(Section(), overrides_of(Section)(steps=7)).steps == 7
    schema = Section.to_config_schema().config_type.fields
    assert {name: schema[name].default_value for name in ("steps", "bands")} == {"steps": 300, "bands": [5.0, 20.0]}


def test_a_named_worker_config_gives_its_values_as_the_defaults() -> None:
    """``worker=`` a config instance (``ITERATION2_KMEANS``): its values are the section's
    defaults, written once there, and restating one is refused as a class default would be."""
    named = _Worker(inputs="x", steps=7, bands=[1.0])

    class Section(WorkerSettings, worker=named):
        steps: int
        bands: list[float]
        lr: float

    assert Section().model_dump() == {"steps": 7, "bands": [1.0], "lr": 2e-3}
    with pytest.raises(TypeError, match=re.escape("steps restates _Worker's default; write `steps: int`")):
        namespace = {"__annotations__": {"steps": "int"}, "steps": 7, "__module__": __name__}
        type("Section", (WorkerSettings,), namespace, worker=named)


@pytest.mark.parametrize(
    ("declare", "error"),
    [
        ({"steps": ("int", 300)}, "steps restates _Worker's default; write `steps: int`"),
        ({"bands": ("list[float]", [5.0, 20.0])}, "bands restates _Worker's default"),
        ({"steps": ("float", None)}, "steps is <class 'int'> in _Worker, not float"),
        ({"threads": ("int", None)}, "threads is int | None in _Worker, not int"),
        ({"stesp": ("int", None)}, "stesp has no default here nor in _Worker"),
        ({"inputs": ("str", None)}, "inputs has no default here nor in _Worker"),
    ],
)
def test_a_section_that_restates_or_contradicts_its_worker_is_refused(declare: dict, error: str) -> None:
    """A default written twice, a type that differs from the worker's, or a name the worker does
    not have (a typo) stops the section's definition, so the code location does not load."""
    namespace = {"__annotations__": {name: kind for name, (kind, _) in declare.items()}, "__module__": __name__}
    namespace.update({name: value for name, (_, value) in declare.items() if value is not None})
    with pytest.raises(TypeError, match=re.escape(error)):
        type("Section", (WorkerSettings,), namespace, worker=_Worker)


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


RESOURCE_PAGE = """
query Resource($selector: ResourceSelector!) {
  topLevelResourceDetailsOrError(resourceSelector: $selector) {
    __typename
    ... on ResourceDetails { configFields { name configTypeKey description } configuredValues { key value } }
  }
}
"""


def test_the_ui_shows_each_settings_section_by_name(tmp_path: Path) -> None:
    """What the UI's resource page reads (GraphQL against the code location in its own server
    process): each settings section's type is its class name, never ``Shape.<hash>``, with its
    description and the values in effect."""
    import dagster as dg
    from dagster_graphql.test.utils import (
        define_out_of_process_context,
        execute_dagster_graphql,
        infer_resource_selector,
    )

    with (
        dg.instance_for_test(temp_dir=str(tmp_path)) as instance,
        define_out_of_process_context(str(REPO / "speech_assets" / "definitions.py"), "defs", instance) as context,
    ):
        page = execute_dagster_graphql(
            context, RESOURCE_PAGE, {"selector": infer_resource_selector(context, "settings")}
        ).data["topLevelResourceDetailsOrError"]
    assert page["__typename"] == "ResourceDetails", page
    types = {f["name"]: f["configTypeKey"] for f in page["configFields"]}
    sections = {name for name in PipelineSettings.model_fields if name != "source"}
    assert {name: types[name] for name in sections} == {
        name: PipelineSettings.model_fields[name].annotation.__name__ for name in sections
    }
    assert not [t for t in types.values() if "Shape." in t], types
    assert all(f["description"] for f in page["configFields"] if f["name"] in sections), page["configFields"]
    values = {v["key"]: v["value"] for v in page["configuredValues"]}
    assert '"max_steps": 300' in values["training"].replace(" ", " "), values["training"]


def test_named_section_types_check_config_as_dagster_does() -> None:
    """The named types accept and refuse what Dagster's own shapes do."""
    from dagster._config import validate_config

    schema = PipelineSettings.load(REPO / "pipeline.toml").get_resource_definition().config_schema.config_type
    assert validate_config(schema, {"training": {"max_steps": 5}}).success
    assert not validate_config(schema, {"training": {"max_stepz": 5}}).success
    assert not validate_config(schema, {"training": {"max_steps": "many"}}).success
