"""Federated pretraining with real Flower processes on loopback (a SuperLink, one SuperNode per
client, `flwr run`), a real Dagster instance, a real MLflow store and the sample corpus.

- a Dagster run of federated_checkpoint (executed in this process against the sample build's
  instance; 2 rounds, 4 SuperNodes); its outputs are checked (rounds.parquet, weights_only
  checkpoint, data version, MLflow, no process left), and so is the privacy boundary: nothing but
  the encoder reaches or is stored by the server. The demo build runs the same asset through
  `dagster asset materialize` (defs/test_end_to_end.py).
- slow: a run killed (SIGKILL) after round 1 and restarted ends with exactly the weights of the
  uninterrupted Dagster run.
- slow: a SuperNode SIGKILLed mid-round does not sink the round; a round with too few clients
  stops the run with a clear message after saving the completed rounds.
- slow: only SuperNodes whose key the launcher registered join the local SuperLink.
- slow: a Dagster run with secure aggregation, on each engine: every round unmasks the sum of all
  the clients' masked updates, the server receives only masked values, every advertisement is
  signed and verified (no client refuses), every client's round state ends answered.
- slow: another local user can neither reach the local federation's SuperLink (Control API: start
  a run, register a node) or SuperNodes, nor enter its network namespace; the same requests from
  inside it work.
- slow: another local user reaches none of the ports of a simulation's Ray cluster, nor Ray's
  folder of unix sockets; from inside the run's network namespace each port answers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from speech_assets.federated.history import ROUNDS_SCHEMA
from speech_assets.model.encoders import weights_sha256
from speech_assets.runtime.faults import FAULTS_ENV, fault
from speech_assets.runtime.waiting import wait_until
from speech_assets_tests.conftest import DEMO_FEDERATED, REPO, SAMPLE_CORPUS
from speech_assets_tests.federated.conftest import SamplePipeline, wait_until_gone

BIN = Path(sys.executable).parent
FAST = DEMO_FEDERATED
ROUNDS = FAST["rounds"]
ALLOWED_TRAIN_METRICS = {"num-examples", "train-loss", "masked-accuracy", "seconds", "audio-seconds", "steps"}
ALLOWED_EVAL_METRICS = {
    "num-examples",
    "utterances",
    "heldout-loss",
    "heldout-masked-accuracy",
    "majority-accuracy",
    "leak-free-frames",
    "heldout-leak-free-masked-accuracy",
    "leak-free-majority-accuracy",
}


@pytest.fixture(scope="module")
def dagster_run(sample_build: dict, sample_pipeline: SamplePipeline) -> dict:
    """One Dagster run of federated_checkpoint (2 rounds, 4 SuperNodes) on the sample build's
    instance: its run folder (named by its materialization, whatever other run folders the shared
    sample build holds), its result and its Dagster run id."""
    import dagster as dg

    from speech_assets_tests.support.local_runs import materialize_in_process

    with dg.DagsterInstance.from_config(str(sample_pipeline.home)) as instance:
        run_config = {"ops": {"federated_checkpoint": {"config": FAST}}}
        done = materialize_in_process(sample_build["defs"], instance, "federated_checkpoint", run_config=run_config)
    (event,) = done.asset_materializations_for_node("federated_checkpoint")
    run_dir = Path(event.metadata["run_dir"].value)
    return {"run_dir": run_dir, "result": json.loads((run_dir / "result.json").read_text()), "run_id": done.run_id}


def _materialization(instance, run_id: str):  # type: ignore[no-untyped-def]
    """federated_checkpoint's materialization record of the Dagster run ``run_id`` (other tests
    of the shared sample build materialize it too, in any order)."""
    import dagster as dg

    records = instance.fetch_materializations(dg.AssetKey("federated_checkpoint"), limit=100).records
    return next(record for record in records if record.run_id == run_id)


def _cli(
    sample_pipeline: SamplePipeline, run_dir: Path, like: Path, extra_env: dict | None = None, **overrides
) -> subprocess.Popen:
    """`python -m speech_assets.federated` with exactly the run config of the run folder ``like``."""
    values = tomllib.loads((like / "run_config.toml").read_text())
    values.update({k.replace("_", "-"): v for k, v in overrides.items()})
    args = []
    for key, value in values.items():
        # the CLI reads the weights and the held-out split from the clients table itself
        if key not in ("run-dir", "run-name", "data-versions", "client-weights", "heldout-speakers", "train-speakers"):
            args += [f"--{key}", str(value)]
    command = [
        sys.executable,
        "-m",
        "speech_assets.federated",
        "--data-dir",
        str(sample_pipeline.out),
        "--run-dir",
        str(run_dir),
        *args,
    ]
    log = open(run_dir.parent / f"{run_dir.name}.log", "ab")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(
        command, env=sample_pipeline.env() | (extra_env or {}), cwd=REPO, stdout=log, stderr=subprocess.STDOUT
    )


def _wait_for(path: Path, process: subprocess.Popen, timeout: float = 600) -> None:
    def appeared() -> bool:
        assert process.poll() is None, f"the run exited ({process.returncode}) before {path} appeared"
        return path.exists()

    wait_until(appeared, timeout, f"{path} to appear", interval=0.5)


def test_materialize_runs_two_rounds_on_four_supernodes(
    dagster_run: dict, sample_pipeline: SamplePipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dagster as dg
    import mlflow

    run_dir, result = dagster_run["run_dir"], dagster_run["result"]
    # rounds.parquet: one row per (round, client), exactly the documented columns
    table = pq.read_table(run_dir / "rounds.parquet")
    assert table.column_names == ROUNDS_SCHEMA.names
    rows = table.to_pylist()
    assert sorted((r["round"], r["client_id"]) for r in rows) == [
        (r, c) for r in (1, 2) for c in sample_pipeline.clients
    ]
    assert all(r["num_examples"] > 0 and r["bytes_up"] > 0 and r["bytes_up"] == r["bytes_down"] for r in rows)
    # the held-out evaluation of every round's global encoder, beside each client's majority-class rate
    # evaluated every evaluate_every (5) rounds and after the last
    evaluation = pq.read_table(run_dir / "evaluation.parquet").to_pylist()
    assert sorted((e["round"], e["client_id"]) for e in evaluation) == [(ROUNDS, c) for c in sample_pipeline.clients]
    # the held-out speakers are chosen once over the corpus (clients.parquet): a client holding
    # none scores no frames
    assignment = pq.read_table(sample_pipeline.out / "clients" / "clients.parquet").to_pylist()
    holding = {row["client_id"] for row in assignment if row["heldout"]}
    assert holding and all((e["masked_frames"] > 0) == (e["client_id"] in holding) for e in evaluation)
    assert all(0 <= e["leak_free_frames"] <= e["masked_frames"] for e in evaluation)
    # ... and has null accuracies, never 0.0 over no frames
    assert set(sample_pipeline.clients) - holding
    assert all((e["majority_accuracy"] is None) == (e["client_id"] not in holding) for e in evaluation)
    assert all(0 <= e["majority_accuracy"] <= 1 for e in evaluation if e["client_id"] in holding)
    # leak-free accuracies: None for a client without leak-free frames, else a fraction
    assert all((e["heldout_leak_free_masked_accuracy"] is None) == (e["leak_free_frames"] == 0) for e in evaluation)
    assert (
        result["heldout_leak_free_frames"] == sum(e["leak_free_frames"] for e in evaluation if e["round"] == ROUNDS) > 0
    )
    assert (
        0 <= result["heldout_leak_free_masked_accuracy"] <= 1
        and 0 <= result["heldout_leak_free_majority_accuracy"] <= 1
    )
    # the final checkpoint: weights_only, encoder only, its hash is the data version
    state = torch.load(run_dir / "final.pt", map_location="cpu", weights_only=True)
    assert state["round"] == ROUNDS and weights_sha256(state["encoder"]) == result["checkpoint_sha256"]
    monkeypatch.setenv("DAGSTER_HOME", str(sample_pipeline.home))
    with dg.DagsterInstance.get() as instance:
        record = _materialization(instance, dagster_run["run_id"])
        event = record.asset_materialization
        assert event.tags["dagster/data_version"] == result["checkpoint_sha256"]
        assert event.tags["dagster/code_version"] == "federated-v5"
        inputs = event.metadata["input_versions"].value
        manifest = instance.fetch_materializations(dg.AssetKey("manifest"), limit=1).records[0].asset_materialization
        assert inputs["manifest"] == manifest.tags["dagster/data_version"]
        assert any(k.startswith("kmeans_targets/") for k in inputs) and any(
            k.startswith("vad_features/") for k in inputs
        )
        # per-round and per-client results as tables with a schema; rounded values with units
        per_round = event.metadata["per_round"]
        assert isinstance(per_round, dg.TableMetadataValue) and "round_s" in [c.name for c in per_round.schema.columns]
        rows = [r.data for r in per_round.records]
        assert [r["round"] for r in rows] == [1, 2] and rows[-1]["sampled"] == ", ".join(sample_pipeline.clients)
        per_client = {r.data["client"]: r.data for r in event.metadata["heldout_per_client"].records}
        assert set(per_client) == set(sample_pipeline.clients)
        # a client without held-out speakers: null, never 0.0
        assert all((per_client[c]["masked_accuracy"] is None) == (c not in holding) for c in per_client)
        assert event.metadata["privacy"].value == {"differential_privacy": False}
        assert 0 <= event.metadata["mean_round_overhead"].value < 1
        assert list(event.metadata)[0] == "curve"  # on top of the asset's page
        # the held-out masked accuracy is the leak-free one (speech_assets.train.accuracy)
        assert event.metadata["heldout_masked_accuracy"].value == pytest.approx(
            result["heldout_leak_free_masked_accuracy"], abs=5e-4
        )
        assert event.metadata["mb_up_per_round"].value == pytest.approx(result["bytes_up_per_round"] / 1e6, abs=0.01)
        assert len(event.metadata["curve"].value) < 1000 and "data:image/svg+xml" in event.metadata["curve"].value
        # the MLflow run, a click away; and the Dagster run, from MLflow
        url = event.metadata["mlflow_run_url"]
        assert isinstance(url, dg.UrlMetadataValue) and url.value.startswith("http://127.0.0.1:5000/#/experiments/")
    # MLflow: every round's metrics and the final checkpoint
    mlflow.set_tracking_uri(sample_pipeline.mlflow_uri)
    run = mlflow.get_run((run_dir / "mlflow_run_id").read_text().strip())
    assert run.info.status == "FINISHED"
    assert url.value.endswith(f"/runs/{run.info.run_id}")
    assert run.data.tags["mode"] == "federated" and run.data.tags["dagster_run_id"] == record.run_id
    client = mlflow.tracking.MlflowClient(sample_pipeline.mlflow_uri)
    assert client.get_experiment(run.info.experiment_id).name == "speech_assets"  # with every other model
    assert not any(name.startswith("final.") for name in run.data.metrics)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val/all_frames_masked_accuracy")] == [ROUNDS]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")] == [1, 2]
    assert [a.path for a in client.list_artifacts(run.info.run_id, "checkpoint")] == ["checkpoint/final.pt"]
    # the default engine is Flower's simulation runtime: one supervised process tree, Ray's workers in it
    simulation_log = (run_dir / "flower" / "simulation.log").read_text()
    assert "server INFO done: 2 rounds" in simulation_log
    nodes = json.loads((run_dir / "flower" / "simulation_nodes.json").read_text())
    assert [n["client_id"] for n in nodes] == sample_pipeline.clients and all(n["threads"] == 1 for n in nodes)
    # every process the asset started (Ray's among them) is gone
    assert wait_until_gone(sample_pipeline.out) == []


def test_lineage_of_the_federated_checkpoint_names_its_round_commit_and_runs(
    dagster_run: dict, sample_pipeline: SamplePipeline, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import dagster as dg

    from speech_assets import cli
    from speech_assets.stats.lineage import checkpoint_lineage

    final = dagster_run["run_dir"] / "final.pt"
    from mlflow.tracking import MlflowClient

    mlflow_run = (dagster_run["run_dir"] / "mlflow_run_id").read_text().strip()
    commit = MlflowClient(tracking_uri=sample_pipeline.mlflow_uri).get_run(mlflow_run).data.tags["git_sha"]
    ancestor = subprocess.run(["git", "merge-base", "--is-ancestor", commit, "HEAD"], cwd=REPO, capture_output=True)
    assert ancestor.returncode == 0, f"{commit} is not a commit of this checkout's history"
    with dg.DagsterInstance.from_config(str(sample_pipeline.home)) as instance:
        record = _materialization(instance, dagster_run["run_id"])
    report = checkpoint_lineage(final)
    assert (report["kind"], report["step"], report["step_unit"]) == ("federated", ROUNDS, "round")
    # the commit and the MLflow and Dagster runs, as MLflow and Dagster recorded them
    assert (
        report["git_sha"] == commit
        and report["mlflow_run_id"] == mlflow_run
        and report["dagster_run_id"] == record.run_id
    )
    assert cli.main(["lineage", str(final)]) == 0
    printed = capsys.readouterr().out
    assert f"round             {ROUNDS}" in printed and "None" not in printed
    assert commit in printed and mlflow_run in printed and record.run_id in printed

    # the stats database lists it among the checkpoints, with the same facts
    import duckdb

    from speech_assets.defs.resources import StoragePaths
    from speech_assets.defs.stats import _inputs
    from speech_assets.stats.database import build_database

    paths = StoragePaths(
        corpus=str(SAMPLE_CORPUS), data_dir=str(sample_pipeline.out), mlflow_tracking_uri=sample_pipeline.mlflow_uri
    )
    db = tmp_path / "stats.duckdb"
    build_database(db, _inputs(paths))
    with duckdb.connect(str(db), read_only=True) as con:
        rows = con.execute(
            "SELECT step, step_unit, sha256, mlflow_run_id, git_commit, dagster_run_id FROM checkpoints "
            "WHERE kind = 'federated'"
        ).fetchall()
    assert (ROUNDS, "round", report["weights_sha256"], mlflow_run, commit, record.run_id) in rows


def test_only_the_encoder_reaches_the_server(dagster_run: dict, sample_pipeline: SamplePipeline) -> None:
    """Every record the server received, and everything it stored, is the encoder, metrics or
    the client's id; heads (K x D, one K per client), codebooks and statistics stay on the clients."""
    run_dir = dagster_run["run_dir"]
    encoder = torch.load(run_dir / "final.pt", map_location="cpu", weights_only=True)["encoder"]
    encoder_shapes = {name: list(t.shape) for name, t in encoder.items()}
    assert not any(name.startswith("heads.") for name in encoder)
    received = [json.loads(line) for line in (run_dir / "received.jsonl").read_text().splitlines()]
    # who each node is (the simulation runtime has no node registrations), then train and evaluate replies
    phases = [entry["phase"] for entry in received]
    assert phases.count("identify") == len(sample_pipeline.clients)
    assert (phases.count("train"), phases.count("evaluate")) == (
        ROUNDS * len(sample_pipeline.clients),
        len(sample_pipeline.clients),
    )
    for entry in received:
        if entry["phase"] == "identify":
            assert entry["records"] == {"client": {"type": "ConfigRecord", "keys": ["client-id"]}}
            continue
        records = entry["records"]
        if entry["phase"] == "train":
            assert set(records) == {"arrays", "metrics", "client"}
            assert {k: shape for k, (_dtype, shape) in records["arrays"]["keys"].items()} == encoder_shapes
            assert set(records["metrics"]["keys"]) == ALLOWED_TRAIN_METRICS
        else:
            assert set(records) == {"metrics", "client"}
            assert set(records["metrics"]["keys"]) == ALLOWED_EVAL_METRICS
        assert records["client"] == {"type": "ConfigRecord", "keys": ["client-id"]}
    # what the server stores: the encoder and FedAdam's moments of the encoder, nothing else
    for path in [run_dir / "final.pt", *sorted((run_dir / "rounds").glob("*.pt"))]:
        state = torch.load(path, map_location="cpu", weights_only=True)
        assert set(state["encoder"]) == set(encoder)
        for moments in state.get("strategy", {}).values():
            assert {k: list(v.shape) for k, v in moments.items()} == encoder_shapes
    heads = {}
    for client_id in sample_pipeline.clients:
        k = json.loads((sample_pipeline.out / "kmeans" / client_id / "quality.json").read_text())["k"]
        # each client's state lives under the root its SuperNode owns, not in the server's run folder
        state = sample_pipeline.out / "federated_clients" / client_id / run_dir.name
        head = torch.load(state / "heads" / f"round_{ROUNDS:05d}.pt", weights_only=True)
        assert list(head["head"]["weight"].shape) == [k, 128]
        heads[client_id] = head["head"]["weight"]
    assert not (run_dir / "clients").exists()
    server_files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert not any("head" in p.name or "codebook" in p.name or "cmvn" in p.name for p in server_files)
    # no head's values hide in what the server stored under another name
    stored = torch.cat([t.flatten() for t in encoder.values()])
    for weight in heads.values():
        assert not torch.isin(weight.flatten()[:64], stored).all()


