"""Where rank 0 reports: MLflow and, when launched by Dagster Pipes, the orchestrating Dagster run.

Both are optional, so the trainer runs the same from a plain command line. Every model's run goes
to one MLflow experiment (:data:`EXPERIMENT`), told apart by its ``mode`` tag and linked to its
Dagster run by the ``dagster_run_id`` tag; held-out series are under ``val/``, probe results under ``probe/``.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import tempfile
import time
from collections.abc import Mapping
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from speech_assets import locations
from speech_assets.layout import (
    MLFLOW_AUTOCONFIG,
    MLFLOW_CHECKPOINT_DIR,
    MLFLOW_ENVIRONMENT,
    MLFLOW_INPUTS,
    RunFiles,
)
from speech_assets.train.accuracy import ALL_FRAMES_SHOWN
from speech_assets.train.config import DistillConfig, FinetuneConfig, RunConfig

log = logging.getLogger(__name__)


def is_server(tracking_uri: str) -> bool:
    return urlparse(tracking_uri).scheme in locations.MLFLOW_SERVER_SCHEMES


def mlflow_client(tracking_uri: str, **registry: str) -> Any:
    """An ``MlflowClient`` of ``tracking_uri`` with its credentials, telemetry off."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=locations.with_credentials(tracking_uri), **registry)


EXPERIMENT = "speech_assets"
DAGSTER_RUN_TAG = "dagster_run_id"
# where `make ui` serves Dagster; a team deployment names its own webserver
DAGSTER_UI_ENV, DAGSTER_UI_DEFAULT = "SPEECH_ASSETS_DAGSTER_URL", "http://127.0.0.1:3000"


UI_PORT_ENV = "MLFLOW_PORT"  # the port `make mlflow` serves a local store's UI on (default 5000)


def ui_base(tracking_uri: str) -> str:
    """The MLflow UI's address: the server (without credentials), else where ``make mlflow`` serves a local store."""
    if is_server(tracking_uri):
        return urlparse(locations.redact_uri(tracking_uri))._replace(query="", fragment="").geturl().rstrip("/")
    port = os.environ.get(UI_PORT_ENV, "5000")
    return f"http://127.0.0.1:{int(port) if port.isdigit() else 5000}"


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    return f"{ui_base(tracking_uri)}/#/experiments/{experiment_id}/runs/{run_id}"


def experiment_runs_table(tracking_uri: str, name: str = EXPERIMENT) -> str:
    """The MLflow UI's runs table of experiment ``name``, created first if need be (the link opens before training)."""
    experiment_id = ensure_experiment(mlflow_client(tracking_uri), name, tracking_uri, None)
    # MLflow 3.17's UI opens the view the workflowType parameter names, no longer the experiment's kind tag
    return f"{ui_base(tracking_uri)}/#/experiments/{experiment_id}/runs?{WORKFLOW_TYPE_PARAM}"


