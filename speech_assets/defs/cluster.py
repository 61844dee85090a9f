"""Scheduling hints for cluster executors (Kubernetes pod executors read ``dagster-k8s/config``,
Celery ones ``dagster-celery/queue``, local ones neither), from ``[training] gpus_per_node``.

Dagster fixes op tags when an asset is defined, so they come from the settings as the code location
loads; one run asks for other GPUs through the Kubernetes executor's ``per_step_k8s_config``.
"""

from __future__ import annotations

from typing import Any

from speech_assets.defs.resources import TrainingSettings

K8S_CONFIG_TAG = "dagster-k8s/config"
CELERY_QUEUE_TAG = "dagster-celery/queue"
GPU_RESOURCE = "nvidia.com/gpu"


def training_op_tags(training: TrainingSettings) -> dict[str, Any]:
    """The training asset's op tags: a GPU limit of ``gpus_per_node`` and the ``gpu`` queue (none for 0)."""
    if training.gpus_per_node <= 0:
        return {}
    limits = {GPU_RESOURCE: str(training.gpus_per_node)}
    return {
        K8S_CONFIG_TAG: {"container_config": {"resources": {"limits": limits}}},
        CELERY_QUEUE_TAG: "gpu",
    }
