"""load_utterances reads the raw log-mel of real shards: every model normalises it its own way."""

import numpy as np

from speech_assets.evaluation.encoders import load_utterances
from speech_assets.features.shards import FeatureRecord, write_shard


def test_load_utterances_returns_the_raw_log_mel_of_transcribed_utterances(tmp_path) -> None:
    rng = np.random.default_rng(0)
    written, shards = {}, []
    for speaker in ("s1", "s2"):
        records = []
        for i in range(3):
            utt_id, frames = f"{speaker}-c-{i}", int(rng.integers(20, 60))
            logmel = (rng.normal(size=(frames, 80)) * 3 + 7).astype(np.float32)
            written[utt_id] = logmel
            records.append(
                FeatureRecord(
                    utt_id,
                    speaker,
                    "c",
                    frames,
                    frames / 100,
                    0.0,
                    frames / 100,
                    frames / 100,
                    1.0,
                    logmel,
                    np.zeros((frames, 39), np.float32),
                )
            )
        shards.append(write_shard(tmp_path / f"{speaker}.parquet", records))
    transcripts = {"s1-c-0": "hello, world", "s1-c-2": "", "s2-c-1": "it's me", "s2-c-2": "  "}
    found = load_utterances(shards, transcripts)
    assert [(u.utt_id, u.speaker_id, u.text) for u in found] == [
        ("s1-c-0", "s1", "HELLO WORLD"),
        ("s2-c-1", "s2", "IT'S ME"),
    ]
    for u in found:
        stored = written[u.utt_id].astype(np.float16).astype(np.float32)  # shards hold float16
        np.testing.assert_array_equal(u.feats, stored)  # no CMVN: mean ~7, std ~3
        assert u.feats.dtype == np.float32 and u.feats.flags.writeable
