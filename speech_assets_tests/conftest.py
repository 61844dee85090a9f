"""Shared fixtures: tiny corpora generated in tmp_path, the committed sample corpus, the sample's
data stages built once per session in this process (`sample_build`), and the demo build
(`scripts/materialize_all.sh` on the sample, once per session; the `slow` tests only)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

# Two xdist workers share two cores with the processes they start (torchrun ranks, run workers), so
# every core is nearly always taken. OpenMP's default wait policy spins a torch thread for a while
# before sleeping: on a taken core that spin is time the other worker's processes lose. Passive
# waiting took 6 % off the suite's CPU time (1,116 s -> 1,045 s, docs/BENCHMARKS.md). Set before
# anything loads OpenMP; the started processes inherit it. Training itself leaves it as it is.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

if TYPE_CHECKING:
    import dagster as dg

from speech_assets_tests.support.corpora import LibriCorpus, tone, write_flac  # noqa: F401 (re-exported for tests)

REPO = Path(__file__).resolve().parents[1]
SAMPLE_CORPUS = REPO / "data" / "sample"


# Seconds each module took (whole-suite profile, 2 workers on 2 idle cores, less the session fixtures
# it built): pytest-xdist's loadscope hands modules out in the order the workers collected them, so
# the heaviest go first (longest processing time first) and the two workers end together instead of
# one idling while the other finishes a heavy module handed out last. Modules not listed (each under
# 10 s) follow in their usual order; a stale figure only costs balance, never a test.
MODULE_SECONDS = {
    "defs/test_model_runs.py": 216,
    "defs/test_runs.py": 60,
    "defs/test_staleness.py": 47,
    "train/test_data_path.py": 44,
    "federated/test_privacy.py": 41,
    "deploy/test_postgres_instance.py": 39,
    "defs/test_training_launch.py": 38,
    "defs/test_fresh_data.py": 36,
    "defs/test_daemon_settings.py": 33,
    "test_demo.py": 30,
    "features/test_build.py": 28,
    "defs/test_features.py": 23,
    "federated/test_client_refusals.py": 22,
    "federated/test_federation.py": 21,
    "deploy/test_mlflow_tracking.py": 21,
    "evaluation/test_finetune.py": 20,
    "federated/test_server_app.py": 20,
    "model/test_export.py": 19,
    "defs/test_targets.py": 16,
    "defs/test_output_modes.py": 16,
    "defs/test_checks.py": 15,
    "defs/test_lineage.py": 15,
    "train/test_trainer.py": 15,
    "corpus/test_hostile_files.py": 13,
    "test_makefile.py": 12,
    "corpus/test_synth.py": 12,
    "federated/test_secure_aggregation.py": 11,
    "runtime/test_where_it_runs.py": 11,
    "features/test_featurize.py": 10,
    "train/test_async_checkpoint.py": 10,
    "deploy/test_cluster_configs.py": 10,
}


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist (3.x) reorders loadscope's modules by number of tests unless told not to, which
    # would undo the order below (a one-test module of 47 s went last)
    if getattr(config.option, "dist", "no") == "loadscope":
        config.option.loadscopereorder = False


# The modules that start from `sample_build` run on one xdist worker, one after another, so that the
# session builds it once (~12 s of a core) instead of once per worker. Checked at collection.
SAMPLE_BUILD_MODULES = frozenset(
    {
        "defs/test_model_runs.py",
        "defs/test_training_launch.py",
        "federated/test_federation.py",
        "federated/test_local.py",
        "federated/test_records.py",
    }
)


def _module(nodeid: str) -> str:
    return nodeid.split("::")[0].removeprefix("speech_assets_tests/")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """loadscope, with the `sample_build` modules as one scope (it keeps their order: each module's
    tests stay together, so module fixtures are still built once)."""
    if getattr(config.option, "dist", "no") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SampleBuildTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "sample_build" if _module(nodeid) in SAMPLE_BUILD_MODULES else super()._split_scope(nodeid)

    return SampleBuildTogether(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # in every run, not only under loadscope: xdist's workers see `--dist no`, and the controller
    # hands out modules in the order its workers collected them
    # a stable sort: each module keeps its own order (its fixtures rely on it)
    items.sort(key=lambda item: -MODULE_SECONDS.get(_module(item.nodeid), 0))
    users = {_module(item.nodeid) for item in items if "sample_build" in getattr(item, "fixturenames", ())}
    if unlisted := users - SAMPLE_BUILD_MODULES:
        raise pytest.UsageError(f"add to SAMPLE_BUILD_MODULES in conftest.py: {sorted(unlisted)}")


@contextlib.contextmanager
def fresh_dagster_home(root: Path) -> Iterator[Path]:
    """A new DAGSTER_HOME under ``root`` with the repository's dagster.yaml, set in this process's
    environment (and so in the CLI processes a test starts) until the block ends."""
    home = root / "dagster_home"
    home.mkdir()
    shutil.copy(REPO / "dagster.yaml", home / "dagster.yaml")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DAGSTER_HOME", str(home))
        yield home


@contextlib.contextmanager
def fresh_instance(root: Path) -> Iterator[dg.DagsterInstance]:
    """A real SQLite Dagster instance in a :func:`fresh_dagster_home` under ``root``."""
    import dagster as dg

    with fresh_dagster_home(root), dg.DagsterInstance.get() as instance:
        yield instance


@pytest.fixture
def instance(tmp_path: Path) -> Iterator[dg.DagsterInstance]:
    """A fresh real Dagster instance for one test (DAGSTER_HOME under tmp_path)."""
    with fresh_instance(tmp_path) as instance:
        yield instance


@pytest.fixture
def libri(tmp_path: Path) -> LibriCorpus:
    return LibriCorpus(tmp_path / "corpus")


@pytest.fixture
def sample_corpus() -> Path:
    if not SAMPLE_CORPUS.is_dir():
        pytest.fail(f"the committed sample corpus is missing at {SAMPLE_CORPUS}")
    return SAMPLE_CORPUS


@pytest.fixture(scope="session")
def sample_build(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """manifest (+ speaker_manifest observations) -> vad_features -> cmvn_stats -> client_partitions ->
    kmeans_targets on the committed sample (the repository's pipeline.toml: 4 clients), one real
    Dagster run each, executed in this process against a real SQLite instance in a fresh
    DAGSTER_HOME. What the federated and model-run tests start from (``defs`` runs more assets on
    it); no CLI start-up."""
    from speech_assets.definitions import build_definitions
    from speech_assets.defs.resources import PipelineSettings, StoragePaths
    from speech_assets_tests.support.local_runs import materialize_data_stages

    root = tmp_path_factory.mktemp("sample_build")
    paths = StoragePaths(
        corpus=str(SAMPLE_CORPUS),
        data_dir=str(root / "out"),
        mlflow_tracking_uri=f"sqlite:///{root / 'out' / 'mlflow.db'}",
    )
    defs = build_definitions(paths, PipelineSettings.load(REPO / "pipeline.toml"))
    with fresh_instance(root) as instance:
        clients = materialize_data_stages(defs, instance)
    return {"root": root, "home": root / "dagster_home", "out": root / "out", "clients": sorted(clients), "defs": defs}


@pytest.fixture(scope="session")
def tiny_recogniser(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """A random `tiny` recogniser (torch seed 0) exported once per session (the export is most of the
    recogniser tests' time): (model, folder, parity on two random utterances of 120 and 77 frames).
    Tests copy the folder (``test_finetune.recogniser_folder``), never change it."""
    import numpy as np
    import torch

    from speech_assets.evaluation.text import VOCAB_SIZE
    from speech_assets.model.export import export_recogniser
    from speech_assets.model.hubert import HubertPretrainModel
    from speech_assets.model.presets import get_preset

    torch.manual_seed(0)
    model = HubertPretrainModel(get_preset("tiny"), {"ctc": VOCAB_SIZE}).eval()
    feats = [np.random.default_rng(i).standard_normal((n, 80)).astype(np.float32) for i, n in enumerate((120, 77))]
    folder = tmp_path_factory.mktemp("tiny_recogniser")
    return model, folder, export_recogniser(model, folder, feats)


# The demo's trainers at test budgets: 300 tiny centralised steps; 2 federated rounds of 2 local
# steps (the federated tests resume and fault-inject runs with exactly this run config).
DEMO_TRAIN_STEPS = 300
DEMO_FEDERATED = {"rounds": 2, "local_steps": 2, "batch_seconds": 8.0}


@pytest.fixture(scope="session")
def demo_build(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """`scripts/materialize_all.sh` (exactly what `make demo` runs and the user guide documents) on the
    sample corpus with a fresh DAGSTER_HOME and data dir. The end-to-end and federated tests
    inspect what it left; building the graph once is most of the suite's time on a small machine."""
    from speech_assets_tests.support.commands import run_group

    root = tmp_path_factory.mktemp("e2e")
    bin_dir = Path(sys.executable).parent
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_PIPES", "SPEECH_ASSETS_FEDERATED"))},
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "DAGSTER_HOME": str(root / "dagster_home"),
        "SPEECH_ASSETS_DATA_DIR": str(root / "out"),
        "SPEECH_ASSETS_CORPUS": str(SAMPLE_CORPUS),
        "TRAIN_CONFIG_JSON": json.dumps(
            {
                "ops": {
                    "pretrained_checkpoint": {
                        "config": {"preset": "tiny", "max_steps": DEMO_TRAIN_STEPS, "checkpoint_every": 100}
                    }
                }
            }
        ),
        "FEDERATED_CONFIG_JSON": json.dumps({"ops": {"federated_checkpoint": {"config": DEMO_FEDERATED}}}),
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = run_group([str(REPO / "scripts" / "materialize_all.sh")], env, REPO, timeout=3600)
    (root / "build.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"materialize_all.sh failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return {"root": root, "home": root / "dagster_home", "out": root / "out", "env": env, "stdout": proc.stdout}
