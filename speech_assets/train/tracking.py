"""Where rank 0 reports: MLflow (params, config, lineage, metrics, checkpoint, environment) and,
when launched by Dagster Pipes, the orchestrating Dagster run (logs and the materialization).

Both are optional: without a tracking URI there is no MLflow run, and outside Pipes the Pipes
reporter does nothing, so the trainer runs the same from a plain command line.

Every model's run goes to one MLflow experiment (:data:`EXPERIMENT`), told apart by its ``mode``
tag (centralised, federated, distilled, iteration2 or finetuned) and linked to its Dagster run by
the ``dagster_run_id`` tag. Training series are logged by step under their own names (``loss``,
``masked_accuracy``, ...), held-out ones under ``val/`` (one point per evaluation), downstream
results under ``probe/``; configuration is logged as params only.
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
from speech_assets.train.config import DistillConfig, FinetuneConfig, RunConfig

log = logging.getLogger(__name__)


def default_artifact_location(tracking_uri: str) -> str | None:
    """``<dir>/mlartifacts`` beside a local ``sqlite:///<dir>/mlflow.db`` (or file) store, so
    artifacts never land in the working directory; ``None`` (the server's default, artifacts go
    through the server) for an http(s) tracking server. See :func:`locations.mlflow_artifact_location`."""
    return locations.mlflow_artifact_location(tracking_uri)


def is_server(tracking_uri: str) -> bool:
    return urlparse(tracking_uri).scheme in locations.MLFLOW_SERVER_SCHEMES


EXPERIMENT = "speech_assets"
DAGSTER_RUN_TAG = "dagster_run_id"
# where `make ui` serves Dagster; a team deployment names its own webserver
DAGSTER_UI_ENV, DAGSTER_UI_DEFAULT = "SPEECH_ASSETS_DAGSTER_URL", "http://127.0.0.1:3000"


def dagster_run_tags(dagster_run_id: str) -> dict[str, str]:
    """The tags that link an MLflow run back to its Dagster run: the id, and the run's note (the
    markdown MLflow shows on the run's page) with a link to the run in Dagster's UI."""
    base = os.environ.get(DAGSTER_UI_ENV, DAGSTER_UI_DEFAULT).rstrip("/")
    return {
        DAGSTER_RUN_TAG: dagster_run_id,
        "mlflow.note.content": f"Dagster run [{dagster_run_id}]({base}/runs/{dagster_run_id})",
    }


UI_PORT_ENV = "MLFLOW_PORT"  # the port `make mlflow` serves a local store's UI on (default 5000)


def local_ui_base() -> str:
    """Where ``make mlflow`` serves a local store's UI: loopback, ``$MLFLOW_PORT`` or 5000."""
    port = os.environ.get(UI_PORT_ENV, "5000")
    return f"http://127.0.0.1:{int(port) if port.isdigit() else 5000}"


def ui_base(tracking_uri: str) -> str:
    """The MLflow UI's address for ``tracking_uri``: the server itself (without its credentials),
    or, for a local store, the UI ``make mlflow`` serves over it."""
    if is_server(tracking_uri):
        return urlparse(locations.redact_uri(tracking_uri))._replace(query="", fragment="").geturl().rstrip("/")
    return local_ui_base()


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """A clickable link to the run in the MLflow UI (for a local store, the one ``make mlflow``
    serves: the link opens while it runs)."""
    return f"{ui_base(tracking_uri)}/#/experiments/{experiment_id}/runs/{run_id}"


def runs_table_url(tracking_uri: str, experiment_id: str) -> str:
    """The experiment's runs table in the MLflow UI. MLflow 3.17's UI opens an experiment in the
    view its ``workflowType`` URL parameter names (else the browser's last choice, else the GenAI
    traces view) and no longer reads the experiment's kind tag, which earlier 3.x UIs used."""
    return f"{ui_base(tracking_uri)}/#/experiments/{experiment_id}/runs?{WORKFLOW_TYPE_PARAM}"


