"""Differential privacy, attacked as a curious server or a reader of the run's params would: the
noise cannot be predicted from the seed, the mean is over the clients sampled, a released round is
durable before it leaves and never drawn again, an update beyond the clipping norm is refused,
and a client's training metrics stay on the client unless the run shares them. The real
ServerApp loop (:class:`Server`) with the real ClientApp in process, on four small clients."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from speech_assets.federated.config import DP_NORM_TOLERANCE, FederatedConfig
from speech_assets.federated.server_app import Server
from speech_assets.layout import FederatedPaths
from speech_assets.train.checkpoint import load_checkpoint
from speech_assets_tests.conftest import REPO
from speech_assets_tests.support.federated_data import InProcessGrid, serverapp_identity, write_federated_corpus

FOUR = {"c0": 6, "c1": 6, "c2": 6, "c3": 6}
CLIP = 0.05


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory):
    return write_federated_corpus(tmp_path_factory.mktemp("dp") / "data", FOUR, speakers_per_client=2)


def _config(corpus, root: Path, name: str, **settings) -> FederatedConfig:
    return corpus.config(root, name, **settings)


def _grid(corpus, config: FederatedConfig, root: Path, kind: type[InProcessGrid] = InProcessGrid) -> InProcessGrid:
    return kind({n: c for n, c in enumerate(config.clients, start=1)}, corpus.data_dir, root / "state")


def _run(corpus, root: Path, name: str, kind: type[InProcessGrid] = InProcessGrid, **settings):
    config = _config(corpus, root, name, **settings)
    grid = _grid(corpus, config, root, kind)
    with serverapp_identity():
        result = Server(grid, config).run()  # type: ignore[arg-type]
    return result, grid, config


def _final(config: FederatedConfig) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in load_checkpoint(FederatedPaths(config.run_dir).final)["encoder"].items()}


def _record(config: FederatedConfig, round_number: int = 1) -> dict:
    return json.loads(FederatedPaths(config.run_dir).round_record(round_number).read_text())


def _train_replies(grid: InProcessGrid) -> dict[str, dict[str, np.ndarray]]:
    """Each client's (one round's) train reply as the server received it: its encoder."""
    replies = [m for m in grid.received if m.metadata.message_type == "train" and not m.has_error()]
    return {m.content["client"]["client-id"]: {k: a.numpy() for k, a in m.content["arrays"].items()} for m in replies}


def _flat(arrays: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(arrays[k], dtype=np.float64).ravel() for k in sorted(arrays)])


def test_dp_runs_with_one_seed_draw_unpredictable_noise(corpus, tmp_path: Path) -> None:
    """The run's seed is a logged param and seeds numpy's global generator: noise drawn from it
    would be known to whoever read it. Two DP runs with the same seed differ by noise of the
    configured size; two plain runs stay bit-identical."""
    dp = dict(dp_noise_multiplier=0.8, dp_clipping_norm=CLIP)
    _, _, first = _run(corpus, tmp_path, "dp-a", **dp)
    _, _, second = _run(corpus, tmp_path, "dp-b", **dp)
    a, b = _flat(_final(first)), _flat(_final(second))
    assert not np.array_equal(a, b), "two DP runs with one seed released the same encoder: the noise is predictable"
    # the same clipped updates (the clients' training is seeded), independent noise: a - b ~ N(0, 2 sigma^2)
    sigma = 0.8 * CLIP / len(first.clients)
    assert np.std(a - b) == pytest.approx(np.sqrt(2) * sigma, rel=0.02)
    assert abs(np.mean(a - b)) < 5 * np.sqrt(2) * sigma / np.sqrt(a.size)

    _, _, plain_a = _run(corpus, tmp_path, "plain-a")
    _, _, plain_b = _run(corpus, tmp_path, "plain-b")
    assert np.array_equal(_flat(_final(plain_a)), _flat(_final(plain_b)))

    # the mechanism itself: numpy's global generator neither feeds it nor moves
    from speech_assets.federated.privacy import Privacy

    privacy, zeros = Privacy(first), {"w": np.zeros((64, 1000))}
    draws = []
    for _ in range(2):
        np.random.seed(first.seed)
        before = np.random.get_state()[1].copy()
        draws.append(privacy.noisy_mean(zeros, 4)["w"])
        assert np.array_equal(np.random.get_state()[1], before)
    assert not np.array_equal(*draws)
    assert privacy.spent()["releases"] == 2


def test_secure_gaussian_is_the_normal_distribution() -> None:
    """The Box-Muller draws from os.urandom: mean, spread, tails and shape of N(0, std^2)."""
    from scipy import stats

    from speech_assets.federated.privacy import secure_gaussian

    draws = secure_gaussian(200_001, 0.25)
    assert draws.shape == (200_001,) and np.isfinite(draws).all()
    assert stats.kstest(draws / 0.25, "norm").pvalue > 1e-4
    assert np.std(draws) == pytest.approx(0.25, rel=0.01) and abs(np.mean(draws)) < 0.25 * 5 / np.sqrt(draws.size)
    assert np.mean(np.abs(draws) > 3 * 0.25) == pytest.approx(2 * stats.norm.sf(3), rel=0.15)


def test_the_dp_mean_divides_by_the_clients_sampled(corpus, tmp_path: Path, monkeypatch) -> None:
    """A sampled client that does not reply counts as a zero update: with c2 failing, the released
    mean is the three others' sum over four (over three, one client's weight would depend on
    who else replied, and the noise would be calibrated to the wrong sensitivity)."""
    from speech_assets.federated.local import initial_encoder
    from speech_assets.runtime.faults import FAULTS_ENV

    monkeypatch.setenv(FAULTS_ENV, "federated.round client=c2 round=1 raise")
    _, grid, config = _run(
        corpus, tmp_path, "missing", dp_noise_multiplier=0.01, dp_clipping_norm=CLIP, min_train_nodes=3
    )
    record = _record(config)
    assert record["missing"] == ["c2"] and record["sampled"] == config.clients
    start = _flat({k: v.numpy() for k, v in initial_encoder(config.preset, config.seed).items()})
    updates = {c: _flat(arrays) - start for c, arrays in _train_replies(grid).items()}
    assert sorted(updates) == ["c0", "c1", "c3"]
    assert all(np.linalg.norm(u) <= CLIP * (1 + DP_NORM_TOLERANCE) for u in updates.values())
    direction = sum(updates.values()) / 4
    released = _flat(_final(config)) - start
    # the release along the expected mean: 1 when divided by the 4 sampled, 4/3 when by the 3 that replied
    along = float(released @ direction) / float(direction @ direction)
    assert along == pytest.approx(1.0, abs=0.05), f"the mean was divided by {4 / along:.2f} clients, not the 4 sampled"
    assert record["privacy"]["releases"] == 1


class UnclippedGrid(InProcessGrid):
    """c1 does not clip: its update reaches the server at three times the clipping norm."""

    def push_messages(self, messages):
        messages = list(messages)
        ids = super().push_messages(messages)
        for message, answer in zip(messages, self.outbox[-len(messages) :], strict=True):
            if message.metadata.message_type == "train" and self.nodes[message.metadata.dst_node_id] == "c1":
                sent, trained = message.content["arrays"], answer.content["arrays"]
                for name in sent:
                    base = sent[name].numpy()
                    trained[name] = type(trained[name])(
                        (base + 3.0 * (trained[name].numpy() - base)).astype(np.float32)
                    )
        return ids


def test_under_dp_the_server_refuses_an_update_beyond_the_clipping_norm(corpus, tmp_path: Path) -> None:
    _, _, config = _run(
        corpus, tmp_path, "unclipped", UnclippedGrid, dp_noise_multiplier=0.8, dp_clipping_norm=CLIP, min_train_nodes=3
    )
    record = _record(config)
    assert record["missing"] == ["c1"], "an update at 3 x the clipping norm went into a DP release"
    refused = [f for f in record["failures"] if f["client_id"] == "c1"]
    assert len(refused) == 1 and "dp_clipping_norm" in refused[0]["reason"], refused
    assert record["update_norm_bound"] == pytest.approx(CLIP * (1 + DP_NORM_TOLERANCE))
    # under DP no client's exact norm is recorded, nor named in c1's refusal (issue 45)
    assert all(row["update_norm"] is None for row in record["rows"])
    assert "update norm is beyond" in refused[0]["reason"], refused


@pytest.mark.parametrize(
    "scale, accepted", [(1.0, True), (1 + DP_NORM_TOLERANCE / 2, True), (1 + 2 * DP_NORM_TOLERANCE, False)]
)
def test_the_dp_bound_tolerates_rounding_and_the_sum_clips_exactly(scale: float, accepted: bool) -> None:
    """An update over the clipping norm by float rounding passes, and counts exactly at the
    clipping norm in the sum; one over the tolerance is refused."""
    from flwr.app import Array, ArrayRecord, Message, MessageType, RecordDict

    from speech_assets.federated.config import update_norm_bound
    from speech_assets.federated.messages import update_problem
    from speech_assets.federated.server_app import clipped_sum

    config = FederatedConfig(
        run_dir="unused", run_name="unused", clients=["a"], dp_noise_multiplier=1.0, dp_clipping_norm=CLIP
    )
    rng = np.random.default_rng(0)
    encoder = {"w": rng.normal(size=(50, 40)).astype(np.float32)}
    direction = rng.normal(size=(50, 40))
    trained = {"w": (encoder["w"] + direction / np.linalg.norm(direction) * CLIP * scale).astype(np.float32)}
    norm, problem = update_problem(trained, encoder, update_norm_bound(config, 2000), "dp_clipping_norm")
    assert (problem is None) is accepted, (norm, problem)
    with serverapp_identity():
        reply = Message(
            RecordDict({"arrays": ArrayRecord({"w": Array(trained["w"])})}),
            dst_node_id=1,
            message_type=MessageType.TRAIN,
        )
    total = clipped_sum([reply], {"w": encoder["w"].astype(np.float64)}, CLIP)
    assert np.linalg.norm(total["w"]) == pytest.approx(min(CLIP, norm), rel=1e-9)  # type: ignore[type-var]


@pytest.mark.parametrize("share", [False, True])
def test_under_dp_clients_send_training_metrics_only_if_the_run_shares_them(
    corpus, tmp_path: Path, share: bool
) -> None:
    shared = {"dp_share_client_metrics": True} if share else {}  # withheld is the default
    result, grid, config = _run(
        corpus, tmp_path, f"metrics-{share}", dp_noise_multiplier=0.8, dp_clipping_norm=CLIP, **shared
    )
    from speech_assets.federated.messages import SERVER_WEIGHT

    # what each client sent (the server adds its own weight to a reply once it has it)
    sent = [
        {k: v for k, v in m.content["metrics"].items() if k != SERVER_WEIGHT}
        for m in grid.received
        if m.metadata.message_type == "train"
    ]
    assert len(sent) == 4
    rows = pq.read_table(FederatedPaths(config.run_dir).rounds_table).to_pylist()
    assert set(rows[0]) >= {
        "round",
        "client_id",
        "num_examples",
        "train_loss",
        "masked_accuracy",
        "bytes_up",
        "bytes_down",
        "seconds",
    }
    assert all(row["bytes_up"] > 0 and row["bytes_down"] > 0 for row in rows)  # what the server itself measures
    if share:
        assert all(m["train-loss"] > 0 and m["num-examples"] > 0 for m in sent)
        assert all(row["train_loss"] is not None and row["num_examples"] > 0 for row in rows)
    else:
        assert sent == [{}] * 4, "a client's training loss, accuracy or seconds left it under DP"
        for column in ("num_examples", "train_loss", "masked_accuracy", "seconds"):
            assert [row[column] for row in rows] == [None] * 4, column
        record = _record(config)
        assert record["aggregated_train"] == {} and all(row["audio_seconds"] is None for row in record["rows"])
        assert result["final_train_loss"] is None and result["mean_overhead"] is None
        # the summaries, the asset's round table and the plot say "not measured" rather than fail
        from speech_assets.defs.federated import ROUND_COLUMNS, round_rows
        from speech_assets.defs.readable import table
        from speech_assets.federated.history import summarize_rounds
        from speech_assets.stats.plots import round_curve

        lines = summarize_rounds([record])
        shown = table(round_rows(lines, {}), ROUND_COLUMNS).records
        assert all(row.data["train_loss"] is None for row in shown) and round_curve(lines)
    # held-out evaluation: the federation's result either way, each client's only when shared
    # (docs/PRIVACY.md)
    evaluation = pq.read_table(FederatedPaths(config.run_dir).evaluation_table).to_pylist()
    assert len(evaluation) == 4 and result["heldout_masked_accuracy"] is not None
    assert all((row["heldout_masked_accuracy"] is not None) == share for row in evaluation)


# the ServerApp in a process of its own, with the real ClientApp in process; it logs every train
# round it sends and every encoder it sends for evaluation, and holds (once) at the first evaluation
RELEASE_SCRIPT = """
import json, os, sys, time
from pathlib import Path
from speech_assets.federated.config import FederatedConfig
from speech_assets.federated.rounds import encoder_sha256
from speech_assets.federated.server_app import Server
from speech_assets_tests.support.federated_data import InProcessGrid, serverapp_identity

