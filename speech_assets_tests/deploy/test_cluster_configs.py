"""The cluster examples, validated by Dagster's own code without a cluster: every dagster.yaml in
deploy/ against the instance schema and its run launcher's `config_type()`; the Kubernetes and
Celery-on-Kubernetes instances built for real (Postgres storage on the test server, the launcher
given a kubeconfig that names no reachable cluster); the step pod that `k8s_job_executor` would
create for the training step rendered by dagster-k8s from the launcher, executor and op-tag
config; the Celery worker config through dagster-celery's own loader; the Helm values against
the instance they stand for."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from speech_assets.defs.cluster import CELERY_QUEUE_TAG, GPU_RESOURCE, K8S_CONFIG_TAG, training_op_tags
from speech_assets.defs.resources import TrainingSettings
from speech_assets_tests.conftest import REPO
from speech_assets_tests.support.postgres import PostgresServer

DEPLOY = REPO / "deploy"
INSTANCE_YAMLS = {
    "postgres": (DEPLOY / "postgres" / "dagster.yaml", "speech_assets.defs.runs.LocalProcessRunLauncher"),
    "k8s": (DEPLOY / "k8s" / "dagster.yaml", "dagster_k8s.K8sRunLauncher"),
    "celery-k8s": (DEPLOY / "celery-k8s" / "dagster.yaml", "dagster_celery_k8s.CeleryK8sRunLauncher"),
}
KUBECONFIG = """\
apiVersion: v1
kind: Config
clusters: [{name: nowhere, cluster: {server: "https://127.0.0.1:9"}}]
users: [{name: nobody, user: {token: not-a-cluster}}]
contexts: [{name: nowhere, context: {cluster: nowhere, user: nobody, namespace: speech-assets}}]
current-context: nowhere
"""
CELERY_ENV = {"DAGSTER_CELERY_BROKER_URL": "pyamqp://dagster@127.0.0.1:5672//", "DAGSTER_CELERY_BACKEND_URL": "rpc://"}


def _launcher_class(dotted: str) -> type:
    module, name = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


@pytest.fixture()
def pg_env(postgres: PostgresServer, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The DAGSTER_PG_* variables the yamls read, naming a fresh database on the test server."""
    database = f"instance_{uuid.uuid4().hex[:12]}"
    postgres.create_database(database)
    env = {**postgres.env(), "DAGSTER_PG_DB": database, **CELERY_ENV}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def _offline_copy(source: Path, folder: Path) -> Path:
    """``source`` with its run launcher told to read a kubeconfig instead of the in-cluster one."""
    kubeconfig = folder / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG)
    config = yaml.safe_load(source.read_text())
    config["run_launcher"]["config"] |= {"load_incluster_config": False, "kubeconfig_file": str(kubeconfig)}
    (folder / "dagster.yaml").write_text(yaml.safe_dump(config))
    return folder


@pytest.mark.parametrize("name", sorted(INSTANCE_YAMLS))
def test_instance_yaml_passes_dagster_validation(name: str, pg_env: dict[str, str], tmp_path: Path) -> None:
    from dagster._config import process_config
    from dagster._core.instance.config import dagster_instance_config

    source, launcher = INSTANCE_YAMLS[name]
    config, _ = dagster_instance_config(str(source.parent))
    assert config["storage"]["postgres"]["postgres_db"]["scheme"] == "postgresql+psycopg2"
    assert f"{config['run_launcher']['module']}.{config['run_launcher']['class']}".endswith(launcher.rsplit(".", 1)[1])
    launcher_cls = _launcher_class(launcher)
    launcher_config = config["run_launcher"].get("config") or {}
    result = process_config(launcher_cls.config_type(), launcher_config)
    assert result.success, result.errors
    # and the validation can fail: a misspelt key is refused
    if launcher_config:
        broken = copy.deepcopy(launcher_config) | {"volume_mount": []}
        assert not process_config(launcher_cls.config_type(), broken).success


