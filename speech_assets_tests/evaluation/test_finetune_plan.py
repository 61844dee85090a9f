"""The plan of `finetuned_asr`'s runs without Dagster: which encoders, which utterances, which runs
(model x budget x seed), the refusals and warnings, and the results read back. Tiny shards, a
manifest and a clients table written here; the real asset: speech_assets_tests/defs/test_model_runs.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from speech_assets.corpus.clients import ClientAssignment, ClientsTable
from speech_assets.evaluation.finetune import Candidate, labelled_subset
from speech_assets.evaluation.finetune_plan import (
    FinetuneRefused,
    LabelledPool,
    choose_encoders,
    collect_results,
    plan_finetune,
    plan_runs,
)
from speech_assets.evaluation.protocol import ProbeLeak
from speech_assets.features.shards import FeatureRecord, write_shard
from speech_assets.layout import RunFiles

ASSETS = {"pretrained": "pretrained_checkpoint", "federated": "federated_checkpoint", "distilled": "distilled_ckpt"}
CHECKPOINTS = {"pretrained": ("/ckpt/pre.pt", "vp"), "federated": ("/ckpt/fed.pt", "vf")}


def pool(seconds: float = 4.0) -> LabelledPool:
    """4 training speakers x 5 utterances of ``seconds`` each, one held-out speaker."""
    candidates = [Candidate(f"s{s}-{u}", f"s{s}", seconds) for s in range(4) for u in range(5)]
    texts = {c.utt_id: f"words of {c.utt_id}" for c in candidates} | {"h-0": "held out"}
    return LabelledPool([f"s{s}" for s in range(4)], ["h"], candidates, {"h-0": "held out"}, texts, 0)


def test_plan_runs_every_model_budget_and_seed_on_one_subset_per_budget_and_seed() -> None:
    warnings: list[str] = []
    base = {"manifest": "m", "client_partitions": "c", "vad_features/s0": "x", "vad_features/h": "y"}
    runs = plan_runs(CHECKPOINTS, pool(), [0.25, 0.5], [7, 1], ["greedy"], base, ASSETS, warnings.append)

    assert [r.key for r in runs] == [
        (model, minutes, seed)
        for minutes in (0.25, 0.5)
        for seed in (7, 1)
        for model in ("pretrained", "federated", "scratch")
    ]
    assert warnings == []  # 80 s of audio covers 30 s
    for run in runs:
        subset = labelled_subset(pool().candidates, ["h"], run.minutes, run.seed)
        assert list(run.labelled["train"]) == subset
        assert run.labelled["heldout"] == {"h-0": "held out"}
        assert json.loads(run.labelled_text) == run.labelled
        assert run.settings == {
            "labelled_minutes": [run.minutes],
            "seeds": [run.seed],
            "encoders": [run.model],
            "decoders": ["greedy"],
            "parallel_runs": 0,  # how many train at once never names a run
        }
        assert run.shard_speakers == ["h", "s0"]
    scratch = [r for r in runs if r.model == "scratch"]
    assert {(r.encoder, r.init, r.versions["pretrained_checkpoint"]) for r in scratch} == {
        ("/ckpt/pre.pt", "scratch", "vp")
    }
    federated = next(r for r in runs if r.model == "federated")
    assert (federated.encoder, federated.init, federated.versions["federated_checkpoint"]) == (
        "/ckpt/fed.pt",
        "pretrained",
        "vf",
    )
    # every model of one budget and seed has the same labelled file; another seed another one
    by_subset = {(r.minutes, r.seed): set() for r in runs}
    for run in runs:
        by_subset[(run.minutes, run.seed)].add(run.versions["labelled"])
    assert all(len(hashes) == 1 for hashes in by_subset.values())
    assert len({next(iter(h)) for h in by_subset.values()}) == 4


def test_plan_runs_warns_when_fewer_minutes_are_there_than_asked() -> None:
    warnings: list[str] = []
    runs = plan_runs(CHECKPOINTS, pool(seconds=3.0), [0.5, 2.0], [0, 1], ["greedy"], {}, ASSETS, warnings.append)
    # 20 utterances x 3 s = 1 min: the 2 min budget labels all of them, once per seed
    assert warnings == ["2 min asked, 1.0 min of training speakers' audio available: using all of it"] * 2
    assert all(len(r.labelled["train"]) == 20 for r in runs if r.minutes == 2.0)
    assert all(len(r.labelled["train"]) == 10 for r in runs if r.minutes == 0.5)


def test_choose_encoders_refuses_an_unknown_name_and_keeps_the_settings_order() -> None:
    looked_up: list[str] = []

    def checkpoint_of(name: str):
        looked_up.append(name)
        return CHECKPOINTS.get(name)

    with pytest.raises(FinetuneRefused) as refused:
        choose_encoders(["pretrained", "wav2vec"], ASSETS, CHECKPOINTS["pretrained"], checkpoint_of)
    assert str(refused.value) == (
        "[finetune] encoders: unknown 'wav2vec'; known: ['distilled', 'federated', 'pretrained']"
    )
    assert isinstance(refused.value, ValueError)

    looked_up.clear()
    chosen = choose_encoders(["federated", "distilled", "pretrained"], ASSETS, CHECKPOINTS["pretrained"], checkpoint_of)
    assert list(chosen) == ["federated", "pretrained"]  # distilled has no checkpoint: left out
    assert looked_up == ["federated", "distilled"]  # pretrained's is given
    # none of those asked has a checkpoint: the pretrained encoder alone
    assert choose_encoders(["distilled"], ASSETS, CHECKPOINTS["pretrained"], checkpoint_of) == {
        "pretrained": CHECKPOINTS["pretrained"]
    }


def write_corpus(root: Path, frames: int = 300) -> tuple[Path, dict[str, Path]]:
    """A manifest and one shard per speaker: a, b train, h held out; 3 utterances each of
    ``frames`` frames, one of them too long for ``max_frames`` 400 when ``frames`` is 300 x 2."""
    rng = np.random.default_rng(0)
    transcripts, shards = {}, {}
    for speaker in ("a", "b", "h"):
        records = []
        for i in range(3):
            utt_id, n = f"{speaker}-c-{i}", frames * (2 if i == 2 else 1)
            transcripts[utt_id] = f"say {speaker} {('one', 'two', 'three')[i]}"
            records.append(
                FeatureRecord(
                    utt_id,
                    speaker,
                    "c",
                    n,
                    n / 100,
                    0.0,
                    n / 100,
                    n / 100,
                    1.0,
                    rng.normal(size=(n, 80)).astype(np.float32),
                    np.zeros((n, 39), np.float32),
                )
            )
        shards[speaker] = write_shard(root / f"{speaker}.parquet", records)
    manifest = root / "manifest.parquet"
    pq.write_table(pa.table({"utt_id": list(transcripts), "transcript": list(transcripts.values())}), manifest)
    return manifest, shards


def table() -> ClientsTable:
    return ClientsTable(
        (
            ClientAssignment("a", "client_0", 0.1, 3),
            ClientAssignment("b", "client_1", 0.1, 3),
            ClientAssignment("h", "client_1", 0.1, 3, heldout=True),
        )
    )


class Options:
    encoders = ["pretrained", "federated"]
    labelled_minutes = [0.05, 0.05, 0.02]
    seeds = [0, 1]
    decoders = ["greedy"]
    max_frames = 400
    max_eval_utterances = 0


SPLIT = {"train": ["a", "b"], "heldout": ["h"]}


def plan(tmp_path: Path, options=Options, speakers=SPLIT, frames: int = 300):
    manifest, shards = write_corpus(tmp_path, frames)
    said, warned, versions_of = [], [], []
    found = plan_finetune(
        options,
        pretrained=CHECKPOINTS["pretrained"],
        checkpoint_of=CHECKPOINTS.get,
        encoder_assets=ASSETS,
        clients=table,
        manifest_file=manifest,
        shard_file=shards.__getitem__,
        data_versions=lambda s: versions_of.append(s) or {f"vad_features/{x}": x.upper() for x in s},
        log=said.append,
        warn=warned.append,
        speakers_of=lambda path: speakers,
    )
    return found, said, warned, versions_of


def test_plan_finetune_splits_labels_and_plans(tmp_path: Path) -> None:
    found, said, warned, versions_of = plan(tmp_path)
    assert list(found.encoders) == ["pretrained", "federated"]
    assert found.budgets == [0.02, 0.05]  # sorted, each once
    assert (found.pool.train_speakers, found.pool.test_speakers) == (["a", "b"], ["h"])
    assert [c.utt_id for c in found.pool.candidates] == ["a-c-0", "a-c-1", "b-c-0", "b-c-1"]
    assert found.pool.heldout_texts == {"h-c-0": "SAY H ONE", "h-c-1": "SAY H TWO"}
    assert found.pool.skipped == 3  # the 600-frame utterances
    assert said == [
        "4 transcribed utterances (0.2 min) of 2 training speakers to label from (3 too long or too short for CTC), "
        "2 held-out utterances of 1 speakers"
    ]
    assert warned == []  # one 3 s utterance covers either budget
    assert versions_of == [["a", "b", "h"]]
    assert len(found.runs) == 2 * 2 * 3
    assert found.recogniser_key == ("pretrained", 0.05, 0)
    assert found.decoders == ["greedy"] and found.missing_decoder is None


def test_plan_finetune_refuses_nothing_to_label_and_a_leaked_speaker(tmp_path: Path) -> None:
    with pytest.raises(FinetuneRefused, match="nothing to fine-tune on: 0 labellable training utterances, 0 held-out"):
        plan(tmp_path, frames=5)  # too short for CTC: every utterance skipped
    with pytest.raises(ProbeLeak, match=r"pretrained trained on the held-out speakers \['h'\]"):
        plan(tmp_path, speakers={"train": ["a", "b", "h"], "heldout": []})


def test_collect_results_reads_every_run_and_names_one_without_a_result(tmp_path: Path) -> None:
    planned = {}
    for model in ("pretrained", "scratch"):
        run_dir = tmp_path / model
        run_dir.mkdir()
        (run_dir / "final.pt").write_bytes(b"x")
        result = {
            "checkpoint": str(run_dir / "final.pt"),
            "step": 9,
            "labelled_seconds": 30.0,
            "checkpoint_sha256": model * 2,
            "scores": [{"decoder": "greedy", "split": "heldout", "cer": 0.5, "wer": 0.9, "utterances": 2}],
        }
        RunFiles(run_dir).result.write_text(json.dumps(result))
        planned[(model, 1.0, 0)] = run_dir
    rows, runs = collect_results(planned)
    assert list(runs) == [("pretrained", 1.0, 0), ("scratch", 1.0, 0)]
    assert rows[1] == {
        "model": "scratch",
        "labelled_minutes": 1.0,
        "seed": 0,
        "decoder": "greedy",
        "split": "heldout",
        "cer": 0.5,
        "wer": 0.9,
        "utterances": 2,
        "steps": 9,
        "labelled_seconds": 30.0,
        "checkpoint_sha256": "scratchscratch",
    }
    (tmp_path / "scratch" / "final.pt").unlink()  # a result without its checkpoint is no result
    with pytest.raises(FinetuneRefused, match=r"^scratch, 1 min, seed 0: no result in "):
        collect_results(planned)
