"""Where rank 0 reports: MLflow (params, config, lineage, metrics, checkpoint, environment) and,
when launched by Dagster Pipes, the orchestrating Dagster run (logs and the materialization).

Both are optional: without a tracking URI there is no MLflow run, and outside Pipes the Pipes
reporter does nothing, so the trainer runs the same from a plain command line.
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
from speech_assets.train.config import RunConfig

log = logging.getLogger(__name__)


def default_artifact_location(tracking_uri: str) -> str | None:
    """``<dir>/mlartifacts`` beside a local ``sqlite:///<dir>/mlflow.db`` (or file) store, so
    artifacts never land in the working directory; ``None`` (the server's default, artifacts go
    through the server) for an http(s) tracking server. See :func:`locations.mlflow_artifact_location`."""
    return locations.mlflow_artifact_location(tracking_uri)


def is_server(tracking_uri: str) -> bool:
    return urlparse(tracking_uri).scheme in locations.MLFLOW_SERVER_SCHEMES


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str | None:
    """A clickable link to the run when the tracking URI is a server (without its credentials);
    None for local stores."""
    if is_server(tracking_uri):
        base = urlparse(locations.redact_uri(tracking_uri))._replace(query="", fragment="").geturl()
        return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
    return None


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
SHORT_INPUTS = ("manifest", "cmvn_stats", "client_partitions")


def input_tags(data_versions: Mapping[str, str]) -> dict[str, str]:
    """Short, readable tags of the inputs: unpartitioned ones by version, partitioned ones by count
    (every version is in the ``inputs.json`` artifact and in the checkpoint)."""
    tags = {f"input.{name}": data_versions[name][:16] for name in SHORT_INPUTS if data_versions.get(name)}
    for asset in sorted({key.split("/", 1)[0] for key in data_versions if "/" in key}):
        tags[f"input.{asset}"] = f"{sum(k.startswith(asset + '/') for k in data_versions)} partitions"
    return tags


def installed_packages() -> str:
    """``name==version`` of every installed distribution, sorted (what ``pip freeze`` lists)."""
    found = {(d.metadata["Name"] or "?").lower(): d.version for d in importlib_metadata.distributions()}
    return "".join(f"{name}=={version}\n" for name, version in sorted(found.items()))


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
    def url(self) -> str | None:
        return run_url(self.tracking_uri, self.experiment_id, self.run_id)

    @property
    def ui_command(self) -> str:
        return ui_command(self.tracking_uri, self.config.mlflow_artifact_location)

    def start(self, resume_run_id: str | None, plan: Mapping[str, Any]) -> str:
        """Create the run (logging params, lineage, environment) or reopen ``resume_run_id``."""
        from mlflow.entities import Param, RunTag

        cfg = self.config
        experiment = self.client.get_experiment_by_name(cfg.mlflow_experiment)
        if experiment is None:
            location = cfg.mlflow_artifact_location or default_artifact_location(self.tracking_uri)
            self.experiment_id = self.client.create_experiment(
                cfg.mlflow_experiment, artifact_location=location, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}
            )
        else:
            self.experiment_id = experiment.experiment_id
            if EXPERIMENT_KIND_TAG not in experiment.tags:
                self.client.set_experiment_tag(self.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
            if is_server(self.tracking_uri) and urlparse(experiment.artifact_location).scheme in ("", "file"):
                log.warning(
                    "MLflow experiment %r keeps its artifacts at %s, a path on the machine that logs them, "
                    "not on the server (it was created that way). Rename it (mlflow experiments rename "
                    "--experiment-id %s --new-name ...) and the next run creates one whose artifacts go "
                    "through the server.", cfg.mlflow_experiment, experiment.artifact_location, experiment.experiment_id,
                )
        if resume_run_id:
            self.run_id = resume_run_id
            self.client.update_run(resume_run_id, status="RUNNING")
            log.info("continuing MLflow run %s", resume_run_id)
        else:
            tags = {"run_dir": cfg.run_dir, "preset": cfg.preset}
            if cfg.git_sha:
                tags |= {"git_sha": cfg.git_sha, "mlflow.source.git.commit": cfg.git_sha}
            tags |= input_tags(cfg.data_versions)
            run = self.client.create_run(self.experiment_id, run_name=cfg.mlflow_run_name, tags=tags)
            self.run_id = run.info.run_id
            params = {k: v for k, v in cfg.to_dict().items() if k not in ("shards", "clients", "data_versions")}
            params |= {"num_shards": len(cfg.shards), "num_clients": len(cfg.clients)}
            params |= {f"k.{name}": c.k for name, c in cfg.clients.items()}
            params |= {f"plan.{k}": v for k, v in plan.items() if k != "reason"}
            self.client.log_batch(
                self.run_id,
                params=[Param(k, str(v)[:6000]) for k, v in sorted(params.items())],
                tags=[RunTag("autoconfig", str(plan.get("reason", ""))[:5000])],
            )
        self._log_text("config.json", cfg.to_json())
        self._log_text("autoconfig.json", json.dumps(dict(plan), indent=2, sort_keys=True))
        self._log_text("environment.txt", installed_packages())
        self._log_text("inputs.json", json.dumps(cfg.data_versions, indent=1, sort_keys=True))
        return self.run_id

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def finish(self, summary: Mapping[str, Any], checkpoint: Path) -> None:
        """Log the final summary metrics, the checkpoint as an artifact, and close the run."""
        numeric = {k: float(v) for k, v in summary.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        self.log_metrics({f"final.{k}": v for k, v in numeric.items()}, step=int(summary.get("step", 0)))
        self.client.set_tag(self.run_id, "checkpoint_sha256", str(summary.get("checkpoint_sha256", "")))
        self.client.log_artifact(self.run_id, str(checkpoint), artifact_path="checkpoint")
        self._log_text("result.json", json.dumps(dict(summary), indent=2, sort_keys=True, default=str))
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