def test_the_asset_refuses_to_resume_a_run_folder_with_other_settings(
    dagster_run: dict, sample_build: dict, sample_pipeline: SamplePipeline
) -> None:
    """The run folder remembers the settings it was started with (settings.json). A
    re-materialization whose settings differ from them is refused, naming the change, before
    any process starts; the finished result is not reused (before: it was, whatever the
    settings)."""
    import dagster as dg

    from speech_assets_tests.support.local_runs import materialize_in_process

    settings_file = dagster_run["run_dir"] / "settings.json"
    original = settings_file.read_text()
    assert json.loads(original)["eta"] == 0.1
    settings_file.write_text(json.dumps(json.loads(original) | {"eta": 0.5}))
    try:
        with dg.DagsterInstance.from_config(str(sample_pipeline.home)) as instance:
            run_config = {"ops": {"federated_checkpoint": {"config": FAST}}}
            with pytest.raises(dg.Failure, match=r"refused: .*started with other settings \(eta: 0\.5 -> 0\.1\)"):
                materialize_in_process(sample_build["defs"], instance, "federated_checkpoint", run_config=run_config)
    finally:
        settings_file.write_text(original)
    assert wait_until_gone(sample_pipeline.out) == []


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_same_weights(
    dagster_run: dict, sample_pipeline: SamplePipeline, tmp_path: Path
) -> None:
    """1 round, SIGKILL of the launcher, restart, 1 more round == 2 uninterrupted rounds, bit for bit."""
    run_dir = tmp_path / "resumed"
    run_dir.mkdir()
    first = _cli(sample_pipeline, run_dir, dagster_run["run_dir"])
    try:
        _wait_for(run_dir / "rounds" / "round_00001.json", first)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert wait_until_gone(run_dir) == []  # the kernel and the supervisors took the federation down
    assert not (run_dir / "final.pt").exists()
    second = _cli(sample_pipeline, run_dir, dagster_run["run_dir"])
    assert second.wait(timeout=900) == 0
    result = json.loads((run_dir / "result.json").read_text())
    assert result["resumed_from_round"] == 1
    assert result["checkpoint_sha256"] == dagster_run["result"]["checkpoint_sha256"]
    assert pq.read_table(run_dir / "rounds.parquet").num_rows == ROUNDS * len(sample_pipeline.clients)
    assert wait_until_gone(run_dir) == []


