"""Speed perturbation as data: extra utterances with safe ids, frame counts scaled by 1/factor,
in the speaker's own shard, and k-means targets computed on (and aligned with) their own frames."""

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import soundfile as sf

from speech_assets.corpus.ids import is_safe_id
from speech_assets.features.build import build_shard, process_variants, speed_perturbed_id
from speech_assets.features.featurize import FeatureExtractor
from speech_assets.features.jobs import UtteranceInput, check_speed_factors
from speech_assets.features.shards import FeatureRecord, read_shard_table
from speech_assets.features.vad import VadConfig
from speech_assets_tests.support.corpora import with_silence

SR = 16_000


def _flac(path: Path, seconds: float = 2.0, seed: int = 0) -> Path:
    sf.write(path, with_silence(0.5, seconds, 0.5, seed=seed), SR, subtype="PCM_16")
    return path


@pytest.mark.parametrize(
    ("utt_id", "factor", "expected"),
    [("u1", 0.9, "u1-sp0_9"), ("1001-0-0003", 1.1, "1001-0-0003-sp1_1"), ("a", 1.25, "a-sp1_25")],
)
def test_perturbed_ids_are_safe(utt_id, factor, expected) -> None:
    assert speed_perturbed_id(utt_id, factor) == expected and is_safe_id(expected)


@pytest.mark.parametrize("factors", [[1.0], [0.4], [2.5], [0.9, 1.0]])
def test_bad_factors_are_refused(factors) -> None:
    with pytest.raises(ValueError, match="speed factors"):
        check_speed_factors(factors)


def test_frame_counts_scale_with_the_factor(tmp_path) -> None:
    extractor = FeatureExtractor()
    original, slow, fast = process_variants(
        UtteranceInput("u1", "s", "c", str(_flac(tmp_path / "u.flac", 3.0))), VadConfig(), extractor, [1.1, 0.9]
    )
    assert all(isinstance(r, FeatureRecord) for r in (original, slow, fast))
    assert [r.utt_id for r in (original, slow, fast)] == ["u1", "u1-sp0_9", "u1-sp1_1"]
    assert slow.duration_s == pytest.approx(original.duration_s / 0.9) and fast.duration_s == pytest.approx(
        original.duration_s / 1.1
    )
    # the speech span is re-detected on the perturbed audio: its frames scale by 1/factor (±VAD frames)
    for record, factor in ((slow, 0.9), (fast, 1.1)):
        assert record.num_frames == record.logmel.shape[0] == record.mfcc.shape[0]
        assert record.num_frames == pytest.approx(original.num_frames / factor, abs=8)
    assert not np.allclose(slow.logmel[:100], original.logmel[:100])


def test_an_unreadable_file_has_one_reject_not_three(tmp_path) -> None:
    path = tmp_path / "broken.flac"
    path.write_bytes(b"fLaC garbage")
    (reject,) = process_variants(
        UtteranceInput("bad", "s", "c", str(path)), VadConfig(), FeatureExtractor(), [0.9, 1.1]
    )
    assert reject.reason == "unreadable" and reject.utt_id == "bad"


def test_shard_holds_every_copy_and_targets_align(tmp_path) -> None:
    utterances = [
        UtteranceInput(
            f"s1-c-000{i}", "s1", "c", str(_flac(tmp_path / f"{i}.flac", 1.5 + 0.3 * i, seed=i)), 2.5 + 0.3 * i
        )
        for i in range(3)
    ]
    plain = build_shard(utterances, tmp_path / "plain.parquet")
    perturbed = build_shard(utterances, tmp_path / "s1.parquet", speed_factors=(0.9, 1.1))
    assert perturbed.records == 3 * plain.records == 9
    table = read_shard_table(tmp_path / "s1.parquet")
    ids = table.column("utt_id").to_pylist()
    assert ids == sorted(ids) and {i for i in ids if "-sp" not in i} == {u.utt_id for u in utterances}
    assert set(table.column("speaker_id").to_pylist()) == {"s1"}  # same speaker, so same client
    # the original rows are byte-identical to a shard built without perturbation
    assert pq.read_table(tmp_path / "plain.parquet").column("logmel").to_pylist() == [
        blob for utt, blob in zip(ids, table.column("logmel").to_pylist(), strict=True) if "-sp" not in utt
    ]
    # the client's k-means targets (the real builder) label every copy on its own frames, aligned
    from speech_assets.features.cmvn import Cmvn, combine
    from speech_assets.targets.build import build_client_targets
    from speech_assets.targets.config import KMeansConfig
    from speech_assets.targets.labels import read_labels

    client_cmvn = Cmvn.from_sums(combine([perturbed.stats]))
    build_client_targets(
        "client_00", [tmp_path / "s1.parquet"], client_cmvn, tmp_path / "kmeans", KMeansConfig(k=4), log=lambda _: None
    )
    labels = read_labels(tmp_path / "kmeans" / "labels.parquet")
    assert set(labels) == set(ids)
    for utt, frames in zip(ids, table.column("num_frames").to_pylist(), strict=True):
        assert len(labels[utt]) == (frames + 1) // 2, utt  # 50 Hz labels of this copy's own frames
