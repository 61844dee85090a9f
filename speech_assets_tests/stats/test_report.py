"""The offline HTML report: built from a real database, opened in headless Chromium (Debian's
`chromium`, driven by Playwright without a downloaded browser): no console errors, every image
loads, and the screenshot is not blank."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from speech_assets.stats import report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]


@pytest.fixture(scope="module")
def database(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small but real stats database, built by the same code as dataset_stats from real files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from speech_assets.corpus.rejects import REJECTS_SCHEMA
    from speech_assets.features.shards import FeatureRecord, write_shard
    from speech_assets.stats import database as stats_db

    root = tmp_path_factory.mktemp("report")
    rng = np.random.default_rng(0)
    manifest_rows, shards = [], []
    for speaker in ("s1", "s2", "s3"):
        records = []
        for utt in range(5):
            utt_id, frames = f"{speaker}-c-{utt}", int(rng.integers(100, 400))
            seconds = frames / 100 + 0.3
            manifest_rows.append({"utt_id": utt_id, "speaker_id": speaker, "chapter_id": "c", "path": f"/x/{utt_id}.flac",
                                  "transcript": "HELLO <WORLD> & CO", "sample_rate": 16000, "channels": 1,
                                  "num_samples": int(seconds * 16000), "duration_s": seconds, "file_sha256": "0" * 64})
            records.append(FeatureRecord(utt_id, speaker, "c", frames, seconds, 0.1, 0.1 + frames / 100, frames / 100, 0.8,
                                         rng.normal(size=(frames, 80)).astype(np.float32), rng.normal(size=(frames, 39)).astype(np.float32)))
        shards.append(write_shard(root / f"{speaker}.parquet", records))
    pq.write_table(pa.Table.from_pylist(manifest_rows), root / "manifest.parquet")
    rejects = [{"utt_id": "bad-1", "path": "/x/bad.flac", "stage": "manifest", "reason": "unreadable", "detail": "cannot decode <script>alert(1)</script>"}]
    pq.write_table(pa.Table.from_pylist(rejects, schema=REJECTS_SCHEMA), root / "rejects.parquet")
    pq.write_table(pa.table({"speaker_id": ["s1", "s2", "s3"], "client_id": ["client_00", "client_01", "client_01"],
                             "hours": [0.01, 0.01, 0.01], "utterances": [5, 5, 5], "heldout": [False, False, True]}), root / "clients.parquet")
    quality = root / "quality.json"
    quality.write_text(json.dumps({"client_id": "client_00", "k": 8, "frames_fit": 900, "inertia_per_frame": 30.1, "perplexity": 7.2,
                                   "empty_clusters": 0, "mean_segment_length": 1.8, "frames_labelled": 1000}))
    inputs = stats_db.StatsInputs(manifest=root / "manifest.parquet", manifest_rejects=root / "rejects.parquet", shards=shards,
                                  shard_rejects=[], clients=root / "clients.parquet", kmeans_quality=[quality])
    stats_db.build_database(root / "stats.duckdb", inputs)
    return root / "stats.duckdb"


@pytest.fixture(scope="module")
def page(database: Path) -> Path:
    extras = report.ReportInputs(
        cluster_counts={"client_00": np.array([50, 30, 10, 5, 3, 1, 1, 0])},
        training_metrics={"run1": [{"step": s, "loss": 5 - s / 10, "masked_accuracy": s / 100, "lr": 1e-3} for s in range(10, 60, 10)]},
    )
    return report.write_report(database, database.parent / "report" / "index.html", extras)


def test_report_is_self_contained_and_shows_its_sql(page: Path) -> None:
    text = page.read_text()
    assert "http://" not in text and "https://" not in text and "<script" not in text  # offline, no CDN, escaped
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert text.count("<img ") >= 5 and text.count("<summary>SQL</summary>") >= 8
    assert "FROM rejects_by_reason" in text and "unreadable" in text and "client_01" in text


@pytest.mark.slow
def test_report_renders_in_headless_chromium(page: Path, tmp_path: Path) -> None:
    if CHROMIUM is None:
        pytest.skip("LOUD SKIP: Debian's chromium is not installed (make test installs it with apt-get when run as root)")
    from PIL import Image
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        try:
            view = browser.new_page(viewport={"width": 1200, "height": 900})
            view.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
            view.on("pageerror", lambda error: errors.append(str(error)))
            view.goto(page.resolve().as_uri(), wait_until="load")
            images = view.evaluate("Array.from(document.images).map(i => [i.complete, i.naturalWidth, i.naturalHeight])")
            shot = view.screenshot(full_page=True)
        finally:
            browser.close()
    assert errors == []
    assert len(images) >= 5 and all(done and width > 100 and height > 50 for done, width, height in images)
    pixels = np.asarray(Image.open(io.BytesIO(shot)).convert("L"), dtype=np.float32)
    assert pixels.shape[0] > 900 and pixels.std() > 10  # a blank page would be one flat colour
