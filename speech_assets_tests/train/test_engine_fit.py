"""One fit loop: pretraining, distillation and fine-tuning reach the engine through
:class:`~speech_assets.train.engine.Fit` alone, and their results share its keys with one meaning."""

from __future__ import annotations

import ast
import inspect
import json
from dataclasses import replace
from pathlib import Path

from speech_assets.evaluation import finetune
from speech_assets.layout import RunFiles
from speech_assets.train import distill, trainer
from speech_assets.train.checkpoint import load_checkpoint
from speech_assets.train.config import DistillConfig
from speech_assets.train.engine import MATERIALIZED, Fit
from speech_assets_tests.evaluation.test_finetune_ddp import labelled_run
from speech_assets_tests.support.training_data import SyntheticCorpus

STAGES = {trainer: "Trainer", distill: "Distillation", finetune: "FineTuning"}
# what only the fit loop does: track, resume, write final.pt and the result, step the engine
FIT_ONLY = {"tracking", "publish", "resume", "save_final", "record"}
COMMON = (
    *MATERIALIZED,
    "train_audio_seconds",
    "train_seconds",
    "resumed_from_step",
    "world_size",
    "precision",
    "data_versions",
)


def test_one_fit_loop_is_the_only_way_a_stage_reaches_the_engine() -> None:
    for module, stage in STAGES.items():
        assert issubclass(getattr(module, stage), Fit), f"{module.__name__}.{stage} is no Fit"
        calls = {
            node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            for node in ast.walk(ast.parse(inspect.getsource(module)))
            if isinstance(node, ast.Call)
        }
        done_itself = sorted(calls & FIT_ONLY)
        assert not done_itself, f"{module.__name__} calls {done_itself} itself instead of through Fit"
        assert "engine.run(" not in inspect.getsource(module)


def test_one_fit_loop_ends_every_stage_with_the_same_result_keys(small_corpus: SyntheticCorpus, tmp_path: Path) -> None:
    pretrained = small_corpus.config(tmp_path / "pretrain", max_steps=2, log_every=1)
    teacher = trainer.train(pretrained)
    assert teacher is not None
    distilled = DistillConfig(
        run_dir=str(tmp_path / "distill"),
        teacher=teacher["checkpoint"],
        shards=small_corpus.shards,
        cmvn=small_corpus.cmvn,
        clients=small_corpus.clients,
        max_steps=2,
        log_every=1,
        batch_seconds=8.0,
        precision="fp32",
        device="cpu",
        threads=1,
        dim=32,
        layers=1,
        heads=2,
        ffn_dim=64,
        max_frames=200,
    )
    tuned = replace(labelled_run(tmp_path / "finetune"), max_steps=2)
    runs = [
        (pretrained, teacher),
        (distilled, distill.distill(distilled)),
        (tuned, finetune.finetune(tuned)),
    ]
    for config, result in runs:
        assert result is not None and set(COMMON) <= set(result), sorted(set(COMMON) - set(result or {}))
        files = RunFiles(config.run_dir)
        final = load_checkpoint(files.final)
        assert json.loads(files.result.read_text()) == json.loads(json.dumps(result))
        assert result["checkpoint"] == str(files.final) and result["checkpoint_sha256"] == final["weights_sha256"]
        assert result["step"] == final["step"] == config.max_steps
        assert final["config"] == config.to_dict() and final["data_versions"] == result["data_versions"]
        assert {"speakers", "normalisation"} <= set(final)
        steps = [json.loads(line) for line in files.metrics.read_text().splitlines()]
        last = [line for line in steps if "loss" in line][-1]  # not a background evaluation's line
        assert last["step"] == config.max_steps and result["final_loss"] == last["loss"]
        assert result["train_audio_seconds"] > 0 and result["train_seconds"] >= 0
        assert result["resumed_from_step"] is None and result["world_size"] == 1
        assert result["mlflow_run_id"] is None and result["mlflow_run_url"] is None  # no tracking URI
    assert [result["precision"] for _, result in runs] == [teacher["autoconfig"]["precision"], "fp32", "fp32"]
