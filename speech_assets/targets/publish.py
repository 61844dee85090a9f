"""The publish policy of one client's k-means targets, both iterations.

A client's folder is written under its lock; ``quality.json``, written last, is the record that
decides what the next run does, and its ``data_version`` is the partition's.

- Reuse: the record's ``inputs_key`` and ``fit_key`` are this run's and the files are as recorded.
- Iteration 1, otherwise: new speakers only are labelled with the existing codebook while the
  client's frames grew by at most ``refit_growth`` since the last refit and no speaker the
  codebook was fitted on has since been held out; anything else refits.
- Iteration 2: always a refit.

Held-out speakers are labelled, never fitted; client CMVN comes from its training speakers only.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speech_assets.features import cmvn
from speech_assets.layout import TargetFiles
from speech_assets.runtime.locks import exclusive_lock
from speech_assets.targets.config import KMeansConfig
from speech_assets.utils import atomic_write_text, read_json, sha256_file, sha256_strings


@dataclass(frozen=True)
class ClientShards:
    """One client's inputs: its (held-out) speakers, sorted, and each speaker's shard version and file."""

    client_id: str
    speakers: list[str]
    heldout: list[str]
    shard_versions: dict[str, str]
    shard_file: Callable[[str], Path]

    def files(self, speakers: list[str]) -> list[Path]:
        return [self.shard_file(s) for s in speakers]


@dataclass(frozen=True)
class KMeansPolicy:
    """Iteration 1's settings; ``fit_settings``: the JSON of those that change a fit (all but ``refit_growth``)."""

    config: KMeansConfig
    refit_growth: float
    fit_settings: str
    code_version: str


def outputs_intact(quality: dict, out_dir: Path) -> bool:
    """Whether a client's targets folder still holds the codebook and labels ``quality`` recorded."""
    files = TargetFiles(out_dir)
    try:
        digests = sha256_file(files.codebook), sha256_file(files.labels)
    except OSError:
        return False
    return digests == (quality.get("codebook_sha256"), quality.get("labels_sha256"))


# what the record copies from the build's result
_RESULT_FIELDS = (
    "k frames_fit frames_labelled utterances inertia_per_frame perplexity empty_clusters mean_segment_length".split()
)

# what builds a client's targets: (the previous record, whether its fit may be kept) ->
# (the build's ClientTargetSet, the record's fields of this iteration)
Build = Callable[[dict, bool], tuple[Any, dict[str, Any]]]


def publish_client_targets(
    client: ClientShards,
    out_dir: Path,
    fit_inputs: list[str],
    k_requested: int,
    build: Build,
    *,
    fit_key: str | None = None,
    force: bool = False,
    log: Callable[[str], None] = print,
    what: str = "targets",
) -> dict:
    """Reuse or build one client's targets under its lock; returns the published record.

    The record is reused while its ``inputs_key`` (the client's shards, held-out speakers and
    ``fit_inputs``) is this run's. ``build(previous, intact)`` is called only when it cannot be;
    ``intact``: the previous fit is this one's (same ``fit_key``, files as recorded, not ``force``).
    """
    inputs_key = sha256_strings(
        [json.dumps(client.shard_versions, sort_keys=True), json.dumps(client.heldout), *fit_inputs]
    )
    with exclusive_lock(TargetFiles(out_dir).lock):
        previous = read_json(TargetFiles(out_dir).quality)  # {}: none, or unreadable (then rebuilt)
        intact = not force and previous.get("fit_key") == fit_key and outputs_intact(previous, out_dir)
        if intact and previous.get("inputs_key") == inputs_key:
            log(f"{client.client_id}: inputs unchanged, keeping {what} {previous['data_version'][:12]}")
            return previous
        result, fields = build(previous, intact)
        quality = {
            "client_id": client.client_id,
            "k_requested": k_requested,
            **{name: getattr(result, name) for name in _RESULT_FIELDS},
            "speakers": client.speakers,
            "heldout_speakers": client.heldout,
            "shard_versions": client.shard_versions,
            **fields,
            "inputs_key": inputs_key,
            **({"fit_key": fit_key} if fit_key is not None else {}),
            "codebook_sha256": sha256_file(result.codebook_path),
            "labels_sha256": sha256_file(result.labels_path),
        }
        quality["data_version"] = sha256_strings([quality["codebook_sha256"], quality["labels_sha256"]])
        atomic_write_text(TargetFiles(out_dir).quality, json.dumps(quality, indent=1, sort_keys=True))
        return quality


