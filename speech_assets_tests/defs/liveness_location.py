"""A small code location for the run-liveness tests: the shape of the demo's last run (a training
step in the ``training`` pool, then other steps that take time, then another training step), run
by the project's reaping executor and launcher against a real instance and daemon. Each step
appends ``{"step", "event", "t"}`` lines to ``$LIVENESS_EVENTS``; ``$LIVENESS_SLOW_S`` sets how
long the middle step works. :class:`RecordingLauncher` is the project's launcher, writing down each
health check the daemon's run monitoring makes and its verdict (step ``health``)."""

import contextlib
import json
import os
import time

import dagster as dg

from speech_assets.defs.runs import LocalProcessRunLauncher, reaping_multiprocess_executor, record_run_process
from speech_assets.runtime.waiting import WaitTimeout, wait_until


def _event(step: str, event: str, **more: str) -> None:
    with open(os.environ["LIVENESS_EVENTS"], "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"step": step, "event": event, "t": time.time(), "pid": os.getpid(), **more}) + "\n")


class RecordingLauncher(LocalProcessRunLauncher):
    def check_run_worker_health(self, run: dg.DagsterRun):
        result = super().check_run_worker_health(run)
        _event("health", result.status.value, run_id=run.run_id)
        return result


def _work(step: str, seconds: float) -> None:
    _event(step, "start")
    time.sleep(seconds)
    _event(step, "end")


@dg.asset(pool="training")
def short_training(context: dg.AssetExecutionContext) -> None:
    record_run_process(context)
    _work("short_training", 6.0)


@dg.asset(deps=[short_training])
def slow_evaluation(context: dg.AssetExecutionContext) -> None:
    # the daemon starts beside the run: its slow part begins once run monitoring is up
    with contextlib.suppress(WaitTimeout):
        wait_until(
            lambda: "MONITORING" in context.instance.get_daemon_heartbeats(), 180, "run monitoring", interval=0.5
        )
    _work("slow_evaluation", float(os.environ.get("LIVENESS_SLOW_S", "8")))


@dg.asset(deps=[slow_evaluation], pool="training")
def second_training(context: dg.AssetExecutionContext) -> None:
    record_run_process(context)
    _work("second_training", 1.0)


@dg.asset(pool="training")
def other_training(context: dg.AssetExecutionContext) -> None:
    record_run_process(context)
    _work("other_training", 2.0)


@dg.asset(pool="training")
def endless_training(context: dg.AssetExecutionContext) -> None:
    record_run_process(context)
    _work("endless_training", 3600.0)


# forkserver without the product's preloads: these steps need neither torch nor the pipeline
defs = dg.Definitions(
    assets=[short_training, slow_evaluation, second_training, other_training, endless_training],
    executor=reaping_multiprocess_executor.configured({"start_method": {"forkserver": {}}}),
)
