"""Write, audit, publish: the manifest's files change only when every audit of the new ones passes.

Files are staged, audited by reading them back, and renamed into place sidecars first, rows last,
so a reader of the new rows finds the new sidecars. The publish lock is held to the end of the
``with`` block, so overlapping runs never interleave their renames, and what the caller records
about the published files is recorded before another run can publish.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from speech_assets import layout
from speech_assets.corpus import audit
from speech_assets.corpus.manifest import ManifestRow, ValidationConfig, speaker_hashes, write_manifest
from speech_assets.corpus.rejects import RejectRow, write_rejects
from speech_assets.runtime.locks import exclusive_lock
from speech_assets.utils import atomic_path, fsync_dir


@dataclass(frozen=True)
class SpeakerRows:
    """One speaker's summary in speakers.parquet."""

    manifest_hash: str
    utterances: int
    hours: float


@dataclass(frozen=True)
class Publication:
    """Every audit of the staged files, in :data:`audit.AUDITS` order, and the per-speaker rows written."""

    audits: list[audit.Audit]
    per_speaker: dict[str, SpeakerRows]

    @property
    def failed(self) -> list[audit.Audit]:
        return [outcome for outcome in self.audits if not outcome.passed]

    @property
    def published(self) -> bool:
        return not self.failed


_STAGED = ("rejects", "speakers", "manifest")  # renamed into place in this order: sidecars first, rows last


@contextlib.contextmanager
def publish_manifest(
    rows: Sequence[ManifestRow],
    rejects: Sequence[RejectRow],
    files: layout.ManifestFiles,
    corpus_root: Path,
    validation: ValidationConfig,
    max_reject_ratio: float,
    staging_name: str,
) -> Iterator[Publication]:
    """Stage, audit and (only if every audit passes) publish ``rows`` and ``rejects`` into ``files``,
    then yield the :class:`Publication` with the publish lock still held. ``staging_name``: a run id."""
    with exclusive_lock(files.publish_lock):
        # holding the lock, leftovers of runs killed mid-way can be removed safely
        shutil.rmtree(files.staging, ignore_errors=True)
        staging = files.staging / staging_name
        try:
            staged = layout.ManifestFiles(staging)
            write_manifest(staged.manifest, rows)
            write_rejects(staged.rejects, rejects)
            per_speaker = write_speakers(staged.speakers, rows)
            publication = Publication(
                audit.audit_manifest(staged, corpus_root, validation, max_reject_ratio), per_speaker
            )
            if publication.published:
                for name in _STAGED:
                    os.replace(getattr(staged, name), getattr(files, name))
                fsync_dir(files.root)
        finally:
            shutil.rmtree(files.staging, ignore_errors=True)
        yield publication


def write_speakers(target: Path, rows: Sequence[ManifestRow]) -> dict[str, SpeakerRows]:
    """Write speakers.parquet (per speaker its manifest hash, utterances, hours) and return its rows."""
    hashes = speaker_hashes(rows)
    counts: dict[str, int] = {}
    seconds: dict[str, float] = {}
    for row in rows:
        counts[row.speaker_id] = counts.get(row.speaker_id, 0) + 1
        seconds[row.speaker_id] = seconds.get(row.speaker_id, 0.0) + row.duration_s
    table = pa.table(
        {
            "speaker_id": list(hashes),
            "utterances": [counts[s] for s in hashes],
            "hours": [seconds[s] / 3600 for s in hashes],
            "manifest_hash": list(hashes.values()),
        }
    )
    with atomic_path(target) as tmp:
        pq.write_table(table, tmp)
    return {s: SpeakerRows(h, counts[s], seconds[s] / 3600) for s, h in hashes.items()}
