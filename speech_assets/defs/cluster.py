"""Scheduling hints for cluster executors, built from the pipeline settings.

Executors that run each step in its own Kubernetes pod (``k8s_job_executor``,
``celery_k8s_job_executor``) read the ``dagster-k8s/config`` op tag of a step; Celery executors
read ``dagster-celery/queue``; local executors ignore both. With ``[training] gpus_per_node > 0``
the training step asks for that many GPUs (its pod lands on a GPU node, and torchrun with
``nproc = 0`` starts one process per visible GPU) and goes to the Celery ``gpu`` queue.

Dagster fixes an asset's op tags when it is defined, so these come from the settings as the code
location loads them, and run config cannot name ``gpus_per_node``. One run asks for other GPUs
through the Kubernetes executor's own run config, which overrides the tag for that run:
``execution: config: per_step_k8s_config: pretrained_checkpoint: container_config: resources: ...``.
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
