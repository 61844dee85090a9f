"""Speaker -> client assignment: balance, determinism, stability under fresh data."""

from __future__ import annotations

import random

import pytest

from speech_assets.corpus.clients import SpeakerLoad, assign_clients, client_ids, imbalance, read_clients, write_clients


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
    assert read_clients(tmp_path / "clients.parquet") == written