def _render_step_pod(instance: Any, step_tags: dict[str, str]) -> dict[str, Any]:
    """The Job that ``k8s_job_executor`` creates for a step with ``step_tags``: the same merge as
    ``K8sStepHandler._get_container_context`` (run launcher, executor config, op tags)."""
    import kubernetes
    from dagster_k8s.container_context import K8sContainerContext
    from dagster_k8s.job import UserDefinedDagsterK8sConfig, construct_dagster_k8s_job, get_user_defined_k8s_config

    from speech_assets.deploy.k8s import STEP_EXECUTOR_CONFIG, defs

    job = defs.resolve_implicit_global_asset_job_def()
    run = instance.create_run_for_job(job_def=job)
    launcher = instance.run_launcher
    context = K8sContainerContext.create_for_run(run, launcher, include_run_tags=False)
    context = context.merge(
        K8sContainerContext(
            run_k8s_config=UserDefinedDagsterK8sConfig.from_dict(STEP_EXECUTOR_CONFIG["step_k8s_config"])
        )
    )
    context = context.merge(K8sContainerContext(run_k8s_config=get_user_defined_k8s_config(step_tags)))
    k8s_job = construct_dagster_k8s_job(
        job_config=context.get_k8s_job_config("registry.example.com/speech-assets:test", launcher),
        args=["dagster", "api", "execute_step"],
        job_name="dagster-step-test",
        pod_name="dagster-step-test",
        component="step_worker",
        user_defined_k8s_config=context.run_k8s_config,
        labels={"dagster/run-id": run.run_id},
    )
    body = kubernetes.client.ApiClient().sanitize_for_serialization(k8s_job)
    body["namespace"] = context.namespace
    return body


