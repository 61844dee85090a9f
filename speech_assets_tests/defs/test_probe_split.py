"""The probe tests only on speakers that no encoder trained on, and trains on none of them."""

import pytest

from speech_assets.corpus.clients import ClientAssignment
from speech_assets.defs.probe import ProbeLeak, probe_split

TABLE = [
    ClientAssignment(speaker, client, 0.1, 3, heldout=speaker in {"s2", "s5"})
    for speaker, client in (("s1", "c0"), ("s2", "c0"), ("s3", "c1"), ("s4", "c1"), ("s5", "c1"))
]
TRAIN = ["s1", "s3", "s4"]


@pytest.mark.parametrize(
    ("recorded", "test"),
    [
        ({"pretrained": {"train": TRAIN, "heldout": ["s2", "s5"]}}, ["s2", "s5"]),
        # an encoder that held out fewer (here: trained on a subset) narrows nothing it did not see
        ({"pretrained": {"train": TRAIN, "heldout": ["s2", "s5"]}, "federated": {"train": ["s1"], "heldout": ["s2", "s5"]}}, ["s2", "s5"]),
        # an encoder that held out only one of them: the probe tests on the one every encoder held out
        ({"pretrained": {"train": TRAIN, "heldout": ["s2", "s5"]}, "distilled": {"train": TRAIN, "heldout": ["s2"]}}, ["s2"]),
    ],
    ids=["one encoder", "a smaller training set", "intersection"],
)
def test_test_speakers_are_held_out_by_every_encoder(recorded: dict, test: list[str]) -> None:
    train_speakers, test_speakers = probe_split(TABLE, recorded)
    assert test_speakers == test and train_speakers == TRAIN
    assert not set(test_speakers) & set(train_speakers)
    for speakers in recorded.values():
        assert not set(test_speakers) & set(speakers["train"])


@pytest.mark.parametrize(
    ("recorded", "message"),
    [
        ({"pretrained": {"train": [*TRAIN, "s5"], "heldout": ["s2"]}}, r"trained on the held-out speakers \['s5'\]"),
        ({"pretrained": {"train": TRAIN, "heldout": ["s2", "s5"]}, "federated": None}, "records no training/held-out speakers"),
        ({"pretrained": {"train": TRAIN, "heldout": ["s2"]}, "federated": {"train": TRAIN, "heldout": ["s5"]}}, "no speaker is held out"),
    ],
    ids=["leak", "no record", "nothing in common"],
)
def test_a_leak_or_a_missing_record_is_refused(recorded: dict, message: str) -> None:
    with pytest.raises(ProbeLeak, match=message):
        probe_split(TABLE, recorded)