config = FederatedConfig(**json.loads(Path(sys.argv[1]).read_text()))
data_dir, log, hold = Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])

def note(entry):
    with open(log, "a") as handle:
        handle.write(json.dumps(entry) + "\\n")
        handle.flush()
        os.fsync(handle.fileno())

class Grid(InProcessGrid):
    def push_messages(self, messages):
        messages = list(messages)
        kinds = {m.metadata.message_type for m in messages}
        if "train" in kinds:
            note({"train": int(messages[0].content["config"]["server-round"])})
        if "evaluate" in kinds:
            arrays = messages[0].content["arrays"]
            note({"evaluate": int(messages[0].content["config"]["server-round"]),
                  "sha256": encoder_sha256({k: a.numpy() for k, a in arrays.items()})})
            if not hold.exists():
                hold.write_text(str(os.getpid()))
                time.sleep(3600)
        return super().push_messages(messages)

grid = Grid({n: c for n, c in enumerate(config.clients, start=1)}, data_dir, data_dir.parent / "state")
with serverapp_identity():
    Server(grid, config).run()
"""


def test_a_dp_released_round_is_durable_first_and_never_drawn_again(corpus, tmp_path: Path) -> None:
    """SIGKILL the server while round 1's noisy encoder is out for evaluation; the resumed run
    goes on from round 1 as released (no second draw, the accountant counting it once) and
    finishes its evaluation."""
    from speech_assets.runtime.waiting import wait_until

    config = _config(
        corpus, tmp_path, "released", rounds=2, evaluate_every=1, dp_noise_multiplier=0.8, dp_clipping_norm=CLIP
    )
    settings, log, hold = tmp_path / "config.json", tmp_path / "sent.jsonl", tmp_path / "held"
    settings.write_text(json.dumps(config.to_dict()))
    script = tmp_path / "server.py"
    script.write_text(RELEASE_SCRIPT)
    env = os.environ | {"PYTHONPATH": str(REPO)}
    command = [sys.executable, str(script), str(settings), str(corpus.data_dir), str(log), str(hold)]
    first = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_until(
            lambda: hold.exists() or first.poll() is not None, 300, "the server to release round 1", interval=0.2
        )
        assert hold.exists(), first.stderr.read().decode()[-3000:] if first.stderr else ""
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    finally:
        if first.poll() is None:
            first.kill()
    released = [json.loads(line) for line in log.read_text().splitlines()]
    assert released[-1]["evaluate"] == 1
    resumed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    sent = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["train"] for e in sent if "train" in e] == [1, 2], "round 1 was trained and drawn again after the kill"
    records = [_record(config, r) for r in (1, 2)]
    assert records[0]["weights_sha256"] == released[-1]["sha256"]
    assert [r["privacy"]["releases"] for r in records] == [1, 2]
    # the evaluation the kill interrupted is done by the resumed run, of the encoder released
    assert {e["sha256"] for e in sent if e.get("evaluate") == 1} == {records[0]["weights_sha256"]}
    assert len(records[0]["evaluation"]) == 4 and not records[0]["evaluation_pending"]
    assert len(pq.read_table(FederatedPaths(config.run_dir).evaluation_table)) == 8


NOISE_SCRIPT = """
import pickle, sys
import numpy as np
from speech_assets.federated.privacy import Privacy
config = pickle.loads(open(sys.argv[1], "rb").read())
np.random.seed(config.seed)  # as a run seeds numpy's global generator from its logged seed
np.save(sys.argv[2], Privacy(config).noisy_mean({"w": np.zeros(256)}, 4)["w"])
"""


def test_dp_runs_with_the_same_config_and_run_name_draw_different_noise(corpus, tmp_path: Path) -> None:
    """Kills the mutation "DP noise from a generator keyed by the logged run name" (every privacy
    test passed it: the runs they compare had different names) and "... seeded once per process":
    two real DP runs with the same settings, seed and run name release different encoders, by
    noise of the configured size; and two fresh processes drawing with the same config (and
    numpy's global generator seeded from the run's seed, as a run does) draw different noise."""
    dp = dict(dp_noise_multiplier=0.8, dp_clipping_norm=CLIP)
    _, _, first = _run(corpus, tmp_path / "a", "dp-same", **dp)
    _, _, second = _run(corpus, tmp_path / "b", "dp-same", **dp)
    assert first.settings() == second.settings() and first.run_name == second.run_name
    a, b = _flat(_final(first)), _flat(_final(second))
    assert not np.array_equal(a, b), "two DP runs with one name and config released the same encoder"
    sigma = 0.8 * CLIP / len(first.clients)
    assert np.std(a - b) == pytest.approx(np.sqrt(2) * sigma, rel=0.02)

    from speech_assets.federated.privacy import Privacy

    zeros = {"w": np.zeros(256)}
    in_process = [Privacy(config).noisy_mean(zeros, 4)["w"] for config in (first, second)]
    assert not np.array_equal(*in_process)
    config_file = tmp_path / "config.pickle"
    config_file.write_bytes(pickle.dumps(first))
    draws = []
    for i in range(2):
        out = tmp_path / f"noise-{i}.npy"
        subprocess.run(
            [sys.executable, "-c", NOISE_SCRIPT, str(config_file), str(out)],
            env=os.environ | {"PYTHONPATH": str(REPO), "PYTHONHASHSEED": "0"},
            cwd=REPO,
            check=True,
            timeout=120,
        )
        draws.append(np.load(out))
    assert not np.array_equal(*draws), "two processes with one config drew the same DP noise"
    assert not any(np.array_equal(draw, mine) for draw in draws for mine in in_process)