@pytest.mark.slow
def test_a_killed_supernode_is_tolerated_and_too_few_clients_stop_the_run(
    dagster_run: dict, sample_pipeline: SamplePipeline, tmp_path: Path
) -> None:
    """The deployment engine (a local SuperLink, one SuperNode per client, which authenticated:
    each registered key activated). 3 rounds, at least 3 clients per round. Round 2: client_03's SuperNode is SIGKILLed
    while it
    trains; the round completes with the other 3, logged with who was missing. Round 3: client_02's
    ClientApp crashes, 2 replies < 3: the run stops with a clear message, rounds 1-2 saved."""
    run_dir = tmp_path / "faults"
    run_dir.mkdir()
    markers = tmp_path / "markers"
    hold = fault("federated.round", "hold", client="client_03", round=2, marker=markers / "client_03-2.started")
    faults = f"{hold};{fault('federated.round', 'raise', client='client_02', round=3)}"
    run = _cli(
        sample_pipeline,
        run_dir,
        dagster_run["run_dir"],
        {FAULTS_ENV: faults},
        rounds=3,
        min_train_nodes=3,
        engine="deployment",
    )
    try:
        _wait_for(markers / "client_03-2.started", run)
        supernode = json.loads((run_dir / "flower" / "pids.json").read_text())["supernode client_03"]["pid"]
        os.kill(supernode, signal.SIGKILL)
        assert run.wait(timeout=900) == 2  # stopped by the server for lack of clients
    finally:
        if run.poll() is None:
            run.kill()
    round_2 = json.loads((run_dir / "rounds" / "round_00002.json").read_text())
    assert round_2["missing"] == ["client_03"]
    assert [f["client_id"] for f in round_2["failures"]] == ["client_03"]
    assert "Node Unavailable" in round_2["failures"][0]["reason"]
    assert [r["client_id"] for r in round_2["rows"]] == ["client_00", "client_01", "client_02"]
    failure = json.loads((run_dir / "failure.json").read_text())
    assert failure["round"] == 3 and failure["completed_rounds"] == 2
    assert failure["missing"] == ["client_02", "client_03"]
    assert "fewer than the 3 a round needs" in failure["message"]
    assert any(
        "fault injection: raise at federated.round client=client_02 round=3" in f["reason"] for f in failure["failures"]
    )
    rows = pq.read_table(run_dir / "rounds.parquet").to_pylist()
    assert sorted({r["round"] for r in rows}) == [1, 2] and len(rows) == 4 + 3
    superlink_log = (run_dir / "flower" / "superlink" / "superlink.log").read_text()
    assert superlink_log.count("[Fleet.ActivateNode] Activated node_id=") == len(sample_pipeline.clients)
    assert "SuperNode authentication is disabled" not in superlink_log
    assert not (run_dir / "flower" / "nodes.json").exists() and not list((run_dir / "flower" / "auth").glob("*.key"))
    assert (run_dir / "rounds" / "round_00002.pt").is_file() and not (run_dir / "final.pt").exists()
    assert wait_until_gone(run_dir) == []


