"""The featurisation as a graph (:class:`LogMelFrontend`): the pipeline's log-mel and CMVN, global
or per utterance, from raw samples (the exported graph is checked in evaluation/test_recognise_audio.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from speech_assets.evaluation.recognise import FEATURE_ATOL
from speech_assets.features import audio
from speech_assets.features.cmvn import Cmvn, UtteranceCmvn
from speech_assets.features.featurize import FeatureExtractor
from speech_assets.model.export import LogMelFrontend
from speech_assets_tests.conftest import SAMPLE_CORPUS


@pytest.mark.parametrize("kind", ["utterance", "global"])
def test_raw_audio_parity_of_the_frontend(kind: str) -> None:
    """Mutation killed: dropping the per-frame DC offset removal (features off by 4.6)."""
    waves = [audio.normalise_peak(audio.load_16k_mono(p)) for p in sorted(SAMPLE_CORPUS.rglob("*.flac"))[:2]]
    logmel = [FeatureExtractor()(w)[0] for w in waves]
    rng = np.random.default_rng(0)
    cmvn = (
        UtteranceCmvn()
        if kind == "utterance"
        else Cmvn(
            {"logmel": rng.normal(-8, 1, 80).astype(np.float32)},
            {"logmel": rng.uniform(1, 3, 80).astype(np.float32)},
            1,
        )
    )
    batch = torch.zeros(2, max(len(w) for w in waves))
    for row, wave in zip(batch, waves):
        row[: len(wave)] = torch.from_numpy(wave)
    with torch.no_grad():
        feats, lengths = LogMelFrontend(cmvn)(batch, torch.tensor([len(w) for w in waves]))
    for row, length, expected in zip(feats.numpy(), lengths.tolist(), logmel):
        assert length == len(expected) and np.abs(row[:length] - cmvn.apply(expected, "logmel")).max() <= FEATURE_ATOL
        assert not row[length:].any()
