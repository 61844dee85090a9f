"""The manifest asset on a real instance: write, audit, publish; unsafe ids never reach the data dir."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest

from speech_assets.corpus.audit import AUDITS
from speech_assets.definitions import build_definitions
from speech_assets.defs.resources import PipelineSettings, StoragePaths
from speech_assets_tests.support.corpora import LibriCorpus, write_flac
from speech_assets_tests.support.local_runs import materialize_in_process


def defs_for(corpus: Path, out: Path) -> dg.Definitions:
    paths = StoragePaths(corpus=str(corpus), data_dir=str(out), mlflow_tracking_uri="sqlite://")
    return build_definitions(paths, PipelineSettings())


def check_statuses(instance: dg.DagsterInstance) -> dict[str, str]:
    keys = [dg.AssetCheckKey(dg.AssetKey("manifest"), name) for name in AUDITS]
    records = instance.event_log_storage.get_latest_asset_check_execution_by_key(keys)
    return {key.name: record.status.value for key, record in records.items()}


def test_a_corpus_that_fails_the_audit_leaves_the_published_manifest_untouched(tmp_path: Path, instance) -> None:
    good = LibriCorpus(tmp_path / "good")
    for speaker in ("1", "2"):
        for utt in range(3):
            good.add(speaker, "10", utt)
    out = tmp_path / "out"
    materialize_in_process(defs_for(good.root, out), instance, "manifest")
    outputs = ("manifest.parquet", "rejects.parquet", "speakers.parquet")  # (the decode cache is only a cache)
    published = {name: (out / "manifest" / name).read_bytes() for name in outputs}
    partitions = list(instance.get_dynamic_partitions("speakers"))

    bad = LibriCorpus(tmp_path / "bad")  # one good file, two unreadable: reject ratio 2/3
    bad.add("3", "30", 0)
    for utt in (1, 2):
        bad.add("4", "30", utt).write_text("not audio")
    with pytest.raises(dg.Failure) as failure:
        materialize_in_process(defs_for(bad.root, out), instance, "manifest")
    assert failure.value.description == (
        "manifest not published, the previous one stays: "
        "reject_ratio failed: 2 of 3 utterances rejected (0.6667 > max_reject_ratio 0.2)"
    )
    assert {name: (out / "manifest" / name).read_bytes() for name in outputs} == published
    assert list(instance.get_dynamic_partitions("speakers")) == partitions == ["1", "2"]
    assert not (out / "manifest" / ".staging").exists()
    # the failed audit is recorded in Dagster, beside the ones that passed
    assert check_statuses(instance) == {name: "FAILED" if name == "reject_ratio" else "SUCCEEDED" for name in AUDITS}
    assert len(instance.fetch_materializations(dg.AssetKey("manifest"), limit=10).records) == 1


def test_unsafe_ids_from_a_csv_never_become_paths_or_partitions(tmp_path: Path, instance) -> None:
    root = tmp_path / "corpus"
    rows = ["path,transcript,speaker_id,utt_id"]
    for index, speaker in enumerate(["ok1", "../../x", "a.rejects", "ok2"]):
        write_flac(root / f"f{index}.flac", seed=index)
        rows.append(f"f{index}.flac,hello,{speaker},u{index}")
    (root / "corpus.csv").write_text("\n".join(rows) + "\n")
    out = tmp_path / "data" / "out"
    defs = build_definitions(
        StoragePaths(corpus=str(root / "corpus.csv"), data_dir=str(out), mlflow_tracking_uri="sqlite://"),
        PipelineSettings.model_validate({"manifest": {"max_reject_ratio": 0.6}}),
    )
    materialize_in_process(defs, instance, "manifest")
    assert list(instance.get_dynamic_partitions("speakers")) == ["ok1", "ok2"]
    materialize_in_process(defs, instance, "vad_features", ["ok1", "ok2"])
    written = {p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file()}
    assert all(str(p).startswith(("data/out/", "corpus/", "dagster_home/")) for p in written), written
    shards = sorted(p.name for p in (out / "features" / "shards").glob("*.parquet"))
    assert shards == ["ok1.parquet", "ok1.rejects.parquet", "ok2.parquet", "ok2.rejects.parquet"]


def test_bad_lines_and_bad_audio_of_a_csv_corpus_become_rejects_and_the_rest_is_published(
    tmp_path: Path, instance
) -> None:
    import shutil

    import numpy as np
    import soundfile as sf

    from speech_assets.defs.resources import ManifestSettings

    root = tmp_path / "corpus"
    lines = ["path,transcript,speaker_id,utt_id"]
    for index in range(6):
        write_flac(root / f"f{index}.flac", seed=index)
        lines.append(f"f{index}.flac,hello number {index},s{index % 2},u{index}")
    shutil.copyfile(root / "f0.flac", root / "copy.flac")
    noisy = np.full(16_000, 0.1, np.float32)
    noisy[5] = np.nan
    sf.write(root / "nan.wav", noisy, 16_000, subtype="FLOAT")
    lines += [
        "copy.flac,the same recording,s1,v0",  # duplicate_audio of u0
        "f1.flac," + "A" * 200_000 + ",s1,long",  # over csv's field limit: unreadable, line 9
        "f2.flac,HEL\x00LO,s1,nul",  # unreadable, line 10
        "f3.flac,a transcript longer than forty characters in all,s1,wordy",  # transcript_too_long
        "nan.wav,not a number,s1,nan",  # unreadable (NaN samples)
    ]
    (root / "corpus.csv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    settings = PipelineSettings(manifest=ManifestSettings(max_reject_ratio=0.5, max_transcript_chars=40, workers=1))
    paths = StoragePaths(corpus=str(root / "corpus.csv"), data_dir=str(out), mlflow_tracking_uri="sqlite://")
    materialize_in_process(build_definitions(paths, settings), instance, "manifest")

    assert sorted(pq.read_table(paths.layout.manifest.manifest).column("utt_id").to_pylist()) == [
        f"u{i}" for i in range(6)
    ]
    rejects = {
        r["utt_id"]: (r["reason"], r["detail"]) for r in pq.read_table(paths.layout.manifest.rejects).to_pylist()
    }
    assert {k: reason for k, (reason, _) in rejects.items()} == {
        "v0": "duplicate_audio",
        "line-9": "unreadable",
        "line-10": "unreadable",
        "wordy": "transcript_too_long",
        "nan": "unreadable",
    }
    assert rejects["v0"][1].startswith("the same decoded audio as u0 ")
    assert (
        rejects["line-9"][1].startswith("line 9: ")
        and rejects["line-10"][1] == "line 10: field 'transcript' contains a NUL byte"
    )
    assert "max_transcript_chars=40" in rejects["wordy"][1] and "NaN" in rejects["nan"][1]
    assert set(check_statuses(instance).values()) == {"SUCCEEDED"}
