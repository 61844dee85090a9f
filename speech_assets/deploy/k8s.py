"""The code location on Kubernetes: every step runs in its own pod (``k8s_job_executor``), loaded
with ``dagster api grpc -m speech_assets.deploy.k8s`` (`deploy/helm/values.yaml`). Step pods
inherit the run launcher's image, environment and volumes, so every pod sees the same data dir
(a ReadWriteMany volume), Postgres and MLflow. The alternative for training, one torchrun pod
through Dagster Pipes, is :func:`training_pod_spec` (docs/OPERATIONS.md, "Kubernetes").
"""

from __future__ import annotations

from typing import Any

from dagster_k8s import k8s_job_executor

from speech_assets.definitions import build_definitions
from speech_assets.defs import training
from speech_assets.defs.cluster import GPU_RESOURCE
from speech_assets.defs.resources import TrainingSettings

# Run config of the executor, merged over the run launcher's config for every step pod.
STEP_EXECUTOR_CONFIG: dict[str, Any] = {
    # step pods of one run at a time; the shards of a run are one step (parallel over its cores)
    "max_concurrent": 4,
    "step_k8s_config": {
        "container_config": {"resources": {"requests": {"cpu": "4", "memory": "8Gi"}, "limits": {"memory": "16Gi"}}},
    },
}

k8s_executor = k8s_job_executor.configured(STEP_EXECUTOR_CONFIG, name="speech_assets_k8s_job_executor")

defs = build_definitions(settings=training.SETTINGS, executor=k8s_executor)


def training_pod_spec(training: TrainingSettings, image: str, data_claim: str = "speech-assets-data") -> dict[str, Any]:
    """``base_pod_spec`` of ``PipesK8sClient().run(...)`` for the torchrun job in a pod of its own:
    ``gpus_per_node`` GPUs, the shared data volume at ``/data``, the team's environment."""
    resources: dict[str, Any] = {"requests": {"cpu": "4", "memory": "16Gi"}}
    if training.gpus_per_node > 0:
        resources["limits"] = {GPU_RESOURCE: str(training.gpus_per_node)}
    return {
        "containers": [
            {
                "image": image,
                "resources": resources,
                "env_from": [
                    {"config_map_ref": {"name": "speech-assets-env"}},
                    {"secret_ref": {"name": "speech-assets-secrets"}},
                ],
                "volume_mounts": [{"name": "data", "mount_path": "/data"}, {"name": "dshm", "mount_path": "/dev/shm"}],
            }
        ],
        "volumes": [
            {"name": "data", "persistent_volume_claim": {"claim_name": data_claim}},
            # NCCL and DataLoader workers need more shared memory than a pod's default 64 MiB
            {"name": "dshm", "empty_dir": {"medium": "Memory"}},
        ],
        "restart_policy": "Never",
    }
