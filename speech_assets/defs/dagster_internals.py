"""Every private name of Dagster (and of multiprocessing) that the package uses, and why: the
public API has no way to do these. The package pins one Dagster release and
``speech_assets_tests/defs/test_dagster_internals.py`` checks each name and field used here, so an
upgrade that breaks one fails there, by name. No other module may use a private Dagster name.

- ``dagster._core.definitions.data_version``: ``DATA_VERSION_TAG``, ``CODE_VERSION_TAG``,
  ``DATA_VERSION_IS_USER_PROVIDED_TAG``, ``DEFAULT_DATA_VERSION``, ``NULL_EVENT_POINTER``,
  ``get_input_data_version_tag``, ``get_input_event_pointer_tag``: per-partition events tagged
  exactly as Dagster tags its own (a public ``DataVersion`` is one per run).
- ``dagster._core.storage.event_log.sqlite.sqlite_event_log.SqliteEventLogStorage``
  (:func:`is_local_storage`): a run is judged dead by its events' pids only on local storage.
- ``dagster._core.definitions.executor_definition``: ``_core_multiprocess_executor_creation``,
  ``MULTI_PROC_CONFIG``, ``multiple_process_executor_requirements``;
  ``dagster._core.executor.multiprocess.MultiprocessExecutor`` (``_start_method``);
  ``dagster._core.executor.in_process.InProcessExecutor`` (:func:`multiprocess_executor`): work in
  the run worker before any step (Dagster has no hook there), and steps run in that worker.
- ``dagster._core.launcher.base``: ``CheckRunHealthResult``, ``WorkerStatus``, a launcher's
  ``_instance`` (:func:`local_run_launcher`): the run-worker health check run monitoring calls.
- ``multiprocessing.forkserver._forkserver`` (``_lock``, ``_forkserver_pid``, ``_stop_unlocked``;
  :func:`stop_forkserver`): multiprocessing stops its forkserver only at exit.
- ``dagster._config.field_utils.Shape`` (``_initialized``), ``ConfigType``'s ``key`` and
  ``given_name``, ``dagster._core.definitions.definition_config_schema``'s ``DefinitionConfigSchema``,
  ``_config_schema`` (:class:`NamedSectionTypes`): the UI shows a nested ``Config`` field's type as
  ``Shape.<sha1 of its fields>``, and Dagster has no public way to name it (measured on 1.13.27).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import dagster as dg
from dagster._core.definitions.data_version import (  # noqa: F401 - for defs/per_partition.py, defs/lineage.py
    CODE_VERSION_TAG,
    DATA_VERSION_IS_USER_PROVIDED_TAG,
    DATA_VERSION_TAG,
    DEFAULT_DATA_VERSION,
    NULL_EVENT_POINTER,
    get_input_data_version_tag,
    get_input_event_pointer_tag,
)

# plan_context, execution_plan -> the context to run every step in the run worker in, or None
Prepare = Callable[[Any, Any], contextlib.AbstractContextManager[object] | None]


def is_local_storage(instance: dg.DagsterInstance) -> bool:
    from dagster._core.storage.event_log.sqlite.sqlite_event_log import SqliteEventLogStorage

    return isinstance(instance.event_log_storage, SqliteEventLogStorage)


def _prepared_executor_class(prepare: Prepare):
    from dagster._core.executor.multiprocess import MultiprocessExecutor

    class PreparedMultiprocessExecutor(MultiprocessExecutor):
        """Dagster's multiprocess executor, which first calls ``prepare`` in the run worker."""

        def execute(self, plan_context, execution_plan) -> Iterator[dg.DagsterEvent]:
            in_worker = prepare(plan_context, execution_plan)
            if in_worker is not None:
                from dagster._core.executor.in_process import InProcessExecutor

                in_process = InProcessExecutor(retries=self.retries, step_dependency_config=self.step_dependency_config)
                with in_worker:
                    yield from in_process.execute(plan_context, execution_plan)
                return
            try:
                yield from super().execute(plan_context, execution_plan)
            finally:
                if self._start_method == "forkserver":
                    stop_forkserver()

    return PreparedMultiprocessExecutor


