"""Atomic writes honour the umask, like any normal write (mkstemp alone would leave 0600)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

WRITE_EVERY_KIND = """
import os, sys
from pathlib import Path
os.umask(int(sys.argv[2], 8))
import numpy as np, pyarrow as pa, pyarrow.parquet as pq
from speech_assets.utils import atomic_path, atomic_write_text, save_npz
from speech_assets.stats import database
out = Path(sys.argv[1])
atomic_write_text(out / "a.json", "{}")
save_npz(out / "b.npz", {"x": np.zeros(3)})
with atomic_path(out / "c.parquet") as tmp:
    pq.write_table(pa.table({"x": [1]}), tmp)
manifest = out / "m.parquet"
pq.write_table(pa.table({"utt_id": ["u"], "duration_s": [1.0]}), manifest)
import torch
from speech_assets.train.checkpoint import save_checkpoint
save_checkpoint(out / "d.pt", {"w": torch.zeros(2)})
from speech_assets.corpus.rejects import REJECTS_SCHEMA
rejects = out / "r.parquet"
pq.write_table(REJECTS_SCHEMA.empty_table(), rejects)
database.build_database(out / "e.duckdb", database.StatsInputs(manifest=manifest, manifest_rejects=rejects,
    shards=[], shard_rejects=[], clients=out / "none.parquet", kmeans_quality=[]))
"""


@pytest.mark.parametrize(("umask", "mode"), [("022", 0o644), ("077", 0o600), ("002", 0o664)])
def test_outputs_get_the_mode_a_plain_write_would(tmp_path: Path, umask: str, mode: int) -> None:
    subprocess.run([sys.executable, "-c", WRITE_EVERY_KIND, str(tmp_path), umask], check=True)
    published = ("a.json", "b.npz", "c.parquet", "d.pt", "e.duckdb")
    written = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir() if p.name in published}
    assert written == {name: mode for name in published}
    assert not list(tmp_path.glob(".*.tmp"))


def test_umask_is_read_without_changing_it() -> None:
    import os

    from speech_assets.utils import current_umask

    before = os.umask(0o027)
    try:
        assert current_umask() == 0o027
        assert current_umask() == 0o027  # unchanged by reading
    finally:
        os.umask(before)


@pytest.mark.parametrize("text", [b"[1, 2]", b"3", b'"result"', b"null", b"{not json", b"\xff\xfe"])
def test_a_json_file_that_holds_no_object_reads_as_none_unless_strict(tmp_path: Path, text: bytes) -> None:
    """Run folders are read back by the stats database, checks and resumes: whatever a file holds, a
    reader that asks for an object gets one (``{}``: rebuilt), and ``strict`` readers see the error."""
    from speech_assets.utils import read_json

    path = tmp_path / "result.json"
    path.write_bytes(text)
    assert read_json(path) == {}
    assert read_json(tmp_path / "missing.json") == {} == read_json(tmp_path / "missing.json", strict=True)
    if text.startswith((b"{", b"\xff")):  # not JSON, not UTF-8
        with pytest.raises(ValueError):
            read_json(path, strict=True)
