"""Online augmentation: noise at the drawn SNR, SpecAugment masks, determinism per (seed, epoch,
utterance), targets untouched, off by default, and its settings reach the run config."""

import numpy as np
import pytest
import soundfile as sf
import torch

from speech_assets.features.cmvn import Cmvn
from speech_assets.train.augment import Augmentation, Augmenter, coloured_noise, mix_at_snr, utterance_rng
from speech_assets.train.data import UtteranceDataset, build_index
from speech_assets_tests.support.training_data import SyntheticCorpus


def _logmel(frames: int = 300, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(-4.0, 2.0, size=(frames, 80)).astype(np.float32)


@pytest.mark.parametrize("snr_db", [0.0, 10.0, 30.0])
def test_mix_at_snr_sets_the_power_ratio(snr_db) -> None:
    speech, noise = _logmel(seed=0), _logmel(seed=1) + 3.0
    mixed = mix_at_snr(speech, noise, snr_db)
    added = np.exp(mixed.astype(np.float64)) - np.exp(speech.astype(np.float64))  # the scaled noise power
    assert 10 * np.log10(np.exp(speech.astype(np.float64)).mean() / added.mean()) == pytest.approx(snr_db, abs=1e-3)
    assert mixed.dtype == np.float32 and (mixed >= speech - 1e-5).all()  # adding power never lowers a bin
    with pytest.raises(ValueError, match="differ"):
        mix_at_snr(speech, noise[:-1], snr_db)


@pytest.mark.parametrize(("exponent", "steeper"), [(0.0, False), (1.0, True), (2.0, True)])
def test_coloured_noise_spectrum_falls_with_its_exponent(exponent, steeper) -> None:
    wave = coloured_noise(32000, exponent, np.random.default_rng(0))
    power = np.abs(np.fft.rfft(wave)) ** 2
    low, high = power[50:500].mean(), power[8000:15000].mean()  # ~25-250 Hz vs 4-7.5 kHz
    assert np.abs(wave).max() == pytest.approx(0.5)
    assert (low / high > 10) == steeper


def test_noise_is_deterministic_per_seed_epoch_and_utterance() -> None:
    augmenter = Augmenter(Augmentation(noise="coloured", noise_prob=1.0, snr_db=(5.0, 5.0)), seed=0)
    speech = _logmel()
    first = augmenter.noise(speech, "u1", epoch=0)
    assert first.shape == speech.shape and not np.allclose(first, speech)
    assert np.array_equal(first, augmenter.noise(speech, "u1", epoch=0))
    assert not np.array_equal(first, augmenter.noise(speech, "u1", epoch=1))
    assert not np.array_equal(first, augmenter.noise(speech, "u2", epoch=0))
    assert not np.array_equal(first, Augmenter(augmenter.options, seed=1).noise(speech, "u1", epoch=0))
    # noise_prob: about that share of the utterances, and none at 0
    some = Augmenter(Augmentation(noise="coloured", noise_prob=0.3), seed=0)
    noisy = sum(not np.array_equal(some.noise(speech[:50], f"u{i}", 0), speech[:50]) for i in range(100))
    assert 15 <= noisy <= 45
    assert np.array_equal(Augmenter(Augmentation(noise="coloured", noise_prob=0.0)).noise(speech, "u1", 0), speech)


def test_noise_folder_like_musan(tmp_path) -> None:
    rng = np.random.default_rng(0)
    (tmp_path / "noise" / "free-sound").mkdir(parents=True)
    sf.write(
        tmp_path / "noise" / "free-sound" / "hum.flac", (0.1 * rng.standard_normal(8000 * 3)).astype(np.float32), 8000
    )
    augmenter = Augmenter(Augmentation(noise=str(tmp_path / "noise"), noise_prob=1.0, snr_db=(0.0, 0.0)))
    speech = _logmel(frames=700)  # longer than the 3 s file: the noise is tiled
    mixed = augmenter.noise(speech, "u1", epoch=0)
    assert mixed.shape == speech.shape and (mixed > speech).mean() > 0.5
    with pytest.raises(ValueError, match="noise must be"):
        Augmentation(noise=str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no .flac or .wav"):
        Augmenter(Augmentation(noise=str(tmp_path / "empty"), noise_prob=1.0)).noise(speech, "u1", 0)


def test_noise_folder_is_bounded_and_read_lazily(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from speech_assets.train import augment

    folder = tmp_path / "noise"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        sf.write(folder / f"n{i}.wav", (0.1 * rng.standard_normal(16000)).astype(np.float32), 16000)
    (folder / "broken.flac").write_bytes(b"not audio")
    (folder / "link.wav").symlink_to("/etc/passwd")  # not followed
    from speech_assets.features import audio

    decoded: list[str] = []
    load = audio.load_16k_mono
    monkeypatch.setattr(audio, "load_16k_mono", lambda path: decoded.append(path) or load(path))
    augmenter = Augmenter(Augmentation(noise=str(folder), noise_prob=1.0))
    (folder / "n3.wav").write_bytes((folder / "n0.wav").read_bytes())  # listed when noise is first drawn
    assert [p.name for p in augment.noise_files(folder)] == ["broken.flac", "n0.wav", "n1.wav", "n2.wav", "n3.wav"]
    assert not decoded  # nothing decoded before noise is drawn
    drawn = 0
    for index in range(12):
        try:
            augmenter.noise(_logmel(frames=120), f"u{index}", epoch=0)
            drawn += 1
        except ValueError as error:  # the broken file, when drawn, names itself
            assert "broken.flac cannot be decoded" in str(error)
        if index == 0:
            assert len(decoded) == 1  # the one file drawn
    good = [path for path in decoded if not path.endswith("broken.flac")]
    assert drawn and len(good) == len(set(good))  # decoded once each, then from the cache
    # bounds: files, bytes per file and in all, and entries looked at (a folder like / is refused)
    for limit, value, error in [
        ("MAX_NOISE_FILES", 2, "more than 2 audio files"),
        ("MAX_NOISE_BYTES", 40_000, "or 40000 bytes"),
        ("MAX_NOISE_FILE_BYTES", 1_000, "at most 1000"),
        ("MAX_NOISE_ENTRIES", 3, "more than 3 files and folders"),
    ]:
        with monkeypatch.context() as patch:
            patch.setattr(augment, limit, value)
            with pytest.raises(ValueError, match=error):
                augment.noise_files(folder)


def test_specaugment_masks_bands_and_frames_with_the_mean() -> None:
    options = Augmentation(specaugment=True, freq_masks=2, freq_mask_width=27, time_masks=2, time_mask_width=40)
    augmenter = Augmenter(options, seed=3)
    feats = torch.from_numpy(np.random.default_rng(0).normal(size=(400, 80)).astype(np.float32))
    original = feats.clone()
    found = []
    for utt in ("a", "b", "c", "d", "e", "f"):
        masked = augmenter.specaugment(feats, utt, epoch=0)
        assert masked.shape == feats.shape and torch.equal(masked, augmenter.specaugment(feats, utt, epoch=0))
        zero_bands = int((masked == 0).all(dim=0).sum())
        zero_frames = int((masked == 0).all(dim=1).sum())
        assert zero_bands <= 2 * 27 and zero_frames <= 2 * 40
        kept = masked != 0
        assert torch.equal(masked[kept], feats[kept])  # everything else untouched
        found.append(zero_bands + zero_frames)
    assert sum(found) > 0 and len(set(found)) > 1
    assert not torch.equal(augmenter.specaugment(feats, "a", epoch=0), augmenter.specaugment(feats, "a", epoch=1))
    # time masks are at most time_mask_ratio of a short utterance
    short = augmenter.specaugment(feats[:50], "a", epoch=0)
    assert int((short == 0).all(dim=1).sum()) <= 2 * int(0.2 * 50)
    assert torch.equal(feats, original)  # the input was not modified in place


def _dataset(corpus: SyntheticCorpus, options: Augmentation | None) -> UtteranceDataset:
    index = build_index(corpus.shards, {n: c.labels for n, c in corpus.clients.items()}, 200)
    augment = Augmenter(options, seed=0) if options else None
    return UtteranceDataset(index, index.utterances, Cmvn.load(corpus.cmvn), max_frames=200, augment=augment)


def test_dataset_augments_features_and_keeps_targets_aligned(corpus: SyntheticCorpus) -> None:
    plain = _dataset(corpus, None)
    babble = _dataset(corpus, Augmentation(noise="babble", noise_prob=1.0, specaugment=True))
    changed = 0
    for i in range(len(plain)):
        a, b = plain[i], babble[i]
        assert a.utt_id == b.utt_id and a.feats.shape == b.feats.shape
        assert torch.equal(a.labels, b.labels)
        changed += not torch.equal(a.feats, b.feats)
        assert torch.equal(b.feats, babble[i].feats)  # same epoch, same augmentation
    assert changed == len(plain)
    babble.set_epoch(1)
    assert not torch.equal(babble[0].feats, _dataset(corpus, babble.augment.options)[0].feats)
    # off by default: an Augmenter with nothing on is not even kept
    assert _dataset(corpus, Augmentation()).augment is None


def test_babble_comes_from_the_same_client_only(corpus: SyntheticCorpus) -> None:
    dataset = _dataset(corpus, Augmentation(noise="babble", noise_prob=1.0))
    raw = {ref.utt_id: (ref.client, dataset.logmel(ref)) for ref in dataset.utterances}
    for item in (0, len(dataset) - 1):
        talkers = dataset._babble(item, utterance_rng(0, 0, "x", "noise"), 3)
        assert len(talkers) == 3
        sources = {
            utt
            for utt, (_, logmel) in raw.items()
            for t in talkers
            if logmel.shape == t.shape and np.array_equal(logmel, t)
        }
        assert len(sources) == 3 and dataset.utterances[item].utt_id not in sources
        assert {raw[utt][0] for utt in sources} == {dataset.utterances[item].client}


def test_train_config_carries_augmentation_to_mlflow_params(corpus: SyntheticCorpus, tmp_path) -> None:
    config = corpus.config(tmp_path / "run", noise="coloured", noise_snr_db=[0.0, 10.0], specaugment=True)
    options = config.augmentation()
    assert options.noise == "coloured" and options.snr_db == (0.0, 10.0) and options.specaugment
    assert {"noise", "noise_prob", "noise_snr_db", "specaugment"} <= set(config.to_dict())  # logged as params
    assert not corpus.config(tmp_path / "run").augmentation().enabled
    with pytest.raises(ValueError, match="augmentation"):
        corpus.config(tmp_path / "run", noise="thunder")
    with pytest.raises(ValueError, match="augmentation"):
        corpus.config(tmp_path / "run", noise_snr_db=[20.0, 5.0])
