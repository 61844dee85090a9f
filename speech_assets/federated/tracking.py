"""MLflow for a federated run in the centralised trainer's experiment (``mode`` tag ``federated``):
one MLflow run per run folder (id in ``mlflow_run_id``: a resumed run continues it), each round's
metrics at step = round (a round in the ``round_seconds`` history is not logged twice), and the
final checkpoint, round tables and result as artifacts.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any

from speech_assets.federated.config import FederatedConfig
from speech_assets.layout import MLFLOW_CHECKPOINT_DIR, MLFLOW_ENVIRONMENT, MLFLOW_INPUTS, FederatedPaths
from speech_assets.train.tracking import (
    EXPERIMENT,
    ensure_experiment,
    input_tags,
    installed_packages,
    is_server,
    run_url,
    start_run,
)
from speech_assets.utils import atomic_write_text


class FederatedTracker:
    """``start()``, then ``log_round(record)`` per completed round, then ``finish(result)`` or
    ``fail(reason)``; ``run_id``/``url`` once started."""

    def __init__(
        self,
        config: FederatedConfig,
        tracking_uri: str,
        *,
        artifact_location: str | None = None,
        git_sha: str | None = None,
        dagster_run_id: str | None = None,
    ) -> None:
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.tracking import MlflowClient

        self.config, self.tracking_uri = config, tracking_uri
        self.paths = FederatedPaths(config.run_dir)
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.artifact_location, self.git_sha = artifact_location, git_sha
        self.dagster_run_id = dagster_run_id
        self.run_id = ""
        self.experiment, self.experiment_id = EXPERIMENT, ""
        self.logged: set[int] = set()

    @property
    def url(self) -> str:
        return run_url(self.tracking_uri, self.experiment_id, self.run_id)

    @property
    def served(self) -> bool:
        return is_server(self.tracking_uri)

    def start(self) -> str:
        """Create the MLflow run (params, tags, environment) or continue the run folder's one."""
        config = self.config
        self.experiment_id = ensure_experiment(self.client, self.experiment, self.tracking_uri, self.artifact_location)
        id_file = self.paths.mlflow_run_id
        previous = id_file.read_text().strip() if id_file.is_file() else ""
        if previous:
            self.logged = {int(m.step) for m in self.client.get_metric_history(previous, "round_seconds")}
            if self.client.get_run(previous).info.status != "FINISHED":
                self.client.update_run(previous, status="RUNNING")
        tags = {
            "run_dir": str(self.paths.root),
            "preset": config.preset,
            "strategy": config.strategy,
            "mode": "federated",
        }
        params = {k: v for k, v in config.to_dict().items() if k not in ("clients", "data_versions", "run_dir")}
        params |= {"num_clients": len(config.clients), "clients": ",".join(config.clients)}
        self.run_id = start_run(
            self.client,
            self.experiment_id,
            previous,
            run_name=f"federated-{config.run_name}",
            # the inputs summarised as every run's are; each version in inputs.json
            tags=tags | input_tags(config.data_versions),
            params=params,
            dagster_run_id=self.dagster_run_id,
            git_sha=self.git_sha,
        )
        if previous:
            return previous
        self.paths.root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(id_file, self.run_id + "\n")
        self.client.log_text(self.run_id, installed_packages(), MLFLOW_ENVIRONMENT)
        self.client.log_text(self.run_id, json.dumps(config.data_versions, indent=1, sort_keys=True), MLFLOW_INPUTS)
        return self.run_id

    def log_round(self, record: Mapping[str, Any]) -> None:
        """Aggregate and per-client metrics at step = round. A client without held-out frames has no
        held-out point (never a 0.0); under DP the record holds no client's values unless shared."""
        from mlflow.entities import Metric

        from speech_assets.federated.history import summarize_rounds

        step = int(record["round"])
        if not self.run_id or step in self.logged:
            return
        line = summarize_rounds([record])[0]
        values = {
            "train_loss": line["train_loss"],
            "val/loss": line["heldout_loss"],
            # all masked frames, leak included: named apart from the held-out masked accuracy (leak-free)
            "val/all_frames_masked_accuracy": line["heldout_masked_accuracy"],
            "val/all_frames_majority_accuracy": line["majority_accuracy"],
            "val/leak_free_masked_accuracy": line["heldout_leak_free_masked_accuracy"],
            "val/leak_free_majority_accuracy": line["heldout_leak_free_majority_accuracy"],
            "round_seconds": line["round_seconds"],
            "bytes_up": line["bytes_up"],
            "bytes_down": line["bytes_down"],
            "clients": line["clients"],
            "missing_clients": len(line["missing"]),
            "sampled_clients": line["sampled"],
            "round_overhead": line["overhead"],
            "epsilon": line["epsilon"],
        }
        for row in record["rows"]:
            values[f"{row['client_id']}.train_loss"] = row["train_loss"]
            values[f"{row['client_id']}.masked_accuracy"] = row["masked_accuracy"]
        for row in record["evaluation"]:
            if not row.get("masked_frames"):
                continue
            client = row["client_id"]
            values[f"val/{client}/all_frames_masked_accuracy"] = row["heldout_masked_accuracy"]
            values[f"val/{client}/all_frames_majority_accuracy"] = row["majority_accuracy"]
            values[f"val/{client}/leak_free_masked_accuracy"] = row.get("heldout_leak_free_masked_accuracy")
            values[f"val/{client}/leak_free_majority_accuracy"] = row.get("leak_free_majority_accuracy")
        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for k, v in values.items() if v is not None]
        self.client.log_batch(self.run_id, metrics=metrics)
        self.logged.add(step)

    def finish(self, result: Mapping[str, Any]) -> None:
        """The final checkpoint, tables and result as artifacts; the run FINISHED (once per checkpoint)."""
        if not self.run_id:
            return
        run = self.client.get_run(self.run_id)
        if run.info.status == "FINISHED" and run.data.tags.get("checkpoint_sha256") == result["checkpoint_sha256"]:
            return
        self.client.set_tag(self.run_id, "checkpoint_sha256", str(result["checkpoint_sha256"]))
        self.client.log_artifact(self.run_id, str(self.paths.final), artifact_path=MLFLOW_CHECKPOINT_DIR)
        for path in (self.paths.rounds_table, self.paths.evaluation_table, self.paths.run_config):
            if path.is_file():
                self.client.log_artifact(self.run_id, str(path))
        result_text = json.dumps(dict(result), indent=2, sort_keys=True, default=str)
        self.client.log_text(self.run_id, result_text, self.paths.result.name)
        self.client.set_terminated(self.run_id, status="FINISHED")

    def fail(self, reason: str) -> None:
        if not self.run_id:
            return
        self.client.set_tag(self.run_id, "failure", reason[:5000])
        self.client.set_terminated(self.run_id, status="FAILED")