def experiment_runs_table(tracking_uri: str, name: str = EXPERIMENT) -> str:
    """:func:`runs_table_url` of experiment ``name``, created first (as training creates it) when
    the store has none yet, so that the link opens on its (empty) runs table before any training."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=locations.with_credentials(tracking_uri))
    return runs_table_url(tracking_uri, ensure_experiment(client, name, tracking_uri, None))


def ensure_experiment(client: Any, name: str, tracking_uri: str, artifact_location: str | None) -> str:
    """The id of experiment ``name``, created (artifacts at ``artifact_location``, else
    :func:`default_artifact_location`) when it does not exist yet."""
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        location = artifact_location or default_artifact_location(tracking_uri)
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


# the accuracy on all masked frames leaks (speech_assets.evaluation.accuracy): named apart from the
# held-out masked accuracy every view shows, val/leak_free_masked_accuracy
ALL_FRAMES_SERIES = {
    "masked_accuracy": "all_frames_masked_accuracy",
    "majority_accuracy": "all_frames_majority_accuracy",
}


def heldout_series(heldout: Mapping[str, Any]) -> dict[str, float]:
    """``val/<name>`` for every numeric held-out measure (accuracies, loss; not frame counts); the
    all-frames accuracy and its majority rate as ``val/all_frames_*``."""
    return {
        f"val/{ALL_FRAMES_SERIES.get(key, key)}": float(value)
        for key, value in heldout.items()
        if isinstance(value, int | float) and not isinstance(value, bool) and not key.endswith("frames")
    }


def log_probe_results(
    tracking_uri: str, run_dir: str | Path, results: Mapping[str, float], step: int = 0
) -> str | None:
    """Log ``results`` (``{"cer": .., "wer": ..}``) as ``probe/<name>`` on the MLflow run of the
    model trained in ``run_dir`` (its ``mlflow_run_id`` file); the run id, or None when the
    folder has no MLflow run."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    id_file = RunFiles(Path(run_dir)).mlflow_run_id
    run_id = id_file.read_text(encoding="utf-8").strip() if id_file.is_file() else ""
    if not run_id:
        return None
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    now = int(time.time() * 1000)
    metrics = [Metric(f"probe/{k}", float(v), now, step) for k, v in sorted(results.items()) if v is not None]
    MlflowClient(tracking_uri=locations.with_credentials(tracking_uri)).log_batch(run_id, metrics=metrics)
    return run_id


def ui_command(tracking_uri: str, artifact_location: str | None = None) -> str:
    """The exact command that serves a local store's UI on loopback, where the run can be opened
    (a store's credentials are left out of it: it is recorded in run metadata). One worker: a
    local store has one reader, and mlflow's default four workers each import the server (the UI
    takes several times longer to come up on a small machine)."""
    artifacts = artifact_location or default_artifact_location(tracking_uri)
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
    """The inputs a run learnt from: ``data_versions``, except for a fine-tuning run from
    ``scratch``, whose encoder checkpoint gave only its architecture and input normalisation (the
    run folder is still named after it, so a new architecture trains a new baseline)."""
    if init != "scratch":
        return dict(data_versions)
    return {key: value for key, value in data_versions.items() if key not in ENCODER_INPUTS}


def input_tags(data_versions: Mapping[str, str]) -> dict[str, str]:
    """Short, readable tags of the inputs, the same for every kind of run: unpartitioned ones by
    version (16 characters), partitioned ones by count (every version is in the ``inputs.json``
    artifact and in the checkpoint)."""
    tags = {f"input.{name}": str(version)[:16] for name, version in sorted(data_versions.items()) if "/" not in name}
    for asset in sorted({key.split("/", 1)[0] for key in data_versions if "/" in key}):
        tags[f"input.{asset}"] = f"{sum(k.startswith(asset + '/') for k in data_versions)} partitions"
    return tags


def mode_of(config: RunConfig) -> str:
    """The run's ``mode`` tag: the config's, else ``finetuned`` for a CTC fine-tuning run,
    ``distilled`` for a student, ``centralised`` otherwise."""
    if config.mode:
        return config.mode
    if isinstance(config, FinetuneConfig):
        return "finetuned"
    return "distilled" if isinstance(config, DistillConfig) else "centralised"


