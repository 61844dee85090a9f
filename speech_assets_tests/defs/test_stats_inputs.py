"""The stats database reads the shards of the manifest's speakers, vouched for by their metas,
never whatever `*.parquet` happens to lie in the shards folder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from speech_assets.defs.resources import StoragePaths
from speech_assets.defs.stats import _inputs
from speech_assets.utils import save_npz


def _publish_shard(paths: StoragePaths, speaker: str) -> None:
    files = paths.shard_files(speaker)
    files.shard.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"utt_id": [f"{speaker}-1-0"], "speaker_id": [speaker]}), files.shard)
    pq.write_table(pa.table({"utt_id": pa.array([], pa.string())}), files.rejects)
    save_npz(files.stats, {"count": np.zeros(1)})
    files.write_meta({"speaker_id": speaker})


def test_shards_are_listed_from_the_manifests_speakers(tmp_path: Path) -> None:
    paths = StoragePaths(corpus=str(tmp_path), data_dir=str(tmp_path / "out"), mlflow_tracking_uri="sqlite://")
    paths.manifest_dir.mkdir(parents=True)
    pq.write_table(pa.table({"speaker_id": ["a", "b_2", "c-3"]}), paths.speakers_file)
    for speaker in ("a", "b_2", "gone"):  # "gone" left the corpus; "c-3" is listed but not built yet
        _publish_shard(paths, speaker)
    (paths.shards_dir / "stray.parquet").write_bytes(b"not a shard")

    inputs = _inputs(paths)
    assert [p.name for p in inputs.shards] == ["a.parquet", "b_2.parquet"]
    assert [p.name for p in inputs.shard_rejects] == ["a.rejects.parquet", "b_2.rejects.parquet"]

    paths.shard_files("b_2").shard.write_bytes(b"rewritten after its meta")  # no longer vouched for
    assert [p.name for p in _inputs(paths).shards] == ["a.parquet"]
