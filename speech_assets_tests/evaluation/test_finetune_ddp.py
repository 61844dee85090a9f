"""CTC fine-tuning as two torchrun processes (DDP on CPU, gloo): a worker that dies mid-run is
restarted and the group continues from the last checkpoint, to a finite loss and scores."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

from speech_assets.features.shards import read_shard_table
from speech_assets.model.hubert import HubertPretrainModel
from speech_assets.model.presets import get_preset
from speech_assets.runtime.faults import FAULTS_ENV, fault
from speech_assets.train.config import FinetuneConfig
from speech_assets.train.launch import TORCHRUN_ENV, build_torchrun_command
from speech_assets_tests.conftest import REPO
from speech_assets_tests.support.training_data import write_corpus

WORDS = ["AB", "CAT", "DOG", "SAT", "RAN", "THE"]


def labelled_run(tmp_path: Path) -> FinetuneConfig:
    """A 4-speaker synthetic corpus (one speaker held out), made-up transcripts, and a `tiny`
    encoder stored as a federated run's global encoder."""
    corpus = write_corpus(tmp_path / "corpus", utterances_per_speaker=4, seed=3)
    texts: dict[str, dict[str, str]] = {"train": {}, "heldout": {}}
    for shard in corpus.shards:
        table = read_shard_table(shard, columns=["utt_id", "speaker_id"]).to_pylist()
        for i, row in enumerate(table):
            split = "heldout" if row["speaker_id"] == "client_b-spk1" else "train"
            texts[split][row["utt_id"]] = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(3))
    (tmp_path / "labelled.json").write_text(json.dumps(texts))
    torch.manual_seed(0)
    model = HubertPretrainModel(get_preset("tiny"), {"none": 2})
    encoder = {k: v for k, v in model.state_dict().items() if not k.startswith("heads.")}
    torch.save({"encoder": encoder, "preset": model.preset.to_dict()}, tmp_path / "encoder.pt")
    return FinetuneConfig(
        run_dir=str(tmp_path / "run"),
        shards=corpus.shards,
        cmvn=corpus.cmvn,
        clients={},
        encoder=str(tmp_path / "encoder.pt"),
        labelled=str(tmp_path / "labelled.json"),
        max_steps=5,
        freeze_steps=2,
        checkpoint_every=2,
        log_every=1,
        batch_seconds=4.0,
        lr=2e-3,
        precision="fp32",
        device="cpu",
        threads=1,
        decoders=["greedy"],
    )


@pytest.mark.slow
def test_finetuning_on_two_processes_resumes_after_a_worker_dies(tmp_path: Path) -> None:
    config = labelled_run(tmp_path)
    config.to_json(tmp_path / "config.json")
    marker = tmp_path / "fault.marker"
    command = build_torchrun_command(
        tmp_path / "config.json", nproc=2, max_restarts=1, module="speech_assets.evaluation.finetune"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_PIPES", FAULTS_ENV))}
    env |= {
        "PYTHONPATH": str(REPO),
        **TORCHRUN_ENV,
        FAULTS_ENV: fault("train.step", "exit", rank=1, step=3, once=marker),
    }
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        _, stderr = process.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        process.terminate()  # torchrun stops its workers (each in its own session) on SIGTERM
        _, stderr = process.communicate(timeout=60)
        pytest.fail(f"torchrun timed out:\n{stderr[-4000:]}")
    assert process.returncode == 0, stderr[-4000:]
    assert marker.read_text().startswith("fault injection: exit at train.step rank=1 step=3")
    result = json.loads((Path(config.run_dir) / "result.json").read_text())
    assert result["world_size"] == 2 and result["step"] == 5 and result["init"] == "pretrained"
    assert result["resumed_from_step"] == 2  # the restarted group went on from step_00000002.pt
    assert math.isfinite(result["final_loss"])
    texts = json.loads(Path(config.labelled).read_text())
    held = [r for r in result["scores"] if r["split"] == "heldout"]
    assert held and all(math.isfinite(r["cer"]) and r["utterances"] == len(texts["heldout"]) for r in held)
    assert result["labelled_utterances"] == len(texts["train"]) and result["speakers"]["heldout"] == ["client_b-spk1"]
    # one final checkpoint (rank 0's), loadable as a recogniser with the 29-token head
    final = torch.load(result["checkpoint"], map_location="cpu", weights_only=True)
    assert final["clients"] == {"ctc": 29} and final["kind"] == "ctc"
