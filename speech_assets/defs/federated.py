"""Stage 4b: federated HuBERT-style pretraining with Flower (`federated_checkpoint`).

Data and prediction heads never leave a client; the server aggregates only the encoder. torch,
flwr and mlflow are imported inside the asset, never when the code location loads.
"""

import json
from pathlib import Path

import dagster as dg

from speech_assets.corpus.clients import read_clients
from speech_assets.defs import readable
from speech_assets.defs.conditions import retrain_on_cron
from speech_assets.defs.lineage import input_versions
from speech_assets.defs.partitions import TRAINING_INPUTS
from speech_assets.defs.resources import FederatedSettings, PipelineSettings, StoragePaths, effective, overrides_of
from speech_assets.defs.runs import record_run_process
from speech_assets.locations import git_commit, redact_uri
from speech_assets.train import accuracy
from speech_assets.train.provenance import record_provenance
from speech_assets.train.tracking import ui_command
from speech_assets.utils import from_fields, sha256_strings

# v4: seeded client sampling, evaluation every k rounds, FedProx, DP, secure aggregation; v3: client_lr_schedule
# (constant by default); v2: the loss on unmasked frames too (unmasked_weight 1.0)
CODE_VERSION = "federated-v5"  # v5: the clients' heads in one batched product
# Settings that do not change what a run computes: a different value resumes the same run folder.
OPERATIONAL = (
    "engine",
    "superlink",
    "superlink_root_certificates",
    "insecure",
    "client_state_root",
    "round_timeout_s",
    "connect_timeout_s",
    "device",
    # the local clients' limits decide whether they take part, not what a round computes
    "secagg_min_shares",
    "secagg_threshold_floor",
    "dp_max_clipping_norm",
)


def federated_tracker(paths: StoragePaths, config, *, git_sha: str | None, dagster_run_id: str | None):
    """The MLflow tracker of a federated run; a new experiment keeps its artifacts where every tracked asset's do."""
    from speech_assets.federated.tracking import FederatedTracker

    return FederatedTracker(
        config,
        paths.mlflow_tracking_uri,
        artifact_location=paths.mlflow_artifact_location,
        git_sha=git_sha,
        dagster_run_id=dagster_run_id,
    )


FederatedOverrides = overrides_of(FederatedSettings)


def run_name_for(data_versions: dict[str, str], settings: FederatedSettings) -> str:
    """Same inputs and the same (non-operational) settings -> the same run folder, which resumes."""
    knobs = json.dumps(settings.model_dump(exclude=set(OPERATIONAL)), sort_keys=True)
    return sha256_strings([json.dumps(data_versions, sort_keys=True), knobs, CODE_VERSION])[:16]


@dg.asset(
    group_name="training",
    deps=TRAINING_INPUTS,
    code_version=CODE_VERSION,
    pool="training",
    kinds={"pytorch", "mlflow"},
    automation_condition=retrain_on_cron(),
)
def federated_checkpoint(
    context: dg.AssetExecutionContext, config: FederatedOverrides, paths: StoragePaths, settings: PipelineSettings
) -> dg.MaterializeResult:
    """Federated HuBERT-style pretraining with Flower (simulation runtime here, or a SuperLink and
    SuperNodes): local rounds on a seeded sample of the clients, each on its own data with its own
    head, FedAdam/FedAvg/FedProx on the shared encoder only, optional DP and secure aggregation;
    resumes from its last completed round; MLflow."""
    from speech_assets.federated import launch
    from speech_assets.federated.config import FederatedConfig
    from speech_assets.federated.history import SettingsChanged, round_log_line
    from speech_assets.federated.processes import NeedsLinux
    from speech_assets.stats.plots import inline_chart, markdown_image, round_curve

    record_run_process(context)
    fed = effective(settings.federated, config)
    table = read_clients(paths.layout.clients_file)
    clients = table.clients
    data_versions = input_versions(context, paths, table.speakers)
    run_name = run_name_for(data_versions, fed)
    run_dir = paths.federated_run(run_name).root
    federated = from_fields(
        FederatedConfig,
        fed,
        run_dir=str(run_dir),
        run_name=run_name,
        clients=clients,
        client_weights=table.weights(clients),
        data_versions=data_versions,
        heldout_speakers=table.heldout,
        train_speakers=table.train_speakers(),
    )
    commit = git_commit()
    tracker = federated_tracker(paths, federated, git_sha=commit, dagster_run_id=context.run.run_id)
    engine = launch.describe_engine(fed.superlink, fed.engine)
    context.log.info(f"federated run {run_name} in {run_dir}: {len(clients)} clients on {engine}")
    try:
        result = launch.run_federation(
            federated,
            paths.root,
            launch.Deployment.of(fed),
            log=context.log.info,
            on_round=lambda record: context.log.info(round_log_line(record, federated.rounds)),
            tracker=tracker,
        )
    except (SettingsChanged, launch.InsecureRefused, NeedsLinux) as error:
        raise dg.Failure(description=f"federated run {run_name} refused: {error}") from error
    except launch.FederatedRunFailed as error:
        raise dg.Failure(
            description=f"federated run {run_name} stopped: {error}",
            metadata={"run_dir": dg.MetadataValue.path(str(run_dir)), "failure": dg.MetadataValue.json(error.failure)},
        ) from error

    sha = _verify_checkpoint(result["checkpoint"], result["checkpoint_sha256"])
    record_provenance(
        run_dir,
        sha,
        git_sha=commit,
        mlflow_run_id=tracker.run_id or None,
        mlflow_run_url=redact_uri(tracker.url) if tracker.url else None,
        dagster_run_id=context.run.run_id,
        preset=fed.preset,
    )
    lines = result["round_summaries"]
    # 0 frames, never null: under DP a client's values are null (withheld), not unscored
    unscored = sorted(client for client, scores in result["heldout_per_client"].items() if scores["masked_frames"] == 0)
    if unscored:
        context.log.warning(
            f"{', '.join(unscored)} hold no held-out speaker: their held-out results are null (the other clients' "
            "frames make the run's held-out accuracy)"
        )
    metadata = {
        # Dagster lists metadata in insertion order: the curve near the top
        "curve": dg.MetadataValue.md(inline_chart(f"{accuracy.LABEL} by round", round_series(lines))),
        "rounds": result["rounds"],
        "strategy": result["strategy"],
        "local_steps": result["local_steps"],
        "clients": len(result["clients"]),
        **accuracy.metadata(result),
        "all_frames_masked_accuracy": readable.rounded(result["heldout_masked_accuracy"]),
        "final_train_loss": readable.rounded(result["final_train_loss"], 4),
        "mean_round_s": readable.rounded(result["mean_round_seconds"], 1),
        "mb_up_per_round": readable.megabytes(result["bytes_up_per_round"]),
        "mb_down_per_round": readable.megabytes(result["bytes_down_per_round"]),
        "checkpoint_mb": readable.megabytes(Path(result["checkpoint"]).stat().st_size),
        "fraction_train": result["fraction_train"],
        "mean_round_overhead": readable.rounded(result["mean_overhead"]),
        "secure_aggregation": result["secure_aggregation"],
        "privacy": dg.MetadataValue.json(result["privacy"] or {"differential_privacy": False}),
        **({"epsilon": readable.rounded(result["privacy"]["epsilon"])} if result["privacy"] else {}),
        "per_round": readable.table(round_rows(lines, result["sampled_by_round"]), ROUND_COLUMNS),
        "round_plot": dg.MetadataValue.md(markdown_image(round_curve(lines), "round curve")),
        "heldout_per_client": readable.per_client_table(result["heldout_per_client"]),
        "resumed_from_round": result["resumed_from_round"] or 0,
        "checkpoint": dg.MetadataValue.path(result["checkpoint"]),
        "checkpoint_sha256": sha,
        "rounds_table": dg.MetadataValue.path(str(paths.federated_run(run_name).rounds_table)),
        "run_dir": dg.MetadataValue.path(str(run_dir)),
        **readable.mlflow_links(
            tracker.run_id,
            tracker.url,
            None if tracker.served else ui_command(paths.mlflow_tracking_uri, paths.mlflow_artifact_location),
        ),
        "input_versions": dg.MetadataValue.json(data_versions),
    }
    return dg.MaterializeResult(data_version=dg.DataVersion(sha), metadata=metadata)