def kmeans_client_targets(
    client: ClientShards,
    out_dir: Path,
    policy: KMeansPolicy,
    speaker_sums: cmvn.ShardStats,
    *,
    force: bool = False,
    log: Callable[[str], None] = print,
    warn: Callable[[str], None] = print,
) -> dict:
    """Iteration 1: reuse, extend or refit one client's MFCC k-means targets (module docstring);
    returns the published record. ``speaker_sums``: every speaker's CMVN sums (frame counts too)."""
    from speech_assets.targets import build  # k-means and faiss: lazily, the code location stays light

    speakers, heldout = client.speakers, client.heldout
    settings = [policy.fit_settings, policy.code_version]
    fit_key = sha256_strings(settings)

    def fit(previous: dict, intact: bool) -> tuple[Any, dict[str, Any]]:
        # the codebook is kept only while no speaker it was fitted on has since been held out
        keep = intact and not set(previous.get("codebook_speakers", [])) & set(heldout)
        newcomers = new_speakers(previous, speakers, client.shard_versions) if keep else None
        new_frames = sum(speaker_sums.speakers[s]["mfcc"].count for s in newcomers or [])
        frames_now = previous.get("frames_labelled", 0) + new_frames
        at_refit = frames_at_last_refit(previous)
        # growth since the refit, not the last extension: small extensions cannot compound past refit_growth
        if newcomers and at_refit and frames_now - at_refit <= policy.refit_growth * at_refit:
            log(
                f"{client.client_id}: {len(newcomers)} new speaker(s), {new_frames} frames; "
                f"{frames_now - at_refit} frames since the last refit of {at_refit} "
                f"(<= {policy.refit_growth:.0%}): labelling them with the existing codebook"
            )
            result = build.extend_client_targets(client.client_id, client.files(newcomers), out_dir)
            mode, codebook_speakers = "extended", previous["codebook_speakers"]
        else:
            # client-level CMVN from this client's own training speakers only: no statistics cross clients
            client_cmvn = cmvn.Cmvn.from_sums(cmvn.combine([speaker_sums], speakers=set(speakers) - set(heldout)))
            result = build.build_client_targets(
                client.client_id,
                client.files(speakers),
                client_cmvn,
                out_dir,
                policy.config,
                log=warn,
                label_only=client.files(heldout),
            )
            mode, codebook_speakers = "refit", sorted(set(speakers) - set(heldout))
        return result, {
            "labelled_inertia_per_frame": result.labelled_inertia_per_frame,
            "codebook_speakers": codebook_speakers,
            "mode": mode,
            "frames_at_refit": at_refit if mode == "extended" else result.frames_labelled,
            "shards_read": result.shards_read,
        }

    return publish_client_targets(
        client, out_dir, settings, policy.config.k, fit, fit_key=fit_key, force=force, log=log
    )


def frames_at_last_refit(quality: dict) -> int | None:
    """Frames the codebook's client had when it was last fitted (None if unknown: refit)."""
    if "frames_at_refit" in quality:
        return int(quality["frames_at_refit"])
    if quality.get("mode", "refit") == "refit" and "frames_labelled" in quality:
        return int(quality["frames_labelled"])
    return None


def new_speakers(previous: dict, speakers: list[str], shard_versions: dict[str, str]) -> list[str] | None:
    """New speakers when the client only grew (every old speaker present with the same shard)."""
    old = previous.get("shard_versions", {})
    if not old or any(shard_versions.get(s) != version for s, version in old.items()):
        return None
    return sorted(set(speakers) - set(old)) or None