@pytest.mark.slow
def test_only_registered_supernodes_join_the_local_federation(tmp_path: Path) -> None:
    """The local SuperLink serves TLS and authenticates SuperNodes (Flower's node authentication):
    the launcher's SuperNode, whose key it registered, joins; a SuperNode without a key, or with a
    key nobody registered, is refused even under a client id taking part. Its keys and node ids
    are deleted when the federation stops."""
    from speech_assets.federated.auth import make_node_key
    from speech_assets.federated.config import NodeConfig
    from speech_assets.federated.processes import SUPERLINK_ADDRESS, LocalFederation, flower_bin, flower_env, spawn
    from speech_assets.runtime.processes import terminate

    folder = tmp_path / "flower"
    node = NodeConfig("client_00", str(tmp_path / "data"))
    impostors = []
    try:
        with LocalFederation(folder, [node], log=lambda line: None) as federation:
            node_id = federation.node_ids["client_00"]
            assert json.loads((folder / "nodes.json").read_text()) == {str(node_id): "client_00"}
            command = [
                flower_bin("flower-supernode"),
                "--root-certificates",
                str(folder / "tls" / "ca.crt"),
                "--superlink",
                SUPERLINK_ADDRESS,
                "--host",
                "127.0.0.1",
            ]
            stranger = make_node_key(tmp_path / "stranger", "client_01").private("client_01")
            # inside the federation's network namespace: what only node authentication stops
            for port, (name, extra) in enumerate(
                (("nokey", []), ("stranger", ["--auth-supernode-private-key", str(stranger)])), 9200
            ):
                argv = federation.network.enter(
                    [*command, "--port", str(port), *extra, "--node-config", node.to_node_config()]
                )
                log = tmp_path / name / "supernode.log"
                impostors.append((spawn(argv, log, flower_env(tmp_path / name / "home"), supervised=True), log))
            for process, log in impostors:
                assert process.wait(timeout=300) != 0, log.read_text()
                assert "Failed to" in log.read_text()  # activate (unregistered key) / register (no key)
            own = federation.supernodes["client_00"]
            _wait_for_text(own.log, f"SuperNode ID: {node_id}", own.process)
            assert own.process.poll() is None
    finally:
        terminate([p for p, _ in impostors])
    assert not (folder / "nodes.json").exists() and not list((folder / "auth").glob("*.key"))
    assert wait_until_gone(tmp_path) == []


