"""Speaker -> client assignment for federated (non-IID) HuBERT targets.

Speakers are never split across clients. A largest-first greedy rule balances trimmed hours and
is stable under fresh data: a speaker that has a client keeps it, only new speakers are placed.
Ties break on ids. ``read_clients`` is the clients table's one reader.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from speech_assets.utils import atomic_path

CLIENTS_SCHEMA = pa.schema(
    [
        ("speaker_id", pa.string()),
        ("client_id", pa.string()),
        ("hours", pa.float64()),
        ("utterances", pa.int64()),
        ("heldout", pa.bool_()),
    ]
)


@dataclass(frozen=True)
class SpeakerLoad:
    speaker_id: str
    hours: float
    utterances: int


@dataclass(frozen=True)
class ClientAssignment:
    """One speaker's client; ``heldout``: the speaker is one of the pipeline's held-out speakers
    (chosen once over the whole corpus; no model or statistic a model trains on sees them)."""

    speaker_id: str
    client_id: str
    hours: float
    utterances: int
    heldout: bool = False


def client_ids(num_clients: int) -> list[str]:
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    return [f"client_{index:02d}" for index in range(num_clients)]


def assign_clients(
    speakers: list[SpeakerLoad], num_clients: int, previous: Mapping[str, str] | None = None
) -> list[ClientAssignment]:
    """Assign every speaker in ``speakers`` to one of ``num_clients`` clients.

    ``previous`` maps speaker_id -> client_id from the last assignment; those speakers keep their
    client when it still exists. Speakers absent from ``speakers`` are dropped.
    """
    clients = client_ids(num_clients)
    load = {client: 0.0 for client in clients}
    chosen: dict[str, str] = {}
    for speaker in speakers:
        client = (previous or {}).get(speaker.speaker_id)
        if client in load:
            chosen[speaker.speaker_id] = client
            load[client] += speaker.hours
    newcomers = sorted((s for s in speakers if s.speaker_id not in chosen), key=lambda s: (-s.hours, s.speaker_id))
    for speaker in newcomers:
        lightest = min(clients, key=lambda c: (load[c], c))
        chosen[speaker.speaker_id] = lightest
        load[lightest] += speaker.hours
    return [
        ClientAssignment(s.speaker_id, chosen[s.speaker_id], s.hours, s.utterances)
        for s in sorted(speakers, key=lambda s: s.speaker_id)
    ]


def imbalance(assignments: list[ClientAssignment], num_clients: int) -> float:
    """Heaviest client's hours over the mean client's hours (1.0 is perfect balance)."""
    totals = {client: 0.0 for client in client_ids(num_clients)}
    for item in assignments:
        totals[item.client_id] += item.hours
    mean = sum(totals.values()) / num_clients
    return max(totals.values()) / mean if mean > 0 else 1.0


def write_clients(path: str | os.PathLike[str], assignments: list[ClientAssignment]) -> None:
    with atomic_path(path) as tmp:
        pq.write_table(pa.Table.from_pylist([asdict(a) for a in assignments], schema=CLIENTS_SCHEMA), tmp)


@dataclass(frozen=True)
class ClientsTable:
    """The clients table as read: one :class:`ClientAssignment` per speaker, in table order."""

    rows: tuple[ClientAssignment, ...]

    def __iter__(self) -> Iterator[ClientAssignment]:
        return iter(self.rows)

    @property
    def clients(self) -> list[str]:
        return sorted({row.client_id for row in self.rows})

    @property
    def speakers(self) -> dict[str, list[str]]:
        """``{client: [speaker, ...]}``, clients and speakers in table order."""
        speakers: dict[str, list[str]] = {}
        for row in self.rows:
            speakers.setdefault(row.client_id, []).append(row.speaker_id)
        return speakers

    @property
    def client_of(self) -> dict[str, str]:
        """``{speaker: client}``."""
        return {row.speaker_id: row.client_id for row in self.rows}

    @property
    def heldout(self) -> list[str]:
        """The held-out speakers, sorted."""
        return sorted(row.speaker_id for row in self.rows if row.heldout)

    def train_speakers(self, clients: Sequence[str] | None = None) -> list[str]:
        """The speakers that are not held out (of ``clients`` only, when given), sorted."""
        return sorted(
            row.speaker_id for row in self.rows if not row.heldout and (clients is None or row.client_id in clients)
        )

    def weights(self, clients: Sequence[str]) -> dict[str, float]:
        """The aggregation weight of each of ``clients``: the utterances of its training (not
        held-out) speakers (what the server knows, not what a client reports). Raises
        ``ValueError`` naming the clients that have none."""
        totals: dict[str, float] = {}
        for row in self.rows:
            totals[row.client_id] = totals.get(row.client_id, 0.0) + (0.0 if row.heldout else float(row.utterances))
        if missing := [c for c in clients if totals.get(c, 0) <= 0]:
            raise ValueError(f"the clients table has no utterances for {missing}")
        return {c: totals[c] for c in clients}


def read_clients(path: str | os.PathLike[str]) -> ClientsTable:
    """The clients table. A table written before the held-out split was recorded in it is
    refused: re-materialise ``client_partitions``."""
    if "heldout" not in pq.read_schema(path).names:
        raise ValueError(
            f"{path} has no heldout column (written by an older version): re-materialise client_partitions"
        )
    return ClientsTable(
        tuple(ClientAssignment(**row) for row in pq.read_table(path, columns=CLIENTS_SCHEMA.names).to_pylist())
    )
