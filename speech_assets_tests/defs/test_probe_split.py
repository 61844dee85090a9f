"""The probe tests only on speakers that no encoder trained on, and trains on none of them."""

import pytest

from speech_assets.corpus.clients import ClientAssignment
from speech_assets.evaluation.protocol import ProbeLeak, probe_split

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
        (
            {
                "pretrained": {"train": TRAIN, "heldout": ["s2", "s5"]},
                "federated": {"train": ["s1"], "heldout": ["s2", "s5"]},
            },
            ["s2", "s5"],
        ),
        # an encoder that held out only one of them: the probe tests on the one every encoder held out
        (
            {"pretrained": {"train": TRAIN, "heldout": ["s2", "s5"]}, "distilled": {"train": TRAIN, "heldout": ["s2"]}},
            ["s2"],
        ),
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
        (
            {"pretrained": {"train": TRAIN, "heldout": ["s2", "s5"]}, "federated": None},
            "records no training/held-out speakers",
        ),
        (
            {"pretrained": {"train": TRAIN, "heldout": ["s2"]}, "federated": {"train": TRAIN, "heldout": ["s5"]}},
            "no speaker is held out",
        ),
    ],
    ids=["leak", "no record", "nothing in common"],
)
def test_a_leak_or_a_missing_record_is_refused(recorded: dict, message: str) -> None:
    with pytest.raises(ProbeLeak, match=message):
        probe_split(TABLE, recorded)


def test_the_leaderboard_is_a_dagster_table_with_its_column_schema() -> None:
    import dagster as dg
    import numpy as np

    from speech_assets.defs.probe import leaderboard_metadata
    from speech_assets.evaluation.compare import LEADERBOARD_COLUMNS, HeldoutErrors, ProbeResult, leaderboard

    def rows(model: str, errors: int, speakers: int) -> list[ProbeResult]:
        found = []
        for seed in range(2):
            wrong = np.full(30, errors, dtype=np.int64)
            wrong[:seed] += 1  # the seeds differ by one character
            held = HeldoutErrors(
                tuple(f"u{i}" for i in range(30)),
                tuple(f"h{i % speakers}" for i in range(30)),
                wrong,
                np.full(30, 20),
                wrong // 4,
                np.full(30, 5),
            )
            cer = float(wrong.sum() / 600)
            found.append(
                ProbeResult(
                    model, "", "linear", [1.0], "heldout", cer, cer, 30, 60, seed, "utterance", speakers, errors=held
                )
            )
        return found

    board = leaderboard(rows("fbank", 12, 1) + rows("random", 16, 1) + rows("pretrained", 8, 1))
    value = leaderboard_metadata(board)
    assert isinstance(value, dg.TableMetadataValue)
    assert [(c.name, c.type) for c in value.schema.columns] == [(name, kind) for name, kind, _ in LEADERBOARD_COLUMNS]
    assert all(c.description for c in value.schema.columns)
    records = [r.data for r in value.records]
    assert [r["encoder"] for r in records] == ["pretrained", "fbank", "random"]  # best CER first
    # no cell wraps: a mean and its spread, a change and its interval, joined by no-break spaces
    assert records[0]["CER"] == "0.401\u00a0±\u00a00.001" and records[0]["vs fbank"].startswith("-0.200\u00a0[")
    assert " " not in records[0]["vs fbank"]
    # a short word per row; why it is only indicative is said once beside the table
    assert records[0]["verdict"] == "better*" and records[1]["verdict"] == "baseline"
    assert (records[0]["seeds"], records[0]["utterances"], records[0]["speakers"]) == (2, 30, 1)
