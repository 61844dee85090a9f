"""The publish policy of a client's targets: reused only while its record, keys and files agree."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from speech_assets.features import cmvn
from speech_assets.layout import TargetFiles
from speech_assets.targets.config import KMeansConfig
from speech_assets.targets.labels import read_labels
from speech_assets.targets.publish import ClientShards, KMeansPolicy, kmeans_client_targets, publish_client_targets
from speech_assets.utils import sha256_file
from speech_assets_tests.targets.test_build import make_shard


@dataclass
class Built:
    """The fields of a build's result the record takes (a ClientTargetSet's)."""

    codebook_path: Path
    labels_path: Path
    k: int = 4
    frames_fit: int = 10
    frames_labelled: int = 12
    utterances: int = 2
    inertia_per_frame: float = 1.0
    perplexity: float = 3.0
    empty_clusters: int = 0
    mean_segment_length: float = 2.0


class Builder:
    """Writes a codebook and labels file (contents differ per build) and counts its calls."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir, self.calls = out_dir, []

    def __call__(self, previous: dict, intact: bool) -> tuple[Built, dict]:
        self.calls.append(intact)
        files = TargetFiles(self.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        np.save(files.codebook, np.full((4, 2), len(self.calls), np.float32))
        files.labels.write_bytes(b"labels %d" % len(self.calls))
        return Built(files.codebook, files.labels), {"mode": "refit"}


def publish(
    out_dir: Path, builder: Builder, inputs_key: str = "in-1", fit_key: str | None = "fit-1", force: bool = False
) -> dict:
    client = ClientShards(
        "client_00", ["a", "b"], ["b"], {"a": "sha-a", "b": "sha-b"}, lambda s: out_dir / f"{s}.parquet"
    )
    return publish_client_targets(
        client, out_dir, [inputs_key], 4, builder, fit_key=fit_key, force=force, log=lambda _: None
    )


def tamper_labels(out_dir: Path) -> None:
    TargetFiles(out_dir).labels.write_bytes(b"someone else's labels")


def drop_record(out_dir: Path) -> None:
    TargetFiles(out_dir).quality.write_text("{not json")


@pytest.mark.parametrize(
    ("change", "expect_intact"),
    [
        (lambda out, b: publish(out, b, inputs_key="in-2"), True),  # new inputs, same fit: may extend
        (lambda out, b: publish(out, b, fit_key="fit-2"), False),  # other settings: refit
        (lambda out, b: publish(out, b, force=True), False),
        (lambda out, b: (tamper_labels(out), publish(out, b)), False),  # files not the recorded ones
        (lambda out, b: (drop_record(out), publish(out, b)), False),  # a corrupt record is rebuilt
    ],
    ids=["inputs-changed", "fit-key-changed", "forced", "labels-tampered", "record-corrupt"],
)
def test_targets_are_reused_only_while_record_keys_and_files_agree(tmp_path: Path, change, expect_intact: bool) -> None:
    out_dir = tmp_path / "kmeans" / "client_00"
    builder = Builder(out_dir)
    first = publish(out_dir, builder)
    assert publish(out_dir, builder) == first and builder.calls == [False], "unchanged inputs must reuse the record"

    change(out_dir, builder)
    assert builder.calls == [False, expect_intact]
    record = json.loads(TargetFiles(out_dir).quality.read_text())
    assert record["data_version"] != first["data_version"]
    assert record["speakers"] == ["a", "b"] and record["heldout_speakers"] == ["b"] and record["mode"] == "refit"


def test_iteration_2_records_carry_no_fit_key(tmp_path: Path) -> None:
    out_dir = tmp_path / "kmeans_iter2" / "client_00"
    builder = Builder(out_dir)
    record = publish(out_dir, builder, fit_key=None)
    assert "fit_key" not in record and publish(out_dir, builder, fit_key=None) == record and len(builder.calls) == 1


@pytest.mark.parametrize(
    ("speakers", "heldout", "mode", "codebook_speakers"),
    [
        (["a1", "a2", "a3"], [], "extended", ["a1", "a2"]),
        (["a1", "a2", "a3"], ["a2"], "refit", ["a1", "a3"]),  # a speaker of the codebook is now held out
        (["a1", "a3"], [], "refit", ["a1", "a3"]),  # a speaker of the codebook left the client
    ],
    ids=["grown", "grown-and-fitted-speaker-held-out", "fitted-speaker-left"],
)
def test_a_codebook_is_kept_only_while_its_speakers_still_train(
    tmp_path: Path, speakers: list[str], heldout: list[str], mode: str, codebook_speakers: list[str]
) -> None:
    """A client that only grew (a small newcomer) labels it with the codebook it has; one whose
    codebook was fitted on a speaker that is now held out or gone refits, newcomer or not."""
    shards = {s: tmp_path / f"{s}.parquet" for s in ["a1", "a2", "a3"]}
    sums = cmvn.ShardStats()
    for seed, (speaker, path) in enumerate(shards.items()):
        for record in make_shard(path, speaker, 12 if speaker != "a3" else 2, seed):
            sums.add(speaker, "mfcc", record.mfcc)
    policy = KMeansPolicy(KMeansConfig(k=8), refit_growth=0.5, fit_settings="{}", code_version="v1")
    out_dir = tmp_path / "kmeans" / "client_a"

    logged: list[str] = []

    def targets(speakers: list[str], heldout: list[str]) -> dict:
        client = ClientShards(
            "client_a", speakers, heldout, {s: sha256_file(shards[s]) for s in speakers}, shards.__getitem__
        )
        return kmeans_client_targets(client, out_dir, policy, sums, log=logged.append, warn=logged.append)

    first = targets(["a1", "a2"], [])
    assert first["mode"] == "refit" and first["codebook_speakers"] == ["a1", "a2"]
    logged.clear()
    assert targets(["a1", "a2"], []) == first
    assert logged == [f"client_a: inputs unchanged, keeping targets {first['data_version'][:12]}"]

    record = targets(speakers, heldout)
    assert (record["mode"], record["codebook_speakers"]) == (mode, codebook_speakers)
    assert (record["codebook_sha256"] == first["codebook_sha256"]) == (mode == "extended")
    assert record["codebook_sha256"] == sha256_file(TargetFiles(out_dir).codebook)
    assert {utt.split("-")[0] for utt in read_labels(TargetFiles(out_dir).labels)} == set(speakers)
