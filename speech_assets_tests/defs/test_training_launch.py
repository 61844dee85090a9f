"""The training asset's launch: what run config may not set, and one real torchrun job (two
processes) that runs out of memory once and is retried with half the batch, whose rendezvous and
collectives listen on loopback only, and whose tracking URI's credentials are stored nowhere."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from pathlib import Path

import dagster as dg
import psutil
import pytest
import torch

from speech_assets.definitions import build_definitions
from speech_assets.defs.resources import PipelineSettings, StoragePaths
from speech_assets.layout import RunFiles
from speech_assets.runtime.faults import FAULTS_ENV, fault
from speech_assets_tests.conftest import REPO, SAMPLE_CORPUS
from speech_assets_tests.support.local_runs import materialize_in_process
from speech_assets_tests.support.mlflow_server import MlflowServer

log = logging.getLogger(__name__)
SECRET = "s3cr3t-pa55"
TRAINING = {
    "preset": "tiny",
    "max_steps": 4,
    "checkpoint_every": 4,
    "log_every": 2,
    "nproc": 2,
    "threads": 1,
    "max_restarts": 0,
    "batch_seconds": 16.0,
    "target_batch_seconds": 32.0,
    "precision": "fp32",
}


def _job(defs: dg.Definitions, asset: str = "pretrained_checkpoint"):
    return defs.resolve_implicit_global_asset_job_def().get_subset(asset_selection={dg.AssetKey(asset)})


def test_distillation_and_finetuning_launch_on_this_host_never_restarted() -> None:
    from speech_assets.defs.torchrun import ONE_NODE, fixed_node_count

    assert (fixed_node_count(ONE_NODE), ONE_NODE.max_restarts) == (1, 0)


@pytest.mark.parametrize(
    "override",
    [
        {"node_command": "touch {pwned}; true {{command}}"},
        {"node_hosts": ["x$(id)"]},
        {"noise_dir": "/"},
        {"rdzv_endpoint": "attacker.example:29400"},
        {"gpus_per_node": 2},  # not a command, but fixed with the definition: a run could not change it
    ],
)
def test_run_config_cannot_set_commands_hosts_endpoints_or_noise_folders(override: dict, tmp_path: Path) -> None:
    pwned = tmp_path / "pwned"
    override = {k: v.format(pwned=pwned) if isinstance(v, str) else v for k, v in override.items()}
    paths = StoragePaths(
        corpus=str(SAMPLE_CORPUS), data_dir=str(tmp_path / "out"), mlflow_tracking_uri=f"sqlite:///{tmp_path}/m.db"
    )
    defs = build_definitions(paths, PipelineSettings())
    with dg.DagsterInstance.ephemeral() as instance:
        with pytest.raises(dg.DagsterInvalidConfigError, match=f'unexpected config entry "{next(iter(override))}"'):
            _job(defs).execute_in_process(
                instance=instance, run_config={"ops": {"pretrained_checkpoint": {"config": override}}}
            )
        assert not instance.get_runs()  # refused before a run exists
    assert not pwned.exists()


@pytest.mark.parametrize(
    ("override", "error"),
    [({"noise": "/"}, "noise must be one of"), ({"noise": "folder"}, "needs noise_dir")],
)
def test_run_config_values_are_checked_like_the_settings(override: dict, error: str, tmp_path: Path) -> None:
    paths = StoragePaths(
        corpus=str(SAMPLE_CORPUS), data_dir=str(tmp_path / "out"), mlflow_tracking_uri=f"sqlite:///{tmp_path}/m.db"
    )
    defs = build_definitions(paths, PipelineSettings())
    with dg.DagsterInstance.ephemeral() as instance:
        result = _job(defs).execute_in_process(
            instance=instance, run_config={"ops": {"pretrained_checkpoint": {"config": override}}}, raise_on_error=False
        )
    assert not result.success
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    assert error in str(failure.step_failure_data.error)


def _listening(process: psutil.Process) -> set[str]:
    try:
        return {c.laddr.ip for c in process.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    except psutil.Error:
        return set()


def _torchrun_trees() -> list[psutil.Process]:
    """Every single-node torchrun agent here and its processes."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if "speech_assets.train.local_torchrun" in (process.info["cmdline"] or []):
            try:
                found += [process, *process.children(recursive=True)]
            except psutil.Error:
                pass
    return found