ROUND_COLUMNS = {
    "round": "round",
    "clients": "clients that trained",
    "sampled": "clients asked to train",
    "missing": "asked but did not reply",
    "train_loss": "local train loss, weighted as aggregated",
    "heldout_masked_accuracy": f"{accuracy.LABEL} (leak-free frames; evaluated rounds)",
    "heldout_majority_accuracy": "majority-class rate, same frames",
    "all_frames_masked_accuracy": "on all masked frames, leak included: only to measure the leak",
    "mb_up": "MB clients sent",
    "mb_down": "MB clients received",
    "round_s": "wall time of the round (s)",
}


def round_rows(lines: list[dict], sampled_by_round: dict[str, list[str]]) -> list[dict]:
    """One table row per round (summarize_rounds' lines); the all-frames accuracy named apart."""
    rows = []
    for line in lines:
        found = accuracy.heldout_accuracy(line)
        rows.append(
            {k: v for k, v in line.items() if k not in ROUND_HELDOUT}
            | {
                "heldout_masked_accuracy": found.accuracy if found else None,
                "heldout_majority_accuracy": found.majority if found else None,
                "all_frames_masked_accuracy": line.get("heldout_masked_accuracy"),
                "sampled": ", ".join(sampled_by_round.get(str(line["round"]), [])),
                "mb_up": readable.megabytes(line["bytes_up"]),
                "mb_down": readable.megabytes(line["bytes_down"]),
                "round_s": round(line["round_seconds"], 1),
            }
        )
    return rows


# a round line's held-out keys, replaced in the table by round_rows' (one name per number)
ROUND_HELDOUT = ("heldout_masked_accuracy", "majority_accuracy", accuracy.ACCURACY, accuracy.MAJORITY)


def round_series(lines: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """Held-out masked accuracy and majority-class rate by round; the train loss where none was evaluated."""
    scored = [(line["round"], found) for line in lines if (found := accuracy.heldout_accuracy(line)) is not None]
    if not scored:
        return {"train loss": [(line["round"], line["train_loss"]) for line in lines]}
    return {
        accuracy.LABEL: [(r, found.accuracy) for r, found in scored],
        "majority class": [(r, found.majority) for r, found in scored],
    }


def _verify_checkpoint(path: str, expected: str) -> str:
    """Re-hash the final encoder from ``final.pt`` (``weights_only`` load); it is the data version."""
    from speech_assets.model.encoders import weights_sha256
    from speech_assets.train.checkpoint import load_checkpoint

    state = load_checkpoint(path)
    sha = weights_sha256(state["encoder"])
    if sha != expected:
        raise dg.Failure(description=f"{path}: encoder sha256 {sha} differs from the server's record {expected}")
    return sha