def run_tags(config: RunConfig) -> dict[str, str]:
    """The tags a new MLflow run of ``config`` starts with: run folder, preset, ``mode``, the
    summarised inputs (:func:`input_tags`), and for a fine-tuning run its initialisation
    (``init``: ``pretrained`` or ``scratch``), labelled budget (``labelled_minutes``) and ``seed``."""
    tags = {"run_dir": config.run_dir, "preset": config.preset, "mode": mode_of(config)}
    init = None
    if isinstance(config, FinetuneConfig):
        init = config.init
        tags |= {"init": init, "seed": str(config.seed)}
        if config.budget_minutes is not None:
            tags["labelled_minutes"] = f"{config.budget_minutes:g}"
    return tags | input_tags(run_inputs(config.data_versions, init))


def installed_packages() -> str:
    """``name==version`` of every installed distribution, sorted (what ``pip freeze`` lists)."""
    found = {(d.metadata["Name"] or "?").lower(): d.version for d in importlib_metadata.distributions()}
    return "".join(f"{name}=={version}\n" for name, version in sorted(found.items()))


def log_probe_on_encoder_runs(
    tracking_uri: str,
    data_root: str | Path,
    checkpoints: Mapping[str, Mapping[str, Any]],
    summaries: Mapping[str, Any],
    warn: Any = log.warning,
) -> dict[str, str]:
    """The downstream probe's held-out CER and WER (``summaries``: model name -> an object with
    ``cer`` and ``wer`` spreads over probe seeds: ``mean``, ``std``, ``n``) as ``probe/cer``,
    ``probe/wer`` (and ``probe/cer_std``, ``probe/wer_std`` over several seeds) on the MLflow run
    of each encoder in ``checkpoints`` (name -> its ``final.pt`` contents, whose config names its
    run folder). Folders outside ``data_root`` are skipped; a store that cannot be reached only
    warns. Returns {model: MLflow run id} of the runs logged to."""
    root, logged = Path(data_root).resolve(), {}
    for name, state in checkpoints.items():
        run_dir, summary = (state.get("config") or {}).get("run_dir"), summaries.get(name)
        if not run_dir or summary is None:
            continue
        folder = Path(run_dir).resolve()
        if not folder.is_relative_to(root):
            warn(f"probe results of {name} not logged to MLflow: its run folder {folder} is outside {root}")
            continue
        metrics = {"cer": summary.cer.mean, "wer": summary.wer.mean}
        if summary.cer.n > 1:
            metrics |= {"cer_std": summary.cer.std, "wer_std": summary.wer.std}
        try:
            run_id = log_probe_results(tracking_uri, folder, metrics)
        except Exception as error:  # the probe's results stand without MLflow
            warn(f"probe results of {name} not logged to MLflow: {type(error).__name__}: {error}")
            continue
        if run_id:
            logged[name] = run_id
    return logged