@pytest.fixture(scope="module")
def built_copy(sample_build: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample build's data stages, copied: training runs here leave the shared build alone."""
    out = tmp_path_factory.mktemp("training_launch") / "out"
    shutil.copytree(
        sample_build["out"],
        out,
        ignore=shutil.ignore_patterns("training*", "mlflow.db", "mlartifacts", "distill", "export", "probe"),
    )
    return out


@pytest.mark.slow  # a third torchrun job, with its own MLflow store
def test_a_failed_torchrun_fails_the_step_with_its_own_error(built_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = built_copy.parent / "exit.marker"
    monkeypatch.setenv(
        FAULTS_ENV, fault("train.step", "exit", rank=0, step=1, once=marker)
    )  # rank 0 exits with status 1 after step 1
    paths = StoragePaths(
        corpus=str(SAMPLE_CORPUS),
        data_dir=str(built_copy),
        mlflow_tracking_uri=f"sqlite:///{built_copy.parent}/failed.db",
    )
    config = {**TRAINING, "nproc": 1, "seed": 11}
    with dg.DagsterInstance.ephemeral() as instance:
        result = _job(build_definitions(paths, PipelineSettings.load(REPO / "pipeline.toml"))).execute_in_process(
            instance=instance, run_config={"ops": {"pretrained_checkpoint": {"config": config}}}, raise_on_error=False
        )
    assert not result.success and marker.is_file()
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    error = failure.step_failure_data.error
    assert "training failed: DagsterPipesExecutionError: External execution process failed with code" in error.message
    assert "AttributeError" not in error.to_string() and "out of memory" not in error.message


@pytest.fixture(scope="module")
def oom_run(built_copy: Path):
    """pretrained_checkpoint on a copy of the sample build, tracked on a real MLflow server through
    a URI with credentials, rank 1 out of memory at step 2 of the first attempt; the listening
    sockets of the torchrun process tree are sampled while it runs."""
    root, out = built_copy.parent, built_copy
    marker = root / "oom.marker"
    seen: list[tuple[int, set[str]]] = []  # (processes in the torchrun tree, their listening addresses)
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            tree = _torchrun_trees()
            if tree:
                seen.append((len(tree), set().union(*(_listening(p) for p in tree))))

    with MlflowServer(
        root / "mlflow.log", backend_store_uri=f"sqlite:///{root}/mlflow.db", artifacts_destination=root / "artifacts"
    ) as server:
        log.warning("mlflow server started in %.1f s", server.start_seconds)
        began = time.monotonic()
        uri = server.url.replace("http://", f"http://speech:{SECRET}@")
        paths = StoragePaths(corpus=str(SAMPLE_CORPUS), data_dir=str(out), mlflow_tracking_uri=uri)
        defs = build_definitions(paths, PipelineSettings.load(REPO / "pipeline.toml"))
        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            with pytest.MonkeyPatch.context() as patch, dg.DagsterInstance.ephemeral() as instance:
                patch.setenv(FAULTS_ENV, fault("train.step", "raise", rank=1, step=2, once=marker))
                result = materialize_in_process(
                    defs,
                    instance,
                    "pretrained_checkpoint",
                    run_config={"ops": {"pretrained_checkpoint": {"config": TRAINING}}},
                )
                logs = [entry.user_message for entry in instance.all_logs(result.run_id)]
            log.warning("pretrained_checkpoint with one out-of-memory retry took %.1f s", time.monotonic() - began)
        finally:
            done.set()
            sampler.join()
        (event,) = result.asset_materializations_for_node("pretrained_checkpoint")
        yield {"event": event, "logs": logs, "marker": marker, "seen": seen, "server": server, "out": out}


def test_out_of_memory_is_retried_with_half_the_batch(oom_run) -> None:
    meta = {key: value.value for key, value in oom_run["event"].metadata.items()}
    assert oom_run["marker"].read_text().startswith("fault injection: raise at train.step rank=1 step=2")
    assert meta["oom_retries"] == 1
    assert any("CUDA out of memory: retrying with batch 8.0 s and grad_accum 2" in line for line in oom_run["logs"])
    config = json.loads((Path(meta["run_dir"]) / "config.json").read_text())
    assert (config["batch_seconds"], config["grad_accum"]) == (8.0, 2)
    # the step's plan, handed to the workers of the retry with its batch: they made none of their own
    plan = json.loads(RunFiles(Path(meta["run_dir"])).plan.read_text())
    assert (plan["batch_seconds"], plan["grad_accum"]) == (8.0, 2)
    assert "after CUDA out of memory: batch 8 s per device, grad_accum 2" in plan["reason"]
    assert json.loads(RunFiles(Path(meta["run_dir"])).result.read_text())["autoconfig"]["reason"] == plan["reason"]
    assert torch.load(meta["checkpoint"], map_location="cpu", weights_only=True)["step"] == 4


def test_torchrun_listens_on_loopback_only(oom_run) -> None:
    during_training = [addresses for size, addresses in oom_run["seen"] if size >= 3 and addresses]
    assert during_training, "never saw the agent and both workers listening"
    assert set().union(*during_training) == {"127.0.0.1"}


def test_tracking_credentials_are_stored_nowhere(oom_run, capsys: pytest.CaptureFixture[str]) -> None:
    from mlflow.tracking import MlflowClient

    from speech_assets.cli import main

    meta = {key: value.value for key, value in oom_run["event"].metadata.items()}
    server = oom_run["server"]
    assert meta["mlflow_run_url"].startswith(f"{server.url}/#/experiments/")  # tracked, on the server
    client = MlflowClient(server.url)
    run = client.get_run(meta["mlflow_run_id"])
    assert run.data.params["mlflow_tracking_uri"] == server.url
    stored = [
        json.dumps(run.data.params),
        json.dumps(run.data.tags),
        json.dumps({key: str(value) for key, value in meta.items()}),
        *oom_run["logs"],
    ]
    stored.append(
        Path(client.download_artifacts(run.info.run_id, "config.json", str(oom_run["out"] / "download"))).read_text()
    )
    assert main(["lineage", meta["checkpoint"], "--json"]) == 0
    stored.append(capsys.readouterr().out)
    assert all(SECRET not in text for text in stored)
    for path in Path(meta["run_dir"]).rglob("*"):  # configs, checkpoints (their configs), logs, results
        assert not path.is_file() or SECRET.encode() not in path.read_bytes(), path
