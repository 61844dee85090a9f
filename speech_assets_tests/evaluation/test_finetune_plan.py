"""The plan of `finetuned_asr`'s runs without Dagster: which encoders, which utterances (labelled,
dev, held out, no training-side sentence among the held-out ones), which runs (model x lr at the
smallest budget and first seed, then model x budget x seed with the lr chosen on the dev set), the
refusals and warnings, and the results read back. Tiny shards, a manifest and a clients table
written here; the real asset: speech_assets_tests/defs/test_model_runs.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from speech_assets.corpus.clients import ClientAssignment, ClientsTable
from speech_assets.defs.resources import FinetuneSettings
from speech_assets.defs.torchrun import run_folder
from speech_assets.evaluation.finetune import Candidate, labelled_subset
from speech_assets.evaluation.finetune_plan import (
    FinetunePlan,
    FinetuneRefused,
    LabelledPool,
    choose_encoders,
    choose_lrs,
    collect_results,
    dev_speakers_of,
    lr_table,
    plan_finetune,
    text_overlap,
)
from speech_assets.evaluation.finetune_results import oov_by_budget
from speech_assets.evaluation.protocol import ProbeLeak
from speech_assets.features.shards import FeatureRecord, write_shard
from speech_assets.layout import RunFiles

ASSETS = {"pretrained": "pretrained_checkpoint", "federated": "federated_checkpoint", "distilled": "distilled_ckpt"}
CHECKPOINTS = {"pretrained": ("/ckpt/pre.pt", "vp"), "federated": ("/ckpt/fed.pt", "vf")}
ONE_LR = {"pretrained": [1e-3], "federated": [1e-3], "scratch": [1e-3]}


def pool(seconds: float = 4.0) -> LabelledPool:
    """4 training speakers x 5 utterances of ``seconds`` each, one held-out speaker."""
    candidates = [Candidate(f"s{s}-{u}", f"s{s}", seconds) for s in range(4) for u in range(5)]
    texts = {c.utt_id: f"words of {c.utt_id}" for c in candidates} | {"h-0": "held out"}
    return LabelledPool([f"s{s}" for s in range(4)], ["h"], candidates, {"h-0": "held out"}, texts, 0)


def plan_runs(pool: LabelledPool, budgets: list[float], seeds: list[int], base: dict, warn) -> list:
    return FinetunePlan(CHECKPOINTS, pool, ["greedy"], None, budgets, seeds, base, ASSETS, [1e-3]).runs(ONE_LR, warn)


def test_plan_runs_every_model_budget_and_seed_on_one_subset_per_budget_and_seed() -> None:
    warnings: list[str] = []
    base = {"manifest": "m", "client_partitions": "c", "vad_features/s0": "x", "vad_features/h": "y"}
    runs = plan_runs(pool(), [0.25, 0.5], [7, 1], base, warnings.append)

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
        assert run.labelled["heldout"] == {"h-0": "held out"} and run.labelled["dev"] == {}
        assert json.loads(run.labelled_text) == run.labelled
        assert run.settings == {
            "labelled_minutes": [run.minutes],
            "seeds": [run.seed],
            "encoders": [run.model],
            "decoders": ["greedy"],
            "parallel_runs": 0,  # how many train at once never names a run
            "lr": 1e-3,
            "lr_grid": [],  # nor does the grid the lr was chosen from
            # scratch trains every parameter from step 0, and its config says so
            **({"freeze_steps": 0, "freeze_frontend": False} if run.model == "scratch" else {}),
        }
        assert run.lr == 1e-3
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
    runs = plan_runs(pool(seconds=3.0), [0.5, 2.0], [0, 1], {}, warnings.append)
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


def random_record(utt_id: str, speaker: str, frames: int, rng: np.random.Generator) -> FeatureRecord:
    """A shard row of ``frames`` random log-mel frames (chapter ``c``, nothing trimmed)."""
    return FeatureRecord(
        utt_id,
        speaker,
        "c",
        frames,
        frames / 100,
        0.0,
        frames / 100,
        frames / 100,
        1.0,
        rng.normal(size=(frames, 80)).astype(np.float32),
        np.zeros((frames, 39), np.float32),
    )


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
            records.append(random_record(utt_id, speaker, n, rng))
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
    lr = 2e-3
    lr_grid = [3e-3, 1e-3, 3e-3]  # sorted, each once
    dev_speakers = 1
    max_dev_utterances = 0


SPLIT = {"train": ["a", "b"], "heldout": ["h"]}


def plan(tmp_path: Path, options=Options, speakers=SPLIT, frames: int = 300, clients=table, corpus=write_corpus):
    manifest, shards = corpus(tmp_path, frames)
    checkpoints = {name: (str(tmp_path / f"{name}.pt"), version) for name, (_, version) in CHECKPOINTS.items()}
    for path, _ in checkpoints.values():  # each records the split ``speakers``
        torch.save({"speakers": speakers}, path)
    said, warned, versions_of = [], [], []
    found = plan_finetune(
        options,
        pretrained=checkpoints["pretrained"],
        checkpoint_of=checkpoints.get,
        encoder_assets=ASSETS,
        clients=clients,
        manifest_file=manifest,
        shard_file=shards.__getitem__,
        data_versions=lambda s: versions_of.append(s) or {f"vad_features/{x}": x.upper() for x in s},
        log=said.append,
        warn=warned.append,
    )
    return found, said, warned, versions_of


def test_plan_finetune_splits_labels_and_plans(tmp_path: Path) -> None:
    found, said, warned, versions_of = plan(tmp_path)
    assert list(found.encoders) == ["pretrained", "federated"]
    assert found.budgets == [0.02, 0.05]  # sorted, each once
    assert (found.pool.train_speakers, found.pool.test_speakers) == (["a", "b"], ["h"])
    assert found.pool.dev_speakers == ["a"]  # never labelled: its utterances are the dev set
    assert found.pool.dev_texts == {"a-c-0": "SAY A ONE", "a-c-1": "SAY A TWO"}
    assert [c.utt_id for c in found.pool.candidates] == ["b-c-0", "b-c-1"]
    assert found.pool.heldout_texts == {"h-c-0": "SAY H ONE", "h-c-1": "SAY H TWO"}
    assert found.pool.skipped == 3  # the 600-frame utterances
    assert found.pool.overlap_dropped == 0
    assert said == [
        "2 transcribed utterances (0.1 min) of 1 training speakers to label from (3 too long or too short for CTC), "
        "2 dev utterances of 1 speakers, 2 held-out utterances of 1 speakers; 0 training-side utterances dropped: "
        "their sentence is a held-out one"
    ]
    assert warned == []  # one 3 s utterance covers either budget
    assert versions_of == [["a", "b", "h"]]
    # phase 1: each model tries each lr at the smallest budget and the first seed
    assert found.lrs == [1e-3, 3e-3]
    assert [(r.model, r.minutes, r.seed, r.lr) for r in found.tuning] == [
        (model, 0.02, 0, lr) for model in ("pretrained", "federated", "scratch") for lr in (1e-3, 3e-3)
    ]
    # phase 2: every budget and seed with each model's chosen lr
    chosen = {"pretrained": 3e-3, "federated": 1e-3, "scratch": 1e-3}
    final = found.final_runs(chosen, warned.append)
    assert [r.key for r in final] == [
        (model, minutes, seed)
        for minutes in (0.02, 0.05)
        for seed in (0, 1)
        for model in ("pretrained", "federated", "scratch")
    ]
    assert all(r.lr == chosen[r.model] == r.settings["lr"] for r in final)
    assert all(r.labelled["dev"] == found.pool.dev_texts for r in [*found.tuning, *final])
    assert found.recogniser_key == ("pretrained", 0.05, 0)
    assert found.decoders == ["greedy"] and found.missing_decoder is None


def test_plan_finetune_refuses_nothing_to_label_and_a_leaked_speaker(tmp_path: Path) -> None:
    with pytest.raises(FinetuneRefused, match="nothing to fine-tune on: 0 labellable training utterances, 0 held-out"):
        plan(tmp_path, frames=5)  # too short for CTC: every utterance skipped
    with pytest.raises(ProbeLeak, match=r"pretrained trained on the held-out speakers \['h'\]"):
        plan(tmp_path, speakers={"train": ["a", "b", "h"], "heldout": []})


def write_result(run_dir: Path, **result) -> Path:
    """A finished run in ``run_dir``: its ``final.pt`` and ``result.json`` (``result`` and the checkpoint)."""
    run_dir.mkdir(parents=True)
    (run_dir / "final.pt").write_bytes(b"x")
    RunFiles(run_dir).result.write_text(json.dumps({"checkpoint": str(run_dir / "final.pt"), **result}))
    return run_dir


def test_collect_results_reads_every_run_and_names_one_without_a_result(tmp_path: Path) -> None:
    scores = [
        {"decoder": "greedy", "split": split, "cer": cer, "wer": 0.9, "utterances": 2}
        for split, cer in (("dev", 0.4), ("heldout", 0.5))
    ]
    base = {"step": 9, "labelled_seconds": 30.0, "scores": scores}
    planned = {
        # what the worker records since issue 44
        ("pretrained", 1.0, 0): write_result(
            tmp_path / "pretrained",
            **base,
            checkpoint_sha256="pp",
            dev_cer=0.4,
            lr=1.5e-3,
            speakers={"train": ["a", "b"], "heldout": ["h", "g"]},
            text_overlap=0,
            oov_rate=0.25,
        ),
        # a result from before: the new columns are None
        ("scratch", 1.0, 0): write_result(tmp_path / "scratch", **base, checkpoint_sha256="scratchscratch"),
    }
    rows, runs = collect_results(planned)
    assert list(runs) == [("pretrained", 1.0, 0), ("scratch", 1.0, 0)]
    assert [(r["model"], r["split"]) for r in rows] == [
        ("pretrained", "dev"),
        ("pretrained", "heldout"),
        ("scratch", "dev"),
        ("scratch", "heldout"),
    ]
    assert rows[1] == {
        "model": "pretrained",
        "labelled_minutes": 1.0,
        "seed": 0,
        "decoder": "greedy",
        "split": "heldout",
        "cer": 0.5,
        "wer": 0.9,
        "utterances": 2,
        "steps": 9,
        "labelled_seconds": 30.0,
        "checkpoint_sha256": "pp",
        "dev_cer": 0.4,
        "lr": 1.5e-3,
        "heldout_speakers": 2,
        "text_overlap": 0,
        "oov_rate": 0.25,
    }
    assert rows[3] == {
        **rows[1],
        "model": "scratch",
        "checkpoint_sha256": "scratchscratch",
        **dict.fromkeys(("dev_cer", "lr", "heldout_speakers", "text_overlap", "oov_rate")),
    }
    assert text_overlap(runs) == 0 and oov_by_budget(rows) == {"1 min": 0.25}
    (tmp_path / "scratch" / "final.pt").unlink()  # a result without its checkpoint is no result
    with pytest.raises(FinetuneRefused, match=r"^scratch, 1 min, seed 0: no result in "):
        collect_results(planned)


def test_text_overlap_and_oov_rate_over_runs() -> None:
    runs = {
        ("pretrained", 1.0, 0): {"text_overlap": 0, "oov_rate": 0.2},
        ("scratch", 1.0, 0): {"text_overlap": 2, "oov_rate": 0.4},
        ("pretrained", 5.0, 0): {"text_overlap": 1, "oov_rate": 0.1},
        ("scratch", 5.0, 0): {},
    }
    assert text_overlap(runs) == 3
    rows = [{"labelled_minutes": m, "oov_rate": r.get("oov_rate")} for (_, m, _), r in reversed(runs.items())]
    assert oov_by_budget(rows) == {"1 min": 0.3, "5 min": 0.1}  # budgets in order, means rounded
    assert text_overlap({("scratch", 1.0, 0): {}}) is None


def test_dev_speakers_are_a_seeded_choice_whatever_the_order_leaving_one_to_label() -> None:
    speakers = ["s3", "s1", "s0", "s2", "s4"]
    chosen = dev_speakers_of(speakers, 2)
    assert len(chosen) == 2 and chosen == sorted(chosen) and set(chosen) <= set(speakers)
    assert dev_speakers_of(list(reversed(speakers)), 2) == chosen
    assert len(dev_speakers_of(speakers, 9)) == 4  # one is always left to label
    assert dev_speakers_of(["a", "b"], 1) == dev_speakers_of(["b", "a"], 1) and len(dev_speakers_of(["a", "b"], 1)) == 1
    assert dev_speakers_of(["a"], 1) == [] and dev_speakers_of(["a", "b"], 0) == []


def test_plan_finetune_warns_without_a_second_training_speaker(tmp_path: Path) -> None:
    def one_training_speaker() -> ClientsTable:
        return ClientsTable(
            (ClientAssignment("a", "client_0", 0.1, 3), ClientAssignment("h", "client_1", 0.1, 3, True))
        )

    found, _, warned, _ = plan(tmp_path, clients=one_training_speaker, speakers={"train": ["a"], "heldout": ["h"]})
    assert found.pool.dev_speakers == [] and found.pool.dev_texts == {}
    assert [c.utt_id for c in found.pool.candidates] == ["a-c-0", "a-c-1"]
    assert warned == [
        "no dev speaker: 1 training speaker(s) with usable utterances, one is kept to label; each run trains its "
        "max_steps and keeps its last step, at lr 0.002"
    ]
    # no dev set to choose on: no tuning runs, every model at `lr`
    assert found.tuning == [] and found.lrs == [2e-3]
    assert {r.lr for r in found.final_runs(found.untuned(), warned.append)} == {2e-3}


def test_choose_lrs_takes_the_lowest_dev_cer_ties_to_the_smaller_and_none_as_worst(tmp_path: Path) -> None:
    dev_cers = {
        "pretrained": {1e-3: 0.5, 3e-3: 0.4, 1e-2: 0.4},  # a tie: the smaller lr
        "scratch": {1e-3: None, 3e-3: 0.95, 1e-2: float("nan")},  # no dev CER, or NaN: worst
        "federated": {1e-3: None, 3e-3: None, 1e-2: None},  # none measured: the smallest lr
    }
    tuned = {
        (model, lr): write_result(tmp_path / f"{model}-{lr:g}", dev_cer=cer, scores=[])
        for model, cers in dev_cers.items()
        for lr, cer in cers.items()
    }
    chosen, found = choose_lrs(tuned)
    assert chosen == {"pretrained": 3e-3, "scratch": 3e-3, "federated": 1e-3}
    assert found["pretrained"] == dev_cers["pretrained"] and found["scratch"][1e-3] is None
    table = lr_table([1e-3, 3e-3, 1e-2], chosen, found)
    assert "| model | lr 0.001 | lr 0.003 | lr 0.01 |" in table
    assert "| pretrained | 0.500 | **0.400** (chosen) | 0.400 |" in table
    assert "| scratch | n/a | **0.950** (chosen) | n/a |" in table
    assert lr_table([2e-3], {"pretrained": 2e-3, "scratch": 2e-3}, {}).splitlines()[-1] == "| scratch | 0.002 |"
    (tmp_path / "scratch-0.01" / "final.pt").unlink()
    with pytest.raises(FinetuneRefused, match=r"^scratch, lr 0.01 \(choosing the lr\): no result in "):
        choose_lrs(tuned)


def test_the_tuning_run_of_the_chosen_lr_is_the_final_run_of_its_budget_and_seed(tmp_path: Path) -> None:
    """Run folders are named from the run's settings (its lr among them): each lr of the grid has
    its own folder, and the final run at the smallest budget and first seed is the tuning run of
    the chosen lr (trained once, reused)."""
    found, *_ = plan(tmp_path)
    options = FinetuneSettings(lr_grid=Options.lr_grid, encoders=Options.encoders)

    def folder(run) -> Path:
        return run_folder(tmp_path / "runs", run.versions, options.model_copy(update=run.settings), "v")

    tuning = {run.lr_key: folder(run) for run in found.tuning}
    assert len(set(tuning.values())) == len(tuning) == 6
    chosen = {"pretrained": 3e-3, "federated": 1e-3, "scratch": 3e-3}
    final = {run.key: folder(run) for run in found.final_runs(chosen, lambda _: None)}
    assert len(set(final.values())) == len(final) == 12
    for model, lr in chosen.items():
        assert final[(model, 0.02, 0)] == tuning[(model, lr)]
    assert len(set(final.values()) & set(tuning.values())) == 3
    # without a grid, nothing is tuned: every model runs at `lr`
    untuned = type("Untuned", (Options,), {"lr_grid": []})
    found, *_ = plan(tmp_path / "untuned", options=untuned)
    assert found.tuning == [] and found.lrs == [2e-3]
    assert found.untuned() == {"pretrained": 2e-3, "federated": 2e-3, "scratch": 2e-3}


def write_overlapping_corpus(root: Path, frames: int = 300) -> tuple[Path, dict[str, Path]]:
    """A corpus built to overlap, as a synthesized one where several voices read each sentence:
    training speakers a, b, c, d and held-out speakers h, g each read 4 of 6 sentences, rotating."""
    rng = np.random.default_rng(1)
    sentences = ["the cat sat", "a dog ran", "we go home", "it is late", "she said no", "red sky tonight"]
    transcripts, shards = {}, {}
    root.mkdir(parents=True, exist_ok=True)
    for k, speaker in enumerate(("a", "b", "c", "d", "h", "g")):
        records = []
        for i in range(4):
            utt_id = f"{speaker}-c-{i}"
            transcripts[utt_id] = sentences[(k + i) % len(sentences)].title() + "."  # normalised to the same text
            records.append(random_record(utt_id, speaker, frames, rng))
        shards[speaker] = write_shard(root / f"{speaker}.parquet", records)
    manifest = root / "manifest.parquet"
    pq.write_table(pa.table({"utt_id": list(transcripts), "transcript": list(transcripts.values())}), manifest)
    return manifest, shards


def test_text_disjoint_no_labelled_dev_or_lm_sentence_in_heldout(tmp_path: Path) -> None:
    """Issue 44: on a corpus where training and held-out speakers read the same sentences, no
    labelled (and so no LM: the worker builds it from the labelled transcripts) or dev sentence of
    any planned run, tuning or final, is a held-out sentence; the dropped utterances are counted;
    the dev speakers are neither labelled nor held out."""

    def clients() -> ClientsTable:
        return ClientsTable(
            tuple(ClientAssignment(s, f"client_{i % 2}", 0.1, 4) for i, s in enumerate("abcd"))
            + (ClientAssignment("h", "client_0", 0.1, 4, True), ClientAssignment("g", "client_1", 0.1, 4, True))
        )

    options = type("Overlap", (Options,), {"labelled_minutes": [0.1, 1.0], "max_eval_utterances": 3})
    split = {"train": list("abcd"), "heldout": ["g", "h"]}
    found, said, _, _ = plan(
        tmp_path, options=options, speakers=split, clients=clients, corpus=write_overlapping_corpus
    )
    pool = found.pool
    # every held-out speaker's sentence, not only the 3 scored ones: none may be labelled, dev or LM text
    heldout = {t for u, t in pool.transcripts.items() if u.split("-")[0] in "gh"}
    assert len(pool.heldout_texts) == 3 and set(pool.heldout_texts.values()) < heldout
    assert pool.overlap_dropped > 0 and f"; {pool.overlap_dropped} training-side utterances dropped" in said[0]
    assert pool.dev_speakers and pool.dev_texts
    runs = [*found.tuning, *found.final_runs({m: 1e-3 for m in found.models}, lambda _: None)]
    assert len(runs) == 3 * 2 + 2 * 2 * 3
    for run in runs:
        lm_text = list(run.labelled["train"].values())  # what the worker's n-gram LM is built from
        assert run.labelled["train"] and not set(lm_text) & heldout, run.key
        assert not set(run.labelled["dev"].values()) & heldout, run.key
        assert json.loads(run.labelled_text)["dev"] == pool.dev_texts
        labelled_speakers = {u.split("-")[0] for u in run.labelled["train"]}
        dev_speakers = {u.split("-")[0] for u in run.labelled["dev"]}
        assert dev_speakers == set(pool.dev_speakers)
        assert not dev_speakers & labelled_speakers and not dev_speakers & set(pool.test_speakers)
        assert not labelled_speakers & set(pool.test_speakers)
    # what is dropped is exactly the training-side utterances whose sentence is held out
    training_side = [u for u in pool.transcripts if u.split("-")[0] in "abcd"]
    assert pool.overlap_dropped == sum(pool.transcripts[u] in heldout for u in training_side)


def test_plan_finetune_decodes_with_beam_only_when_wanted_and_installed(tmp_path: Path) -> None:
    """Greedy always; beam when [finetune] decoders asks for it and it can run here, else a warning
    that says why. Kills: beam dropped, or planned where it cannot run."""
    from speech_assets.evaluation import decoding

    wanted = type("Beam", (Options,), {"decoders": ["greedy", "beam"]})
    found, _, warned, _ = plan(tmp_path, options=wanted)
    missing = decoding.unavailable()
    assert found.decoders == (["greedy"] if missing else ["greedy", "beam"]) and found.missing_decoder == missing
    assert [w for w in warned if w.startswith("beam decoding skipped")] == (
        [f"beam decoding skipped: {missing}; greedy only"] if missing else []
    )
    assert plan(tmp_path / "greedy")[0].decoders == ["greedy"]