class MlflowTracker:
    """One MLflow run per training run directory; a resumed attempt continues the same run."""

    def __init__(self, config: RunConfig) -> None:
        if config.mlflow_tracking_uri is None:
            raise ValueError("MlflowTracker needs config.mlflow_tracking_uri")
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.tracking import MlflowClient

        self.config = config
        self.tracking_uri = locations.redact_uri(config.mlflow_tracking_uri)  # what is shown
        self.client = MlflowClient(tracking_uri=locations.with_credentials(config.mlflow_tracking_uri))
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

    @property
    def mode(self) -> str:
        """The run's ``mode`` tag (:func:`mode_of`)."""
        return mode_of(self.config)

    def start(self, resume_run_id: str | None, plan: Mapping[str, Any]) -> str:
        """Create the run (logging params, lineage, environment) or reopen ``resume_run_id``."""
        from mlflow.entities import Param, RunTag

        cfg = self.config
        name = cfg.mlflow_experiment or EXPERIMENT
        self.experiment_id = ensure_experiment(self.client, name, self.tracking_uri, cfg.mlflow_artifact_location)
        if resume_run_id:
            self.run_id = resume_run_id
            self.client.update_run(resume_run_id, status="RUNNING")
            if cfg.dagster_run_id:  # the Dagster run that continues it
                for key, value in dagster_run_tags(cfg.dagster_run_id).items():
                    self.client.set_tag(resume_run_id, key, value)
            log.info("continuing MLflow run %s", resume_run_id)
        else:
            tags = run_tags(cfg)
            if cfg.dagster_run_id:
                tags |= dagster_run_tags(cfg.dagster_run_id)
            if cfg.git_sha:
                tags |= {"git_sha": cfg.git_sha, "mlflow.source.git.commit": cfg.git_sha}
            run = self.client.create_run(self.experiment_id, run_name=cfg.mlflow_run_name, tags=tags)
            self.run_id = run.info.run_id
            skipped = ("shards", "clients", "data_versions", "dagster_run_id", "mode")
            params = {k: v for k, v in cfg.to_dict().items() if k not in skipped}
            params |= {"num_shards": len(cfg.shards), "num_clients": len(cfg.clients)}
            params |= {f"k.{name}": c.k for name, c in cfg.clients.items()}
            params |= {f"plan.{k}": v for k, v in plan.items() if k != "reason"}
            if hasattr(cfg, "chance_accuracy"):
                params["chance_accuracy"] = round(cfg.chance_accuracy, 6)
            self.client.log_batch(
                self.run_id,
                params=[Param(k, str(v)[:6000]) for k, v in sorted(params.items())],
                tags=[RunTag("autoconfig", str(plan.get("reason", ""))[:5000])],
            )
        self._log_text(RunFiles.config.name, cfg.to_json())
        self._log_text(MLFLOW_AUTOCONFIG, json.dumps(dict(plan), indent=2, sort_keys=True))
        self._log_text(MLFLOW_ENVIRONMENT, installed_packages())
        self._log_text(MLFLOW_INPUTS, json.dumps(cfg.data_versions, indent=1, sort_keys=True))
        return self.run_id

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def finish(self, summary: Mapping[str, Any], checkpoint: Path) -> None:
        """Tag the checkpoint's hash, log it (and ``result.json``) as artifacts, and close the run
        (the held-out results are the ``val/`` series' last points)."""
        self.client.set_tag(self.run_id, "checkpoint_sha256", str(summary.get("checkpoint_sha256", "")))
        self.client.log_artifact(self.run_id, str(checkpoint), artifact_path=MLFLOW_CHECKPOINT_DIR)
        self._log_text(RunFiles.result.name, json.dumps(dict(summary), indent=2, sort_keys=True, default=str))
        self.client.set_terminated(self.run_id, status="FINISHED")

    def fail(self) -> None:
        self.client.set_terminated(self.run_id, status="FAILED")

    def _log_text(self, name: str, text: str) -> None:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / name
            path.write_text(text, encoding="utf-8")
            self.client.log_artifact(self.run_id, str(path))


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
    """Rank 0's Dagster Pipes session, or a no-op when the process was not launched by Pipes.

    While active, records of ``logger`` (INFO and up) stream to the Dagster run. The session
    is closed only by :meth:`report` (success); a failing attempt leaves it open so that a
    torchrun restart of the worker group can keep reporting into the same Dagster step.
    """

    def __init__(self, logger: logging.Logger) -> None:
        from dagster_pipes import PipesEnvVarParamsLoader, open_dagster_pipes

        self.context = open_dagster_pipes() if PipesEnvVarParamsLoader().is_dagster_pipes_process() else None
        self._logger = logger
        self._handler: logging.Handler | None = None
        if self.context is not None:
            self._handler = _PipesLogHandler(self.context)
            logger.addHandler(self._handler)

    def report(self, metadata: Mapping[str, Any], data_version: str, paths: tuple[str, ...] = ()) -> None:
        """Report the materialization (mappings become JSON metadata, ``paths`` keys path
        metadata, the rest is inferred) and close the session."""
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
        if self._handler is not None:
            self._logger.removeHandler(self._handler)
        self.context.close()
