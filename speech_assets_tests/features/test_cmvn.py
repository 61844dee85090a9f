"""Input normalisations: per utterance, or the training speakers' statistics only, and the record a
checkpoint keeps so that evaluation and export apply exactly the same."""

from pathlib import Path

import numpy as np
import pytest

from speech_assets.features.cmvn import Cmvn, ShardStats, UtteranceCmvn, describe, from_record, training_cmvn


def _sums(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    frames = {
        speaker: rng.normal(offset, 1.0 + offset, size=(200, 80)).astype(np.float32)
        for speaker, offset in (("a", 0.0), ("b", 1.0), ("held", 50.0))
    }
    stats = ShardStats()
    for speaker, x in frames.items():
        stats.add(speaker, "logmel", x)
    stats.save(tmp_path / "speaker_sums.npz")
    return tmp_path / "speaker_sums.npz", frames


def test_global_cmvn_is_the_training_speakers_alone(tmp_path: Path) -> None:
    path, frames = _sums(tmp_path)
    cmvn = training_cmvn("global", path, ["a", "b"])
    both = np.concatenate([frames["a"], frames["b"]]).astype(np.float64)
    np.testing.assert_allclose(cmvn.mean["logmel"], both.mean(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cmvn.std["logmel"], both.std(0), rtol=1e-4)
    # the held-out speaker's very different frames would have moved the mean by ~17
    assert np.abs(cmvn.mean["logmel"]).max() < 1.0


def test_utterance_cmvn_uses_nothing_but_the_utterance() -> None:
    x = np.random.default_rng(1).normal(3.0, 2.0, size=(50, 80)).astype(np.float32)
    y = UtteranceCmvn().apply(x, "logmel")
    assert y.dtype == np.float32 and y.shape == x.shape
    np.testing.assert_allclose(y.mean(0), 0.0, atol=1e-5)
    np.testing.assert_allclose(y.std(0), 1.0, atol=1e-4)
    np.testing.assert_array_equal(
        UtteranceCmvn().apply(x[:10], "logmel"), UtteranceCmvn().apply(x[:10].copy(), "logmel")
    )
    assert UtteranceCmvn().apply(np.zeros((0, 80), np.float32), "logmel").shape == (0, 80)
    constant = UtteranceCmvn().apply(np.ones((5, 80), np.float32), "logmel")
    assert np.isfinite(constant).all()


@pytest.mark.parametrize("kind", ["utterance", "global"])
def test_a_recorded_normalisation_applies_exactly_the_same(tmp_path: Path, kind: str) -> None:
    path, frames = _sums(tmp_path)
    cmvn = training_cmvn(kind, path, ["a", "b"])
    restored = from_record(describe(cmvn))
    x = frames["held"][:30]
    np.testing.assert_allclose(restored.apply(x, "logmel"), cmvn.apply(x, "logmel"), rtol=1e-6, atol=1e-6)
    assert describe(restored)["kind"] == kind


@pytest.mark.parametrize(("record", "expected"), [(None, None), ({}, None)])
def test_no_record_gives_no_normaliser(record, expected) -> None:
    assert from_record(record) is expected


def test_unknown_normalisations_are_refused(tmp_path: Path) -> None:
    path, _ = _sums(tmp_path)
    with pytest.raises(ValueError, match="normalisation must be one of"):
        training_cmvn("speaker", path, ["a"])
    with pytest.raises(ValueError, match="unknown normalisation"):
        from_record({"kind": "speaker"})
    assert isinstance(from_record({"kind": "global", "mean": [0.0] * 80, "std": [1.0] * 80}), Cmvn)


def test_merge_keeps_every_speakers_sums_and_the_table_lists_them(tmp_path: Path) -> None:
    from speech_assets.features.cmvn import merge, speakers_table

    rng = np.random.default_rng(2)
    parts = []
    for speaker, frames in (("a", 30), ("b", 20)):
        part = ShardStats()
        part.add(speaker, "mfcc", rng.normal(size=(frames, 39)))
        part.add(speaker, "logmel", rng.normal(size=(frames, 80)))
        parts.append(part)
    merged = merge(parts)
    assert sorted(merged.speakers) == ["a", "b"] and merged.speakers["b"]["mfcc"].count == 20
    metas = {
        s: {"utterances": n, "audio_seconds": 3600.0 * n, "trimmed_seconds": 1800.0, "shard_sha256": f"sha-{s}"}
        for s, n in (("a", 2), ("b", 1), ("gone", 4))
    }
    table = speakers_table(["a", "b", "gone"], metas, merged)
    assert table.to_pydict() == {
        "speaker_id": ["a", "b", "gone"],
        "utterances": [2, 1, 4],
        "frames": [30, 20, 0],  # a speaker whose shard kept no frames has no sums
        "audio_hours": [2.0, 1.0, 4.0],
        "trimmed_hours": [0.5, 0.5, 0.5],
        "shard_sha256": ["sha-a", "sha-b", "sha-gone"],
    }


@pytest.mark.parametrize(
    ("mean", "std", "bad"),
    [
        ([0.0, 1.0, 2.0], [1.0, 0.5, 2.0], {}),
        ([0.0, 1.0, 2.0], [1.0, 1e-4, 2.0], {"mfcc": [1]}),  # below the floor: a constant dimension
        ([np.nan, 1.0, 2.0], [1.0, 0.5, 2.0], {"mfcc": [0]}),
        ([0.0, 1.0, 2.0], [1.0, 0.5, np.inf], {"mfcc": [2]}),
        ([0.0, 1.0, 2.0], [1e-3, 0.5, 2.0], {}),  # exactly at the floor is sound
    ],
)
def test_degenerate_dimensions(mean: list[float], std: list[float], bad: dict) -> None:
    from speech_assets.features.cmvn import degenerate_dimensions

    sound = np.ones(3, np.float32)
    stats = Cmvn(
        mean={"logmel": sound * 0, "mfcc": np.array(mean, np.float32)},
        std={"logmel": sound, "mfcc": np.array(std, np.float32)},
        frames=10,
    )
    assert degenerate_dimensions(stats) == bad
