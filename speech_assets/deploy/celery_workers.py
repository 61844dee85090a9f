"""The code location with Celery: steps are queued on a broker and run by ``dagster-celery``
workers on any machine that has this package, the shared data dir and the Postgres instance.

    dagster-celery worker start -A dagster_celery.app -y deploy/celery/celery.yaml          # CPU machines
    dagster-celery worker start -A dagster_celery.app -y deploy/celery/celery.yaml -q gpu   # the GPU machine

Runs are launched as usual (UI, daemon, ``dagster asset materialize -m speech_assets.deploy.celery_workers``);
the run process only submits steps. The training step goes to the ``gpu`` queue (its
``dagster-celery/queue`` tag), every other step to the default ``dagster`` queue.
"""

from __future__ import annotations

from dagster_celery import celery_executor

from speech_assets.definitions import build_definitions
from speech_assets.defs import training

# Same keys as deploy/celery/celery.yaml (the workers' side); values from the environment.
CELERY_EXECUTOR_CONFIG = {
    "broker": {"env": "DAGSTER_CELERY_BROKER_URL"},
    "backend": {"env": "DAGSTER_CELERY_BACKEND_URL"},
    "config_source": {"worker_prefetch_multiplier": 1, "task_acks_late": True},
}

celery = celery_executor.configured(CELERY_EXECUTOR_CONFIG, name="speech_assets_celery_executor")

defs = build_definitions(settings=training.SETTINGS, executor=celery)