# what a local user tries against the federation, with nothing but the standard library: connect
# to each port, register a node key through the Control API (as `flwr supernode register` does),
# enter the federation's network namespace
INTRUDER = textwrap.dedent(
    """
    import json, socket, ssl, subprocess, sys, urllib.request
    spec = json.load(open(sys.argv[1]))
    found = {}
    for port in spec["ports"]:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            found[f"connect {port}"] = "connected"
        except OSError as error:
            found[f"connect {port}"] = type(error).__name__
    tls = ssl.create_default_context(cafile=spec["ca"])
    request = urllib.request.Request(spec["url"], data=bytes.fromhex(spec["body"]), headers=spec["headers"],
    method="POST")
    try:
        with urllib.request.urlopen(request, context=tls, timeout=30) as response:
            found["register-node"] = f"HTTP {response.status}"
    except Exception as error:
        found["register-node"] = repr(error)
    if spec["pid"]:
        done = subprocess.run(["nsenter", f"--target={spec['pid']}", "--net", "--", "true"], capture_output=True,
        text=True)
        found["nsenter"] = done.stderr.strip() or "entered"
    print(json.dumps(found))
    """
)


@pytest.mark.slow
def test_another_local_user_cannot_drive_the_local_federation(tmp_path: Path) -> None:
    """A second, unprivileged user of this machine tries what Flower's unauthenticated Control API
    would let it do on a loopback SuperLink (register its own node key, start runs) and to reach
    the SuperNodes; everything is refused, while the same requests from the owner's side (inside
    the federation's network namespace) work and the owner's SuperNode is registered and active."""
    from flwr.cli.supernode.register import try_load_public_key
    from flwr.proto.control_pb2 import RegisterNodeRequest  # pylint: disable=E0611
    from flwr.supercore.runtime_version_compatibility import RuntimeVersionMetadata

    from speech_assets.federated.auth import make_node_key
    from speech_assets.federated.config import NodeConfig
    from speech_assets.federated.processes import SUPERLINK_ADDRESS, LocalFederation
    from speech_assets_tests.support import other_user

    if why := other_user.why_not():
        pytest.skip(f"needs another local user: {why}")
    python = other_user.python_for(other_user.NOBODY)
    if python is None:
        pytest.skip("no Python interpreter the user nobody may run")
    node = NodeConfig("client_00", str(tmp_path / "data"))
    with (
        other_user.shared_folder() as shared,
        LocalFederation(tmp_path / "flower", [node], log=lambda line: None) as federation,
    ):
        own = federation.supernodes["client_00"]
        _wait_for_text(own.log, f"SuperNode ID: {federation.node_ids['client_00']}", own.process)
        key = make_node_key(shared, "intruder").public("intruder")
        headers = dict(RuntimeVersionMetadata.from_local_component("flwr-cli").as_metadata())
        spec = {
            "ports": [daemon.port for daemon in federation.daemons],
            "url": f"https://{SUPERLINK_ADDRESS}/v1/control/register-node",
            "ca": str(shared / "ca.crt"),  # a CA certificate is no secret
            "body": RegisterNodeRequest(public_key=try_load_public_key(key)).SerializeToString().hex(),
            "headers": headers | {"Content-Type": "application/protobuf"},
            "pid": federation.network.pid,
        }
        (shared / "ca.crt").write_bytes((tmp_path / "flower" / "tls" / "ca.crt").read_bytes())
        (shared / "spec.json").write_text(json.dumps(spec))
        (shared / "intruder.py").write_text(INTRUDER)
        for path in shared.iterdir():
            path.chmod(0o644)
        command = [*python[0], str(shared / "intruder.py"), str(shared / "spec.json")]
        intruder = subprocess.run(
            other_user.as_user(other_user.NOBODY, command),
            env=python[1],
            capture_output=True,
            text=True,
            timeout=120,
            cwd="/",
        )
        assert intruder.returncode == 0, intruder.stderr
        refused = json.loads(intruder.stdout)
        assert all(refused[f"connect {port}"] == "ConnectionRefusedError" for port in spec["ports"]), refused
        assert "Connection refused" in refused["register-node"], refused
        assert "Permission denied" in refused.get("nsenter", "Permission denied"), refused
        owner = subprocess.run(
            federation.network.enter([sys.executable, str(shared / "intruder.py"), str(shared / "spec.json")]),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert owner.returncode == 0, owner.stderr
        inside = json.loads(owner.stdout)
        assert inside["register-node"] == "HTTP 200" and all(
            inside[f"connect {p}"] == "connected" for p in spec["ports"]
        ), inside
        assert own.process.poll() is None
    assert wait_until_gone(tmp_path) == []


# what a local user tries against a simulation's Ray cluster with the standard library: connect
# to each port Ray listens on, look for them among the host's listening sockets, list and write
# Ray's folder of unix sockets
RAY_INTRUDER = textwrap.dedent(
    """
    import json, os, socket, sys
    spec = json.load(open(sys.argv[1]))
    found = {}
    for port in spec["ports"]:
        for host in ("127.0.0.1", "::1"):
            try:
                socket.create_connection((host, port), timeout=5).close()
                found[f"connect {host} {port}"] = "connected"
            except OSError as error:
                found[f"connect {host} {port}"] = type(error).__name__
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in list(open(table))[1:]:
            if row.split()[3] == "0A":
                listening.add(int(row.split()[1].rsplit(":", 1)[1], 16))
    found["listening on the host"] = sorted(listening & set(spec["ports"]))
    try:
        found["list sockets"] = sorted(os.listdir(spec["sockets"]))
    except OSError as error:
        found["list sockets"] = type(error).__name__
    try:
        with open(os.path.join(spec["sockets"], "intruder"), "w"):
            found["write sockets"] = "written"
        os.unlink(os.path.join(spec["sockets"], "intruder"))
    except OSError as error:
        found["write sockets"] = type(error).__name__
    print(json.dumps(found))
    """
)


def _listening_ports(pid: int) -> set[int]:
    """TCP ports process ``pid`` listens on, in whatever network namespace it lives (its own
    ``/proc/<pid>/net`` tables, matched to its sockets)."""
    sockets = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            sockets.add(link[len("socket:[") : -1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            columns = row.split()
            if columns[3] == "0A" and columns[9] in sockets:
                ports.add(int(columns[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.mark.slow
def test_another_local_user_cannot_reach_a_simulations_ray_cluster(
    sample_pipeline: SamplePipeline, tmp_path: Path
) -> None:
    """The simulation engine runs Ray, whose GCS, raylet and workers serve without authentication
    (a caller can run code as the pipeline's user). While a client holds in round 1, a second,
    unprivileged user connects to every port Ray's processes listen on: each is refused and none
    listens on the host; Ray's folder of unix sockets can be neither listed nor written; from
    inside the run's network namespace each port answers. SIGTERM stops the run, Ray included, and
    removes Ray's folder."""
    from speech_assets_tests.federated.conftest import flower_processes, is_ray
    from speech_assets_tests.support import other_user

    if why := other_user.why_not():
        pytest.skip(f"needs another local user: {why}")
    python = other_user.python_for(other_user.NOBODY)
    if python is None:
        pytest.skip("no Python interpreter the user nobody may run")
    run_dir, held = tmp_path / "simulation", tmp_path / "markers" / "held"
    command = [
        sys.executable,
        "-m",
        "speech_assets.federated",
        "--data-dir",
        str(sample_pipeline.out),
        "--run-dir",
        str(run_dir),
        "--rounds",
        "1",
        "--local-steps",
        "1",
        "--batch-seconds",
        str(FAST["batch_seconds"]),
    ]
    faults = {FAULTS_ENV: fault("federated.round", "hold", client=sample_pipeline.clients[0], round=1, marker=held)}
    with open(tmp_path / "run.log", "wb") as log:
        run = subprocess.Popen(
            command, env=sample_pipeline.env() | faults, cwd=REPO, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        _wait_for(held, run)
        processes = flower_processes(run_dir)
        ports = sorted(set().union(*(_listening_ports(pid) for pid, _ in processes)))
        raylet, argv = next(
            (pid, a.split()) for pid, a in processes if is_ray(a.split()) and a.split()[0].endswith("raylet/raylet")
        )
        socket_name = next(arg.split("=", 1)[1] for arg in argv if arg.startswith("--raylet_socket_name="))
        spec = {"ports": ports, "sockets": str(Path(socket_name).parent)}
        assert len(ports) >= 4, processes  # the GCS, the raylet's two, a worker's
        with other_user.shared_folder() as shared:
            (shared / "spec.json").write_text(json.dumps(spec))
            (shared / "intruder.py").write_text(RAY_INTRUDER)
            for path in shared.iterdir():
                path.chmod(0o644)
            attack = [str(shared / "intruder.py"), str(shared / "spec.json")]
            intruder = subprocess.run(
                other_user.as_user(other_user.NOBODY, [*python[0], *attack]),
                env=python[1],
                capture_output=True,
                text=True,
                timeout=120,
                cwd="/",
            )
            assert intruder.returncode == 0, intruder.stderr
            refused = json.loads(intruder.stdout)
            inside = subprocess.run(
                ["nsenter", f"--target={raylet}", "--net", "--", sys.executable, *attack],
                capture_output=True,
                text=True,
                timeout=120,
            )
        assert refused.pop("listening on the host") == [], refused
        assert refused.pop("list sockets") == refused.pop("write sockets") == "PermissionError", refused
        assert all(refused[f"connect 127.0.0.1 {port}"] == "ConnectionRefusedError" for port in ports), refused
        assert "connected" not in refused.values(), refused  # ::1 neither
        assert inside.returncode == 0, inside.stderr
        assert all(json.loads(inside.stdout)[f"connect 127.0.0.1 {port}"] == "connected" for port in ports), (
            inside.stdout
        )
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        if run.poll() is None:
            run.kill()
    assert wait_until_gone(run_dir) == []
    assert not Path(socket_name).parents[3].exists()  # <RAY_TMPDIR>/ray/<session>/sockets/raylet


def _wait_for_text(path: Path, text: str, process: subprocess.Popen, timeout: float = 300) -> None:
    def written() -> bool:
        assert process.poll() is None, f"{path} ended without {text!r}:\n{path.read_text()[-3000:]}"
        return text in (path.read_text(errors="replace") if path.exists() else "")

    wait_until(written, timeout, f"{text!r} in {path}", interval=0.5)


# what a client says when it refuses a secure round (secure_rounds, client_app): none may appear
SECURE_REFUSALS = (
    "not a signed advertisement",
    "not signed by",
    "not a node this federation authorises",
    "has no node-keys",
    "names a client twice",
    "is below its floor",
    "fewer than its secagg-min-shares",
    "requires secure aggregation",
    "refuses to send an unmasked update",
    "already answered",
)


@pytest.mark.slow
@pytest.mark.parametrize(("engine", "seed"), [("simulation", 101), ("deployment", 102)])
def test_secure_aggregation_end_to_end_on_both_engines(
    sample_build: dict, sample_pipeline: SamplePipeline, engine: str, seed: int
) -> None:
    """A Dagster run of federated_checkpoint with secure_aggregation = true, 2 rounds of 1 local
    step on the 4 sample clients, on each engine with the keys the launcher hands out (the local
    SuperLink's flower/auth/ on the deployment engine, key pairs made there by the simulation
    engine). Every round unmasks the sum of all 4 clients' masked updates (4 survivors, none
    dropped, no failure); every train reply the server received is the encoder as uint32 masked
    values, never a float update; every advertisement carries a signature, each peer's was
    verified (no client refused a round) and every client's round state ends "answered"; the
    private node keys are deleted and every process started is gone. (The engine is operational
    and would resume one run folder: a seed per engine gives each its own.)"""
    import dagster as dg

    from speech_assets.federated import secure_rounds as sr
    from speech_assets.layout import ClientRunFiles, FederatedPaths
    from speech_assets_tests.support.local_runs import materialize_in_process

    settings = FAST | {"rounds": 2, "local_steps": 1, "secure_aggregation": True, "engine": engine, "seed": seed}
    with dg.DagsterInstance.from_config(str(sample_pipeline.home)) as instance:
        run_config = {"ops": {"federated_checkpoint": {"config": settings}}}
        done = materialize_in_process(sample_build["defs"], instance, "federated_checkpoint", run_config=run_config)
    (event,) = done.asset_materializations_for_node("federated_checkpoint")
    assert event.metadata["secure_aggregation"].value is True
    paths = FederatedPaths(Path(event.metadata["run_dir"].value))
    run_name, clients = paths.root.name, sample_pipeline.clients
    result = json.loads(paths.result.read_text())
    assert result["secure_aggregation"] is True and result["rounds"] == 2
    assert not paths.failure.exists()
    encoder = torch.load(paths.root / "final.pt", map_location="cpu", weights_only=True)["encoder"]
    encoder_shapes = {name: list(t.shape) for name, t in encoder.items()}
    # every round: all 4 clients advertised, shared and masked; the server unmasked their sum
    for round_number in (1, 2):
        record = json.loads(paths.round_record(round_number).read_text())
        assert (record["missing"], record["failures"]) == ([], []), record
        assert sorted(record["sampled"]) == clients
        secure = record["secure_aggregation"]
        assert secure["peers"] == secure["shared"] == clients, secure
        assert (secure["survivors"], secure["dropped"]) == (len(clients), []), secure
        assert secure["num_shares"] == len(clients) and secure["threshold"] == 3  # floor(2k/3) + 1
    # what reached the server: masked values only, and a signed advertisement from every client
    received = [json.loads(line) for line in paths.received.read_text().splitlines()]
    assert [e for e in received if "error" in e] == []
    trains = [e for e in received if e["phase"] == "train"]
    assert sorted((e["round"], e["client_id"]) for e in trains) == [(r, c) for r in (1, 2) for c in clients]
    for entry in trains:
        arrays = entry["records"]["arrays"]["keys"]
        assert {k: shape for k, (_dtype, shape) in arrays.items()} == encoder_shapes
        assert {dtype for dtype, _shape in arrays.values()} == {"uint32"}, entry  # never a float update
    float_arrays = [
        (e["phase"], name, key)
        for e in received
        for name, rec in e["records"].items()
        if rec["type"] == "ArrayRecord"
        for key, (dtype, _shape) in rec["keys"].items()
        if dtype != "uint32"
    ]
    assert float_arrays == []  # no reply of any phase carried a float array
    adverts = [e for e in received if e["phase"] == sr.ADVERTISE]
    assert sorted((e["round"], e["client_id"]) for e in adverts) == [(r, c) for r in (1, 2) for c in clients]
    assert all(sr.SIGNATURE in e["records"][sr.KEY_RECORD]["keys"] for e in adverts), adverts
    for stage in (sr.SHARE, sr.UNMASK):  # each share and unmask answer: every peer's signature checked
        answered = sorted((e["round"], e["client_id"]) for e in received if e["phase"] == stage)
        assert answered == [(r, c) for r in (1, 2) for c in clients], stage
    # each client's own record: every round answered once, its secrets erased
    for client in clients:
        files = ClientRunFiles(sample_pipeline.out / "federated_clients" / client / run_name)
        for round_number in (1, 2):
            state = json.loads(files.secagg_round(round_number).read_text())
            assert state == {"stage": sr.ANSWERED}, (client, round_number, state)
    # no client refused anything, in any log of the run
    logs = [p for p in paths.flower_dir.rglob("*.log") if p.is_file()]
    if paths.server_log.is_file():
        logs.append(paths.server_log)
    assert logs
    for log in logs:
        text = log.read_text(errors="replace")
        assert not [r for r in SECURE_REFUSALS if r in text], (log, text[-3000:])
    if engine == "simulation":
        assert "server INFO done: 2 rounds" in paths.flower.simulation_log.read_text()
    else:
        superlink_log = paths.flower.superlink_log.read_text()
        assert superlink_log.count("[Fleet.ActivateNode] Activated node_id=") == len(clients)
        assert "SuperNode authentication is disabled" not in superlink_log
    # the identity keys the clients signed with: made in flower/auth/, the private ones deleted
    assert sorted(p.name for p in paths.flower.auth_dir.glob("*.pub")) == [f"{c}.pub" for c in clients]
    assert paths.flower.auth.all_private() == []
    assert wait_until_gone(sample_pipeline.out) == []