def ensure_experiment(client: Any, name: str, tracking_uri: str, artifact_location: str | None) -> str:
    """The id of experiment ``name``, created when it does not exist yet."""
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        location = artifact_location or locations.mlflow_artifact_location(tracking_uri)
        return client.create_experiment(name, artifact_location=location, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
    if EXPERIMENT_KIND_TAG not in experiment.tags:
        client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    if is_server(tracking_uri) and urlparse(experiment.artifact_location).scheme in ("", "file"):
        log.warning(
            "MLflow experiment %r keeps its artifacts at %s, a path on the machine that logs them, "
            "not on the server (it was created that way). Rename it (mlflow experiments rename "
            "--experiment-id %s --new-name ...) and the next run creates one whose artifacts go "
            "through the server.",
            name,
            experiment.artifact_location,
            experiment.experiment_id,
        )
    return experiment.experiment_id


# the accuracy on all masked frames leaks (speech_assets.train.accuracy): named apart from the
# held-out masked accuracy every view shows, val/leak_free_masked_accuracy
ALL_FRAMES_SERIES = dict(zip(("masked_accuracy", "majority_accuracy"), ALL_FRAMES_SHOWN, strict=True))


def heldout_series(heldout: Mapping[str, Any]) -> dict[str, float]:
    """``val/<name>`` for every numeric held-out measure but frame counts."""
    return {
        f"val/{ALL_FRAMES_SERIES.get(key, key)}": float(value)
        for key, value in heldout.items()
        if isinstance(value, int | float) and not isinstance(value, bool) and not key.endswith("frames")
    }


def ui_command(tracking_uri: str, artifact_location: str | None = None) -> str:
    """The command that serves a local store's UI on loopback, without the store's credentials (it
    is recorded in run metadata). One worker: mlflow's default four each import the server."""
    artifacts = artifact_location or locations.mlflow_artifact_location(tracking_uri)
    serve = f" --default-artifact-root {shlex.quote(artifacts)}" if artifacts else ""
    store = shlex.quote(locations.redact_uri(tracking_uri))
    return f"mlflow ui --backend-store-uri {store}{serve} --host 127.0.0.1 --workers 1 --port 5000"


EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"  # the UI's model-training view, not its GenAI view
WORKFLOW_TYPE_PARAM = "workflowType=machine_learning"  # the same, for MLflow 3.17's UI
# the encoder checkpoints a run may start from (the assets of speech_assets.defs.partitions.CHECKPOINT_ASSETS)
ENCODER_INPUTS = (
    "pretrained_checkpoint",
    "federated_checkpoint",
    "distilled_checkpoint",
    "pretrained_checkpoint_iter2",
)


def run_inputs(data_versions: Mapping[str, str], init: str | None = None) -> dict[str, str]:
    """The inputs a run learnt from: not the encoder checkpoint of a fine-tuning run from ``scratch``
    (it gave only the architecture and input normalisation)."""
    skipped = ENCODER_INPUTS if init == "scratch" else ()
    return {key: value for key, value in data_versions.items() if key not in skipped}


def input_tags(data_versions: Mapping[str, str]) -> dict[str, str]:
    """Short tags of the inputs: unpartitioned ones by version, partitioned ones by count (every
    version is in the ``inputs.json`` artifact and in the checkpoint)."""
    tags = {f"input.{name}": str(version)[:16] for name, version in sorted(data_versions.items()) if "/" not in name}
    for asset in sorted({key.split("/", 1)[0] for key in data_versions if "/" in key}):
        tags[f"input.{asset}"] = f"{sum(k.startswith(asset + '/') for k in data_versions)} partitions"
    return tags


def run_tags(config: RunConfig) -> dict[str, str]:
    """The tags a new MLflow run of ``config`` starts with."""
    kind = {FinetuneConfig: "finetuned", DistillConfig: "distilled"}.get(type(config), "centralised")
    tags = {"run_dir": config.run_dir, "preset": config.preset, "mode": config.mode or kind}
    init = None
    if isinstance(config, FinetuneConfig):
        init = config.init
        tags |= {"init": init, "seed": str(config.seed)}
        if config.budget_minutes is not None:
            tags["labelled_minutes"] = f"{config.budget_minutes:g}"
    return tags | input_tags(run_inputs(config.data_versions, init))


def installed_packages() -> str:
    """``name==version`` of every installed distribution, sorted."""
    found = {(d.metadata["Name"] or "?").lower(): d.version for d in importlib_metadata.distributions()}
    return "".join(f"{name}=={version}\n" for name, version in sorted(found.items()))


def log_probe_on_encoder_runs(
    tracking_uri: str,
    data_root: str | Path,
    checkpoints: Mapping[str, Mapping[str, Any]],
    summaries: Mapping[str, Any],
    warn: Any = log.warning,
) -> dict[str, str]:
    """The probe's held-out CER and WER (and their std over seeds) as ``probe/*`` on the MLflow run of
    each encoder in ``checkpoints`` (name -> ``final.pt`` contents); run folders outside
    ``data_root`` are skipped and an unreachable store only warns. Returns {model: run id}."""
    from mlflow.entities import Metric

    root, logged, now = Path(data_root).resolve(), {}, int(time.time() * 1000)
    for name, state in checkpoints.items():
        run_dir, summary = (state.get("config") or {}).get("run_dir"), summaries.get(name)
        if not run_dir or summary is None:
            continue
        folder = Path(run_dir).resolve()
        if not folder.is_relative_to(root):
            warn(f"probe results of {name} not logged to MLflow: its run folder {folder} is outside {root}")
            continue
        run_id = recorded_run_id(folder)
        if not run_id:
            continue
        values = {"cer": summary.cer.mean, "wer": summary.wer.mean}
        if summary.cer.n > 1:
            values |= {"cer_std": summary.cer.std, "wer_std": summary.wer.std}
        try:
            metrics = [Metric(f"probe/{k}", float(v), now, 0) for k, v in values.items()]
            mlflow_client(tracking_uri).log_batch(run_id, metrics=metrics)
        except Exception as error:  # the probe's results stand without MLflow
            warn(f"probe results of {name} not logged to MLflow: {type(error).__name__}: {error}")
            continue
        logged[name] = run_id
    return logged


def start_run(
    client: Any,
    experiment_id: str,
    previous: str | None,
    *,
    run_name: str | None,
    tags: Mapping[str, str],
    params: Mapping[str, Any],
    dagster_run_id: str | None,
    git_sha: str | None,
    autoconfig: str | None = None,
) -> str:
    """Run ``previous`` tagged with the Dagster run that continues it, or a new run with ``tags``, the
    Dagster run's and the commit's, and ``params``; its id. Both trackers start their runs here."""
    from mlflow.entities import Param, RunTag

    base = os.environ.get(DAGSTER_UI_ENV, DAGSTER_UI_DEFAULT).rstrip("/")
    note = f"Dagster run [{dagster_run_id}]({base}/runs/{dagster_run_id})"  # a link in the run's page
    linked = {DAGSTER_RUN_TAG: dagster_run_id, "mlflow.note.content": note} if dagster_run_id else {}
    if previous:
        for key, value in linked.items():
            client.set_tag(previous, key, value)
        return previous
    if git_sha:
        linked |= {"git_sha": git_sha, "mlflow.source.git.commit": git_sha}
    run_id = client.create_run(experiment_id, run_name=run_name, tags={**tags, **linked}).info.run_id
    client.log_batch(
        run_id,
        params=[Param(k, str(v)[:6000]) for k, v in sorted(params.items())],
        tags=[] if autoconfig is None else [RunTag("autoconfig", autoconfig[:5000])],
    )
    return run_id


class MlflowTracker:
    """One MLflow run per training run directory; a resumed attempt continues the same run."""

    def __init__(self, config: RunConfig) -> None:
        if config.mlflow_tracking_uri is None:
            raise ValueError("MlflowTracker needs config.mlflow_tracking_uri")
        self.config = config
        self.tracking_uri = locations.redact_uri(config.mlflow_tracking_uri)  # what is shown
        self.client = mlflow_client(config.mlflow_tracking_uri)
        self.run_id = ""
        self.experiment_id = ""

    @property
    def url(self) -> str:
        return run_url(self.tracking_uri, self.experiment_id, self.run_id)

    @property
    def ui_command(self) -> str:
        return ui_command(self.tracking_uri, self.config.mlflow_artifact_location)

    @property
    def served(self) -> bool:
        """Whether the store is a tracking server (else ``make mlflow`` serves its UI)."""
        return is_server(self.tracking_uri)

    def start(self, resume_run_id: str | None, plan: Mapping[str, Any]) -> str:
        """Create the run (logging params, lineage, environment) or reopen ``resume_run_id``."""
        cfg = self.config
        name = cfg.mlflow_experiment or EXPERIMENT
        self.experiment_id = ensure_experiment(self.client, name, self.tracking_uri, cfg.mlflow_artifact_location)
        if resume_run_id:
            self.client.update_run(resume_run_id, status="RUNNING")
            log.info("continuing MLflow run %s", resume_run_id)
        skipped = ("shards", "clients", "data_versions", "dagster_run_id", "mode")
        params = {k: v for k, v in cfg.to_dict().items() if k not in skipped}
        params |= {"num_shards": len(cfg.shards), "num_clients": len(cfg.clients)}
        params |= {f"k.{name}": c.k for name, c in cfg.clients.items()}
        params |= {f"plan.{k}": v for k, v in plan.items() if k != "reason"}
        if hasattr(cfg, "chance_accuracy"):
            params["chance_accuracy"] = round(cfg.chance_accuracy, 6)
        self.run_id = start_run(
            self.client,
            self.experiment_id,
            resume_run_id,
            run_name=cfg.mlflow_run_name,
            tags=run_tags(cfg),
            params=params,
            dagster_run_id=cfg.dagster_run_id,
            git_sha=cfg.git_sha,
            autoconfig=str(plan.get("reason", "")),
        )
        self.client.log_text(self.run_id, cfg.to_json(), RunFiles.config.name)
        self.client.log_text(self.run_id, json.dumps(dict(plan), indent=2, sort_keys=True), MLFLOW_AUTOCONFIG)
        self.client.log_text(self.run_id, installed_packages(), MLFLOW_ENVIRONMENT)
        self.client.log_text(self.run_id, json.dumps(cfg.data_versions, indent=1, sort_keys=True), MLFLOW_INPUTS)
        return self.run_id

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def finish(self, summary: Mapping[str, Any], checkpoint: Path) -> None:
        """Tag the checkpoint's hash, log it and ``result.json`` as artifacts, and close the run."""
        self.client.set_tag(self.run_id, "checkpoint_sha256", str(summary.get("checkpoint_sha256", "")))
        self.client.log_artifact(self.run_id, str(checkpoint), artifact_path=MLFLOW_CHECKPOINT_DIR)
        summary_text = json.dumps(dict(summary), indent=2, sort_keys=True, default=str)
        self.client.log_text(self.run_id, summary_text, RunFiles.result.name)
        self.client.set_terminated(self.run_id, status="FINISHED")

    def fail(self) -> None:
        self.client.set_terminated(self.run_id, status="FAILED")


class _PipesLogHandler(logging.Handler):
    def __init__(self, context: Any) -> None:
        super().__init__(level=logging.INFO)
        self.context = context

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.context.log.log(record.levelno, self.format(record))
        except Exception:  # a broken pipe to Dagster must not kill training
            self.handleError(record)


class PipesReporter:
    """Rank 0's Dagster Pipes session (a no-op outside Pipes); ``logger``'s records stream to the run.
    Closed only by :meth:`report`, so that a torchrun restart keeps reporting into the same step."""

    def __init__(self, logger: logging.Logger) -> None:
        from dagster_pipes import PipesEnvVarParamsLoader, open_dagster_pipes

        self.context = open_dagster_pipes() if PipesEnvVarParamsLoader().is_dagster_pipes_process() else None
        self._logger, self._handler = logger, _PipesLogHandler(self.context)
        if self.context is not None:
            logger.addHandler(self._handler)

    def report(self, metadata: Mapping[str, Any], data_version: str, paths: tuple[str, ...] = ()) -> None:
        """Report the materialization (``paths`` keys as path metadata) and close the session."""
        if self.context is None:
            return

        def kind(key: str, value: Any) -> str:
            if isinstance(value, Mapping):
                return "json"
            return "path" if key in paths else "url" if key.endswith("_url") else "__infer__"

        typed = {
            key: {"raw_value": float(f"{value:.4g}") if isinstance(value, float) else value, "type": kind(key, value)}
            for key, value in metadata.items()
        }
        self.context.report_asset_materialization(metadata=typed, data_version=data_version)
        self._logger.removeHandler(self._handler)
        self.context.close()


# MLflow models: the exported ONNX files, logged into the run of the model they come from
RECOGNISER_REGISTERED_NAME = "speech_assets_recogniser"  # `transcribe --model models:/speech_assets_recogniser/latest`
ENCODER_MODEL, RECOGNISER_MODEL = "encoder", "recogniser"  # logged model names (`runs:/<run id>/recogniser`)


def export_signature(width: int, output_names: tuple[str, str] | None = None) -> Any:
    """The MLflow tensor signature of an exported encoder (or, with ``RECOGNISER_OUTPUT_NAMES``, a recogniser)."""
    import numpy as np
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    from speech_assets.model.export import INPUT_NAMES, OUTPUT_NAMES

    def padded(size: int, values: str, lengths: str) -> Schema:  # (B, T, size) float32 and (B,) int64 lengths
        return Schema(
            [TensorSpec(np.dtype("float32"), (-1, -1, size), values), TensorSpec(np.dtype("int64"), (-1,), lengths)]
        )

    return ModelSignature(inputs=padded(80, *INPUT_NAMES), outputs=padded(width, *(output_names or OUTPUT_NAMES)))


def log_onnx_model(
    tracking_uri: str,
    run_id: str,
    onnx_file: str | os.PathLike[str],
    extra_files: list[Path],
    *,
    name: str,
    signature: Any,
    tags: Mapping[str, str] | None = None,
    registered_name: str | None = None,
) -> dict[str, str]:
    """Log ``onnx_file`` as an MLflow model into run ``run_id`` (registered as a new version of
    ``registered_name`` when given); returns ``model_uri`` and, when registered, ``registered_uri``
    and ``version``. Through the client only: the fluent ``log_model`` would put the model in the
    process's active experiment, not the run's."""
    import mlflow.onnx
    import onnx
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus
    from mlflow.exceptions import MlflowException
    from mlflow.models import Model
    from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode

    client = mlflow_client(tracking_uri)
    experiment_id = client.get_run(run_id).info.experiment_id
    model = client.create_logged_model(
        experiment_id, name=name, source_run_id=run_id, tags=dict(tags or {}), model_type="onnx"
    )
    try:
        with tempfile.TemporaryDirectory() as folder:
            local = Path(folder) / "model"
            described = Model(
                artifact_path=model.artifact_location, model_uuid=model.model_id, run_id=run_id, model_id=model.model_id
            )
            mlflow.onnx.save_model(
                onnx.load(str(onnx_file)),
                local,
                mlflow_model=described,
                signature=signature,
                save_as_external_data=False,
                extra_files=[str(p) for p in extra_files],
                # the model's requirements named, not inferred (inference loads it in a subprocess)
                pip_requirements=mlflow.onnx.get_default_pip_requirements(),
                onnx_execution_providers=["CPUExecutionProvider"],
            )
            client.log_model_artifacts(model.model_id, str(local))
        client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step=0)])
        client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
    except BaseException:
        client.finalize_logged_model(model.model_id, LoggedModelStatus.FAILED)
        raise
    logged = {"model_uri": f"models:/{model.model_id}"}
    if registered_name:
        try:
            client.create_registered_model(registered_name, description="speech_assets: the fine-tuned CTC recogniser")
        except MlflowException as error:
            if error.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
                raise
        # the source by its artifact location: a `models:/<id>` source is resolved through the
        # process's global tracking URI (an MLflow TODO), not this client's store
        version = client.create_model_version(
            registered_name,
            source=model.artifact_location,
            run_id=run_id,
            model_id=model.model_id,
            tags=dict(tags or {}),
        )
        logged |= {"version": str(version.version), "registered_uri": f"models:/{registered_name}/{version.version}"}
    return logged


