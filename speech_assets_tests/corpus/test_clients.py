"""Speaker -> client assignment: balance, determinism, stability under fresh data."""

from __future__ import annotations

import random

import pytest

from speech_assets.corpus.clients import (
    ClientAssignment,
    SpeakerLoad,
    assign_clients,
    client_ids,
    imbalance,
    read_clients,
    write_clients,
)


def speakers(n: int, seed: int = 0) -> list[SpeakerLoad]:
    rng = random.Random(seed)
    return [SpeakerLoad(f"{1000 + i}", rng.uniform(0.1, 2.0), rng.randint(5, 50)) for i in range(n)]


def test_every_speaker_assigned_once_and_balanced() -> None:
    loads = speakers(40)
    result = assign_clients(loads, 4)
    assert sorted(a.speaker_id for a in result) == sorted(s.speaker_id for s in loads)
    assert {a.client_id for a in result} == set(client_ids(4))
    assert imbalance(result, 4) < 1.1


def test_deterministic_regardless_of_input_order() -> None:
    loads = speakers(25)
    shuffled = loads[:]
    random.Random(3).shuffle(shuffled)
    assert assign_clients(loads, 3) == assign_clients(shuffled, 3)


def test_existing_speakers_keep_their_client_when_new_ones_arrive() -> None:
    before = assign_clients(speakers(20), 4)
    previous = {a.speaker_id: a.client_id for a in before}
    grown = speakers(20) + [SpeakerLoad("9999", 5.0, 100), SpeakerLoad("9998", 0.3, 4)]
    after = {a.speaker_id: a.client_id for a in assign_clients(grown, 4, previous)}
    assert all(after[s] == c for s, c in previous.items())
    lightest = min(client_ids(4), key=lambda c: (sum(a.hours for a in before if a.client_id == c), c))
    assert after["9999"] == lightest


@pytest.mark.parametrize("bad", [0, -1])
def test_invalid_client_count(bad: int) -> None:
    with pytest.raises(ValueError):
        assign_clients(speakers(3), bad)


def test_the_clients_table_reads_back_as_written(tmp_path) -> None:
    written = assign_clients(speakers(6), 2)
    write_clients(tmp_path / "clients.parquet", written)
    assert list(read_clients(tmp_path / "clients.parquet")) == written


def table_of(tmp_path, rows: list[ClientAssignment]):
    write_clients(tmp_path / "clients.parquet", rows)
    return read_clients(tmp_path / "clients.parquet")


def test_one_read_answers_every_question_of_the_table(tmp_path) -> None:
    table = table_of(
        tmp_path,
        [
            ClientAssignment("a", "client_01", 1.0, 3),
            ClientAssignment("b", "client_00", 1.0, 5, heldout=True),
            ClientAssignment("c", "client_00", 1.0, 7),
            ClientAssignment("d", "client_01", 1.0, 2),
        ],
    )
    assert table.clients == ["client_00", "client_01"]
    assert table.speakers == {"client_01": ["a", "d"], "client_00": ["b", "c"]}
    assert table.client_of == {"a": "client_01", "b": "client_00", "c": "client_00", "d": "client_01"}
    assert table.heldout == ["b"]
    assert table.train_speakers() == ["a", "c", "d"] and table.train_speakers(["client_00"]) == ["c"]
    # the server's aggregation weights count only training speakers' utterances
    assert table.weights(["client_00", "client_01"]) == {"client_00": 7.0, "client_01": 5.0}


@pytest.mark.parametrize("clients", [["client_00"], ["client_09"]], ids=["only-heldout", "unknown"])
def test_a_client_without_training_utterances_has_no_weight(tmp_path, clients: list[str]) -> None:
    table = table_of(
        tmp_path, [ClientAssignment("b", "client_00", 1.0, 5, heldout=True), ClientAssignment("c", "client_01", 1.0, 7)]
    )
    with pytest.raises(ValueError, match=clients[0]):
        table.weights(clients)
