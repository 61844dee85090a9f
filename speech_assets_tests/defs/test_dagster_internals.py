"""The upgrade smoke test: every private name of Dagster and multiprocessing that
``speech_assets.defs.dagster_internals`` uses is still there, with the fields and parameters it uses.

A Dagster (or Python) upgrade that moves or changes one of them fails here, naming it, what is
missing and the installed versions, instead of deep inside a run. The table below is checked
against the module's source, so a private name used there without a row here fails too.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from speech_assets.defs import dagster_internals
from speech_assets_tests.conftest import REPO


@dataclass(frozen=True)
class Private:
    """``module.name``, called with ``parameters`` first (in this order), ``use`` calling it as the
    package does; ``attributes`` are read on it, or on what ``use`` returns."""

    module: str
    name: str
    attributes: tuple[str, ...] = ()
    parameters: tuple[str, ...] = ()
    use: Callable[[Any], Any] | None = None


DATA_VERSION = "dagster._core.definitions.data_version"
EXECUTOR_DEFINITION = "dagster._core.definitions.executor_definition"
LAUNCHER = "dagster._core.launcher.base"
FORKSERVER_CONFIG = {"retries": {"enabled": {}}, "start_method": {"forkserver": {"preload_modules": ["numpy"]}}}
USED = [
    *(
        Private(DATA_VERSION, tag)
        for tag in ("CODE_VERSION_TAG", "DATA_VERSION_TAG", "DATA_VERSION_IS_USER_PROVIDED_TAG")
    ),
    Private(DATA_VERSION, "NULL_EVENT_POINTER"),
    Private(DATA_VERSION, "DEFAULT_DATA_VERSION", ("value",)),
    Private(
        DATA_VERSION, "get_input_data_version_tag", use=lambda tag: tag(dg.AssetKey("upstream")).startswith("dagster/")
    ),
    Private(
        DATA_VERSION, "get_input_event_pointer_tag", use=lambda tag: tag(dg.AssetKey("upstream")).startswith("dagster/")
    ),
    Private("dagster._core.storage.event_log.sqlite.sqlite_event_log", "SqliteEventLogStorage", use=inspect.isclass),
    Private(EXECUTOR_DEFINITION, "MULTI_PROC_CONFIG", use=lambda field: field.config_type.fields["start_method"]),
    Private(EXECUTOR_DEFINITION, "multiple_process_executor_requirements", use=lambda requirements: requirements()),
    Private(
        EXECUTOR_DEFINITION,
        "_core_multiprocess_executor_creation",
        ("_start_method", "retries", "step_dependency_config"),
        ("config",),
        use=lambda create: create(FORKSERVER_CONFIG),
    ),
    Private("dagster._core.executor.multiprocess", "MultiprocessExecutor", ("execute",)),
    Private(
        "dagster._core.executor.in_process", "InProcessExecutor", ("execute",), ("retries", "step_dependency_config")
    ),
    Private(LAUNCHER, "CheckRunHealthResult", ("status", "msg"), ("status", "msg")),
    Private(LAUNCHER, "WorkerStatus", ("RUNNING", "FAILED")),
    Private(
        "dagster", "DefaultRunLauncher", ("_instance", "supports_check_run_worker_health", "check_run_worker_health")
    ),
    Private("multiprocessing.forkserver", "_forkserver", ("_lock", "_forkserver_pid", "_stop_unlocked")),
    Private(
        "dagster._config.field_utils",
        "Shape",
        ("fields", "description", "key", "given_name", "_initialized"),
        ("fields", "description"),
        use=lambda shape: shape({"a": dg.Field(int)}),
    ),
    Private(
        "dagster._core.definitions.definition_config_schema",
        "DefinitionConfigSchema",
        ("as_field", "config_type"),
        ("config_field",),
        use=lambda schema: schema(dg.Field(dg.Shape({"a": dg.Field(int)}))),
    ),
    Private("dagster", "ConfigurableResource", ("_config_schema",)),
]


def problems(item: Private) -> list[str]:
    """What no longer holds of ``item`` (empty when all does)."""
    try:
        owner = importlib.import_module(item.module)
    except ImportError as error:
        return [f"cannot import {item.module}: {error}"]
    if not hasattr(owner, item.name):
        return [f"{item.module} has no {item.name}"]
    found = getattr(owner, item.name)
    wrong = []
    if item.parameters:
        try:
            names = list(inspect.signature(found).parameters)
        except (TypeError, ValueError) as error:
            names = [f"no signature: {error}"]
        if names[: len(item.parameters)] != list(item.parameters):
            wrong.append(f"it takes {names}, no longer {list(item.parameters)} first")
    if item.use is not None:
        try:
            found = item.use(found)
        except Exception as error:  # noqa: BLE001 - reported, by name
            return [*wrong, f"using it as the package does failed: {error!r}"]
        if found is False:
            return [*wrong, "it no longer gives what the package expects"]
    return wrong + [f"it has no attribute {name}" for name in item.attributes if not hasattr(found, name)]


def said(item: Private) -> str:
    return (
        f"{item.module}.{item.name} moved or changed (dagster {version('dagster')}, Python {sys.version.split()[0]}): "
        f"{'; '.join(problems(item))}. speech_assets/defs/dagster_internals.py relies on it; its docstring says why."
    )


@pytest.mark.parametrize("item", USED, ids=[f"{item.module}.{item.name}" for item in USED])
def test_each_private_name_is_still_there_as_used(item: Private) -> None:
    assert not problems(item), said(item)


MOVED = {
    "a module": (Private("dagster._core.no_such_module", "X"), "cannot import dagster._core.no_such_module"),
    "a name": (Private(LAUNCHER, "NoSuchHealth"), "dagster._core.launcher.base has no NoSuchHealth"),
    "a field": (Private("multiprocessing.forkserver", "_forkserver", ("_gone",)), "it has no attribute _gone"),
    "a parameter": (
        Private("dagster._core.executor.in_process", "InProcessExecutor", parameters=("retry_mode",)),
        "no longer ['retry_mode'] first",
    ),
    "a call": (
        Private(DATA_VERSION, "get_input_data_version_tag", use=lambda tag: tag()),
        "using it as the package does failed",
    ),
    "a value": (
        Private(DATA_VERSION, "get_input_data_version_tag", use=lambda tag: tag(dg.AssetKey("a")) == "x"),
        "no longer gives what the package expects",
    ),
}


@pytest.mark.parametrize(("item", "message"), MOVED.values(), ids=list(MOVED))
def test_a_moved_private_name_fails_saying_what_and_where(item: Private, message: str) -> None:
    assert (
        message in said(item) and "dagster_internals.py relies on it" in said(item) and version("dagster") in said(item)
    )


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_every_private_name_the_module_uses_is_checked_here() -> None:
    tree = ast.parse(Path(dagster_internals.__file__).read_text())
    checked = {(item.module, item.name) for item in USED}
    attributes = {name for item in USED for name in (item.name, *item.attributes)}
    imported = {
        (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
        if any(map(private, node.module.split("."))) or private(alias.name)
    }
    read = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and private(node.attr)}
    assert imported <= checked and read <= attributes, (
        f"private names used in dagster_internals.py with no row in USED: {sorted(imported - checked)} "
        f"{sorted(read - attributes)}"
    )
    named = {name for pair in imported for name in pair} | read
    missing_from_docstring = [name for name in sorted(named) if name not in (dagster_internals.__doc__ or "")]
    assert not missing_from_docstring, f"dagster_internals.py's docstring does not name {missing_from_docstring}"


def test_the_readme_names_the_supported_dagster_release() -> None:
    pinned = re.search(r'"dagster==([\d.]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    assert f"Dagster {pinned}" in (REPO / "README.md").read_text()