def download_onnx_model(uri: str, tracking_uri: str, destination: Path) -> tuple[Path, dict[str, Path]]:
    """Download the MLflow model ``uri`` into ``destination``: (its ONNX file, ``{name: path}`` of its
    extra files); ``ValueError`` when the URI names no ONNX model."""
    import mlflow.artifacts
    from mlflow.exceptions import MlflowException
    from mlflow.models import Model
    from mlflow.store.artifact.utils.models import get_model_name_and_version

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # stderr is for errors
    named, store = uri, locations.with_credentials(tracking_uri)
    try:
        # resolved to the model's artifact location here: MLflow resolves `models:/` and a run's
        # logged models through the process's global tracking and registry URIs, not this store
        client = mlflow_client(tracking_uri, registry_uri=store)
        if urlparse(uri).scheme == "models":
            found = get_model_name_and_version(client, uri)
            if len(found) == 1:
                uri = client.get_logged_model(found[0]).artifact_location
            else:
                uri = client.get_model_version_download_uri(*found)
        else:  # the model ``runs:/<run id>/<name>`` names: the last one logged under that name in that run
            run_id, _, name = urlparse(uri).path.strip("/").partition("/")
            if not run_id or not name or "/" in name:
                raise MlflowException(f"{uri} is not of the form runs:/<run id>/<model name>")
            experiment_id = client.get_run(run_id).info.experiment_id
            named_models = client.search_logged_models(experiment_ids=[experiment_id], filter_string=f"name = '{name}'")
            found = [model for model in named_models if model.source_run_id == run_id]
            if not found:
                raise MlflowException(f"run {run_id} logged no model named {name!r}")
            uri = max(found, key=lambda model: model.creation_timestamp).artifact_location
        local = Path(
            mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(destination), tracking_uri=store)
        )
        described = Model.load(str(local))
    except (MlflowException, OSError) as error:
        raise ValueError(f"no MLflow model at {named} in {locations.redact_uri(tracking_uri)}: {error}") from error
    flavour = described.flavors.get("onnx")
    if flavour is None:
        raise ValueError(f"{named} is not an ONNX model (flavours: {', '.join(sorted(described.flavors))})")
    extras = {Path(entry["path"]).name: local / entry["path"] for entry in flavour.get("extra_files") or []}
    return local / flavour["data"], extras


def recorded_run_id(run_dir: Path) -> str | None:
    id_file = RunFiles(run_dir).mlflow_run_id
    return (id_file.read_text(encoding="utf-8").strip() or None) if id_file.is_file() else None


def log_exported_model(
    tracking_uri: str,
    checkpoint: str | os.PathLike[str],
    state: Mapping[str, Any],
    onnx_file: Path,
    extra_files: list[Path],
    warn: Any = log.warning,
    **how: Any,
) -> dict[str, str]:
    """:func:`log_onnx_model` into the run of ``checkpoint``; ``{}`` with a warning when there is none
    or the store refuses: the export stands without MLflow."""
    run_id = str(state["mlflow_run_id"]) if state.get("mlflow_run_id") else recorded_run_id(Path(checkpoint).parent)
    if not run_id:
        warn(f"{onnx_file.name} not logged as an MLflow model: {checkpoint} records no MLflow run")
        return {}
    try:
        return {"run_id": run_id} | log_onnx_model(tracking_uri, run_id, onnx_file, extra_files, **how)
    except Exception as error:  # noqa: BLE001 - a tracking store that cannot be reached must not lose the export
        warn(f"{onnx_file.name} not logged as an MLflow model: {type(error).__name__}: {error}")
        return {}
