"""Multi-node training launched by the asset: two torchrun "nodes" on loopback (static
rendezvous, rank 0 on node 0: the Dagster host), the same checkpoint as one node with two
processes, and a killed node ends in a clean failure, not a hang."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import dagster as dg
import pytest
import torch

from speech_assets.definitions import build_definitions
from speech_assets.defs.resources import KMeansSettings, PipelineSettings, StoragePaths, TrainingSettings
from speech_assets.runtime.waiting import wait_until
from speech_assets_tests.conftest import SAMPLE_CORPUS, fresh_instance
from speech_assets_tests.runtime.test_lifetime import processes_mentioning
from speech_assets_tests.support.local_runs import materialize_in_process
from speech_assets_tests.support.ports import free_port

pytestmark = pytest.mark.slow  # four torchrun jobs, two of them with two agents


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("multinode")
    paths = StoragePaths(
        corpus=str(SAMPLE_CORPUS), data_dir=str(root / "out"), mlflow_tracking_uri=f"sqlite:///{root}/m.db"
    )
    with fresh_instance(root) as instance:
        defs = build_definitions(paths, PipelineSettings(kmeans=KMeansSettings(k=8)))
        materialize_in_process(defs, instance, "manifest")
        materialize_in_process(defs, instance, "vad_features", list(instance.get_dynamic_partitions("speakers")))
        materialize_in_process(defs, instance, "cmvn_stats")
        materialize_in_process(defs, instance, "client_partitions")
        materialize_in_process(defs, instance, "kmeans_targets", list(instance.get_dynamic_partitions("clients")))
        yield paths, instance


def train(paths: StoragePaths, instance: dg.DagsterInstance, **training: object) -> dict:
    base = {
        "preset": "tiny",
        "max_steps": 12,
        "checkpoint_every": 6,
        "log_every": 3,
        "threads": 1,
        "max_restarts": 0,
        "batch_seconds": 8.0,
        "target_batch_seconds": 16.0,
        "precision": "fp32",
    }
    settings = PipelineSettings(kmeans=KMeansSettings(k=8), training=TrainingSettings(**{**base, **training}))
    result = materialize_in_process(build_definitions(paths, settings), instance, "pretrained_checkpoint")
    (event,) = result.asset_materializations_for_node("pretrained_checkpoint")
    return {key: value.value for key, value in event.metadata.items()}


def test_two_loopback_nodes_train_exactly_like_one_node_with_two_processes(inputs) -> None:
    paths, instance = inputs
    one_node = train(paths, instance, nnodes="1", nproc=2)
    two_nodes = train(
        paths, instance, nnodes="2", nproc=1, rdzv_endpoint=f"127.0.0.1:{free_port()}", node_command="{command}"
    )
    assert one_node["run_dir"] != two_nodes["run_dir"]  # two runs, not one resumed
    state = lambda meta: torch.load(meta["checkpoint"], map_location="cpu", weights_only=True)  # noqa: E731
    assert state(two_nodes)["step"] == 12
    assert two_nodes["checkpoint_sha256"] == one_node["checkpoint_sha256"]
    assert "rank0" in (Path(two_nodes["run_dir"]) / "train.log").read_text()  # rank 0 ran here, on node 0
    assert (Path(two_nodes["run_dir"]) / "node1.log").is_file()


def test_killing_a_node_ends_in_a_clean_failure(inputs) -> None:
    paths, instance = inputs
    endpoint = f"127.0.0.1:{free_port()}"
    killed: list[int] = []
    earlier_runs = set(paths.layout.training_dir.iterdir()) if paths.layout.training_dir.is_dir() else set()

    def kill_node_one() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not killed:
            for pid in processes_mentioning("--node-rank 1"):
                if "torch.distributed.run" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                    this_run = [
                        p
                        for p in paths.layout.training_dir.glob("*/checkpoints/step_*.pt")
                        if p.parents[1] not in earlier_runs
                    ]
                    if this_run:  # training is under way (checkpoints of the earlier tests' runs do not count)
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
            time.sleep(0.5)

    killer = threading.Thread(target=kill_node_one)
    killer.start()
    with pytest.raises(Exception):
        train(
            paths,
            instance,
            nnodes="2",
            nproc=1,
            rdzv_endpoint=endpoint,
            node_command="{command}",
            max_steps=100000,
            checkpoint_every=2,
            seed=7,
        )
    killer.join()
    assert killed, "node 1 never started training"
    wait_until(
        lambda: not processes_mentioning(endpoint.split(":")[1]), 30, "every node's processes to exit", interval=0.5
    )