def _load_code_location(module: str, settings: Path) -> dict[str, Any]:
    """Import ``module`` in a fresh interpreter with ``settings`` as $SPEECH_ASSETS_SETTINGS (op
    tags are read when the code location loads) and report its executor and step tags."""
    script = (
        "import json, dagster as dg, importlib\n"
        f"defs = importlib.import_module({module!r}).defs\n"
        "dg.Definitions.validate_loadable(defs)\n"
        "job = defs.resolve_implicit_global_asset_job_def()\n"
        "print(json.dumps({'executor': job.executor_def.name, 'tags': {n.name: dict(n.tags) for n in "
        "job.graph.nodes}}))\n"
    )
    env = {**os.environ, "SPEECH_ASSETS_SETTINGS": str(settings), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_k8s_instance_and_executor_render_the_training_pod_with_its_gpus(
    pg_env: dict[str, str], tmp_path: Path
) -> None:
    import dagster as dg
    from dagster_k8s import K8sRunLauncher

    settings = tmp_path / "settings.toml"
    settings.write_text("[training]\ngpus_per_node = 2\n")
    location = _load_code_location("speech_assets.deploy.k8s", settings)
    assert location["executor"] == "speech_assets_k8s_job_executor"
    training_tags = location["tags"]["pretrained_checkpoint"]
    assert (
        json.loads(training_tags[K8S_CONFIG_TAG]) == training_op_tags(TrainingSettings(gpus_per_node=2))[K8S_CONFIG_TAG]
    )
    assert K8S_CONFIG_TAG not in location["tags"]["vad_features"]

    with dg.DagsterInstance.from_config(str(_offline_copy(INSTANCE_YAMLS["k8s"][0], tmp_path))) as instance:
        assert isinstance(instance.run_launcher, K8sRunLauncher)
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        training = _render_step_pod(instance, training_tags)
        features = _render_step_pod(instance, location["tags"]["vad_features"])
    spec = training["spec"]["template"]["spec"]
    container = spec["containers"][0]
    assert container["resources"]["limits"][GPU_RESOURCE] == "2"  # from [training] gpus_per_node
    assert container["resources"]["requests"]["cpu"] == "4"  # from the executor's step_k8s_config
    assert {"name": "data", "mountPath": "/data"} in container["volumeMounts"]  # from the run launcher
    assert {"name": "data", "persistentVolumeClaim": {"claimName": "speech-assets-data"}} in spec["volumes"]
    assert {"configMapRef": {"name": "speech-assets-env"}} in container["envFrom"]
    assert spec["serviceAccountName"] == "speech-assets" and training["namespace"] == "speech-assets"
    assert GPU_RESOURCE not in features["spec"]["template"]["spec"]["containers"][0]["resources"].get("limits", {})


def test_executor_configs_pass_dagster_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    from dagster._config import process_config
    from dagster_celery import celery_executor
    from dagster_k8s import k8s_job_executor

    from speech_assets.deploy.celery_workers import CELERY_EXECUTOR_CONFIG
    from speech_assets.deploy.k8s import STEP_EXECUTOR_CONFIG

    for name, value in CELERY_ENV.items():
        monkeypatch.setenv(name, value)
    for executor, config in ((k8s_job_executor, STEP_EXECUTOR_CONFIG), (celery_executor, CELERY_EXECUTOR_CONFIG)):
        result = process_config(executor.config_schema.config_type, config)
        assert result.success, result.errors
    assert not process_config(
        k8s_job_executor.config_schema.config_type, {**STEP_EXECUTOR_CONFIG, "max_concurrent": "many"}
    ).success


def test_celery_worker_yaml_and_code_location(pg_env: dict[str, str], tmp_path: Path) -> None:
    import dagster as dg
    from dagster_celery.cli import get_validated_config
    from dagster_celery_k8s import CeleryK8sRunLauncher

    from speech_assets.deploy.celery_workers import CELERY_EXECUTOR_CONFIG, defs

    worker = get_validated_config(str(DEPLOY / "celery" / "celery.yaml"))  # dagster-celery's own loader
    assert worker["broker"] == CELERY_ENV["DAGSTER_CELERY_BROKER_URL"]
    assert (
        yaml.safe_load((DEPLOY / "celery" / "celery.yaml").read_text())["execution"]["config"] == CELERY_EXECUTOR_CONFIG
    )
    dg.Definitions.validate_loadable(defs)
    assert defs.resolve_implicit_global_asset_job_def().executor_def.name == "speech_assets_celery_executor"
    assert training_op_tags(TrainingSettings(gpus_per_node=1))[CELERY_QUEUE_TAG] == "gpu"
    assert training_op_tags(TrainingSettings()) == {}

    with dg.DagsterInstance.from_config(str(_offline_copy(INSTANCE_YAMLS["celery-k8s"][0], tmp_path))) as instance:
        assert isinstance(instance.run_launcher, CeleryK8sRunLauncher)


def test_pipes_k8s_alternative_builds_a_gpu_pod_for_torchrun() -> None:
    from dagster_k8s import PipesK8sClient
    from dagster_k8s.pipes import build_pod_body

    from speech_assets.deploy.k8s import training_pod_spec

    PipesK8sClient(load_incluster_config=True)  # reads no config until it runs
    command = [
        "python",
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "4",
        "-m",
        "speech_assets.train",
        "--config",
        "/data/out/training/x/config.json",
    ]
    pod = build_pod_body(
        pod_name="dagster-speech-assets-train",
        image="registry.example.com/speech-assets:test",
        command=command,
        env_vars={"DAGSTER_PIPES_CONTEXT": "e30="},
        base_pod_meta=None,
        base_pod_spec=training_pod_spec(TrainingSettings(gpus_per_node=4), "registry.example.com/speech-assets:test"),
    )
    container = pod.spec.containers[0]
    assert container.command == command and container.resources.limits == {GPU_RESOURCE: "4"}
    assert {v.name for v in pod.spec.volumes} == {"data", "dshm"} and pod.spec.restart_policy == "Never"


def _snake(value: Any) -> Any:
    """camelCase keys (Helm, Kubernetes) as snake_case (Dagster config)."""
    if isinstance(value, dict):
        return {"".join("_" + c.lower() if c.isupper() else c for c in k): _snake(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_snake(v) for v in value]
    return value


def test_helm_values_stand_for_the_k8s_instance_and_code_location() -> None:
    values = yaml.safe_load((DEPLOY / "helm" / "values.yaml").read_text())
    instance = yaml.safe_load((DEPLOY / "k8s" / "dagster.yaml").read_text())
    launcher = instance["run_launcher"]["config"]
    (deployment,) = values["dagster-user-deployments"]["deployments"]
    flag, module = deployment["dagsterApiGrpcArgs"]
    assert flag == "-m" and importlib.util.find_spec(module) is not None and module == "speech_assets.deploy.k8s"
    helm_launcher = values["runLauncher"]["config"]["k8sRunLauncher"]
    assert values["runLauncher"]["type"] == instance["run_launcher"]["class"] == "K8sRunLauncher"
    assert [m["name"] for m in helm_launcher["envConfigMaps"]] == launcher["env_config_maps"]
    assert _snake(helm_launcher["volumes"]) == launcher["volumes"]
    assert _snake(helm_launcher["volumeMounts"]) == launcher["volume_mounts"]
    assert _snake(helm_launcher["runK8sConfig"]) == launcher["run_k8s_config"]
    assert _snake(deployment["volumes"]) == launcher["volumes"]
    assert values["global"]["postgresqlSecretName"] == launcher["postgres_password_secret"]
    assert values["global"]["serviceAccountName"] == launcher["service_account_name"]
    assert values["postgresql"]["postgresqlScheme"] == instance["storage"]["postgres"]["postgres_db"]["scheme"]
    monitoring = values["dagsterDaemon"]["runMonitoring"]
    assert _snake(monitoring) == instance["run_monitoring"]