def stop_forkserver() -> None:
    """End this process's forkserver now that the run's steps are done. At exit it would tear down
    torch and the code location (minutes of CPU where idle pages are evicted); it holds no files
    and its steps have exited, so SIGKILL loses nothing."""
    import signal
    from multiprocessing import forkserver

    server = forkserver._forkserver
    with server._lock:
        if server._forkserver_pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(server._forkserver_pid, signal.SIGKILL)
        server._stop_unlocked()  # reaps it and removes its socket


def multiprocess_executor(description: str, preload_modules: list[str], prepare: Prepare) -> dg.ExecutorDefinition:
    """Dagster's ``multiprocess`` executor (same config) forking steps from a forkserver preloading
    ``preload_modules``; ``prepare`` runs first in the run worker, and when it returns a context
    every step runs in the worker, inside it."""
    from dagster._core.definitions.executor_definition import MULTI_PROC_CONFIG, multiple_process_executor_requirements

    def build(init_context: dg.InitExecutorContext):
        from dagster._core.definitions.executor_definition import _core_multiprocess_executor_creation

        config = dict(init_context.executor_config)
        if not config.get("start_method"):
            config["start_method"] = {"forkserver": {"preload_modules": preload_modules}}
        executor = _core_multiprocess_executor_creation(config)
        executor.__class__ = _prepared_executor_class(prepare)  # same state, one extra step before executing
        return executor

    return dg.ExecutorDefinition(
        name="multiprocess",
        config_schema=MULTI_PROC_CONFIG,
        requirements=multiple_process_executor_requirements(),
        executor_creation_fn=build,
        description=description,
    )


def local_run_launcher(why_dead: Callable[[dg.DagsterInstance, dg.DagsterRun], str | None], remedy: str) -> type:
    """The default run launcher plus a run-worker health check: failed when ``why_dead`` gives a reason."""
    from dagster._core.launcher.base import CheckRunHealthResult, WorkerStatus

    class LocalProcessRunLauncher(dg.DefaultRunLauncher):
        @property
        def supports_check_run_worker_health(self) -> bool:
            return True

        def check_run_worker_health(self, run: dg.DagsterRun) -> CheckRunHealthResult:
            reason = why_dead(self._instance, run)
            if reason is None:
                return CheckRunHealthResult(WorkerStatus.RUNNING)
            return CheckRunHealthResult(WorkerStatus.FAILED, f"{reason} ({remedy})")

    return LocalProcessRunLauncher


def named_shape(shape: Any, name: str) -> Any:
    """``shape`` (same fields, same checks) keyed and named ``name``. Built fresh, never memoised, so a
    name never hands back another schema's fields (two settings objects with other defaults)."""
    from dagster._config.field_utils import Shape

    class NamedShape(Shape):
        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            instance = object.__new__(cls)
            instance._initialized = False
            return instance

    named = NamedShape(shape.fields, description=shape.description)
    named.key = named.given_name = name
    return named


def named_section_types(schema: Any, names: dict[str, str]) -> Any:
    """A resource's config schema with the type of each top-level field of ``names`` renamed."""
    from dagster._config.field_utils import Shape
    from dagster._core.definitions.definition_config_schema import DefinitionConfigSchema

    def retyped(field: Any, kind: Any) -> dg.Field:
        if field.default_provided:
            return dg.Field(kind, default_value=field.default_value, description=field.description)
        return dg.Field(kind, is_required=field.is_required, description=field.description)

    top = schema.as_field()
    fields = {}
    for key, field in top.config_type.fields.items():
        kind = field.config_type
        fields[key] = retyped(field, named_shape(kind, names[key]) if key in names and type(kind) is Shape else kind)
    return DefinitionConfigSchema(retyped(top, Shape(fields, description=top.config_type.description)))


class NamedSectionTypes:
    """A ``ConfigurableResource`` mix-in: each field typed by a ``Config`` class shows that class's
    name as its type (e.g. ``TrainingSettings``) on the UI's resource page, not ``Shape.<hash>``."""

    @property
    def _config_schema(self) -> Any:
        names = {
            name: field.annotation.__name__
            for name, field in type(self).model_fields.items()
            if isinstance(field.annotation, type) and issubclass(field.annotation, dg.Config)
        }
        return named_section_types(super()._config_schema, names)  # type: ignore[misc]
