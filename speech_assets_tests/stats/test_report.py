"""The offline HTML report: built from a real database over real files (FLAC clips included),
opened in headless Chromium (Debian's `chromium`, driven by Playwright without a downloaded
browser): no console errors, every image loads, every reject's audio player loads its clip, and
the screenshot is not blank. Its header, summary, per-speaker table, every model's checkpoint,
and the bounds and path rules of the copied clips."""

from __future__ import annotations

import html
import io
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from speech_assets.features.vad import VadConfig
from speech_assets.layout import ProbeFiles
from speech_assets.stats import report
from speech_assets_tests.support.corpora import write_flac

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
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
            manifest_rows.append(
                {
                    "utt_id": utt_id,
                    "speaker_id": speaker,
                    "chapter_id": "c",
                    "path": f"/x/{utt_id}.flac",
                    "transcript": "HELLO <WORLD> & CO",
                    "sample_rate": 16000,
                    "channels": 1,
                    "num_samples": int(seconds * 16000),
                    "duration_s": seconds,
                    "file_sha256": "0" * 64,
                }
            )
            records.append(
                FeatureRecord(
                    utt_id,
                    speaker,
                    "c",
                    frames,
                    seconds,
                    0.1,
                    0.1 + frames / 100,
                    frames / 100,
                    0.8,
                    rng.normal(size=(frames, 80)).astype(np.float32),
                    rng.normal(size=(frames, 39)).astype(np.float32),
                )
            )
        shards.append(write_shard(root / f"{speaker}.parquet", records))
    pq.write_table(pa.Table.from_pylist(manifest_rows), root / "manifest.parquet")
    corpus = root / "corpus"
    quiet = write_flac(corpus / "s1" / "c" / "s1-c-9.flac", seconds=2.0)
    sf.write(quiet, 1e-4 * rng.standard_normal(32_000).astype(np.float32), 16_000, format="FLAC")  # silence: no speech
    short = write_flac(corpus / "s2" / "c" / "s2-c-9.flac", seconds=0.3)
    long = write_flac(corpus / "s3" / "c" / "s3-c-9.flac", seconds=40.0)  # a clip keeps its first seconds only
    secret = write_flac(root / "outside" / "secret.flac", seconds=1.0)  # outside the corpus
    (corpus / "s3" / "c" / "link.flac").symlink_to(secret)  # a symlink out of it
    rejects = [
        {
            "utt_id": "bad-1",
            "path": "/x/bad.flac",
            "stage": "manifest",
            "reason": "unreadable",
            "detail": "cannot decode <script>alert(1)</script>",
        },
        {"utt_id": "s2-c-9", "path": str(short), "stage": "manifest", "reason": "too_short", "detail": "0.30 s"},
        {"utt_id": "s3-c-9", "path": str(long), "stage": "manifest", "reason": "too_long", "detail": "40 s"},
        {"utt_id": "s3-c-8", "path": str(secret), "stage": "manifest", "reason": "outside_root", "detail": "outside"},
        {
            "utt_id": "s3-c-7",
            "path": str(corpus / "s3" / "c" / "link.flac"),
            "stage": "manifest",
            "reason": "duplicate_id",
            "detail": "a link out",
        },
        {
            "utt_id": "s3-c-6",
            "path": str(corpus / "s3" / "c" / ".." / ".." / ".." / "outside" / "secret.flac"),
            "stage": "manifest",
            "reason": "invalid_id",
            "detail": "dot-dot out",
        },
    ]
    pq.write_table(pa.Table.from_pylist(rejects, schema=REJECTS_SCHEMA), root / "rejects.parquet")
    vad_rejects = [
        {"utt_id": "s1-c-9", "path": str(quiet), "stage": "vad", "reason": "no_speech", "detail": "VAD never triggered"}
    ]
    pq.write_table(pa.Table.from_pylist(vad_rejects, schema=REJECTS_SCHEMA), root / "s1.rejects.parquet")
    pq.write_table(
        pa.table(
            {
                "speaker_id": ["s1", "s2", "s3"],
                "client_id": ["client_00", "client_01", "client_01"],
                "hours": [0.01, 0.01, 0.01],
                "utterances": [5, 5, 5],
                "heldout": [False, False, True],
            }
        ),
        root / "clients.parquet",
    )
    quality = root / "quality.json"
    quality.write_text(
        json.dumps(
            {
                "client_id": "client_00",
                "k": 8,
                "frames_fit": 900,
                "inertia_per_frame": 30.1,
                "perplexity": 7.2,
                "empty_clusters": 0,
                "mean_segment_length": 1.8,
                "frames_labelled": 1000,
            }
        )
    )
    probe, finetune = verdict_results(root)
    inputs = stats_db.StatsInputs(
        probe_results=probe,
        finetune_results=finetune,
        manifest=root / "manifest.parquet",
        manifest_rejects=root / "rejects.parquet",
        shards=shards,
        shard_rejects=[root / "s1.rejects.parquet"],
        clients=root / "clients.parquet",
        kmeans_quality=[quality],
        **model_runs(root / "out"),
    )
    stats_db.build_database(root / "stats.duckdb", inputs)
    return root / "stats.duckdb"


def probe_rows(model: str, errors: int, speakers: int = 1) -> list:
    """Two seeds of ``model`` on 30 held-out utterances of ``speakers`` speakers, ``errors``
    characters wrong in each (of 20), and the probe's score on its own training utterances."""
    from speech_assets.evaluation.compare import HeldoutErrors, ProbeResult

    found = []
    for seed in range(2):
        wrong = np.full(30, errors, dtype=np.int64)
        wrong[:seed] += 1
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
        found.append(ProbeResult(model, "", "linear", [1.0], "train", 0.1, 0.3, 30, 60, seed, "utterance", 2))
    return found


def verdict_results(root: Path) -> tuple[Path, Path]:
    """A probe's results.parquet (utterances.parquet and leaderboard.parquet beside it, as
    downstream_probe writes them) and a fine-tuning results.parquet, both on one held-out speaker."""
    import pyarrow.parquet as pq

    from speech_assets.evaluation import compare
    from speech_assets.evaluation import finetune_results as ft

    results = probe_rows("fbank", 12) + probe_rows("random", 16) + probe_rows("pretrained", 8)
    probe = root / "probe" / "results.parquet"
    probe.parent.mkdir(parents=True)
    pq.write_table(compare.results_table(results), probe)
    pq.write_table(compare.utterances_table(results), ProbeFiles.beside(probe).utterances)
    pq.write_table(compare.leaderboard_table(compare.leaderboard(results, 3), 3), ProbeFiles.beside(probe).leaderboard)
    finetune = root / "finetune" / "results.parquet"
    finetune.parent.mkdir(parents=True)
    pq.write_table(ft.results_table(FINETUNE_ROWS), finetune)
    return probe, finetune


FINETUNE_ROWS = [
    {"model": m, "labelled_minutes": 5.0, "seed": seed, "decoder": "greedy", "split": split, "cer": cer + seed / 100,
     "wer": 1.0, "utterances": 40, "steps": 300, "dev_cer": 0.5, "labelled_seconds": 300.0,
     "checkpoint_sha256": "ab" * 32, "lr": 1e-3, "heldout_speakers": 1, "text_overlap": 0, "oov_rate": 0.2}
    for m, cers in (("pretrained", {"train": 0.2, "heldout": 0.4}), ("scratch", {"train": 0.5, "heldout": 0.8}))
    for split, cer in cers.items()
    for seed in (0, 1, 2)
]  # fmt: skip


HEADER = {
    "built_at": "2024-05-01 10:00:00 UTC",
    "git_commit": "a" * 40,
    "dagster_run_id": "run-1234",
    "corpus": "/corpora/tiny",
    "settings_hash": "b" * 64,
}


def model_runs(out: Path) -> dict:
    """Every kind of model run's folder as its asset leaves it (result.json, and beside it what the
    asset adds: config.json, provenance.json, mlflow_run_id), and an export's JSON."""

    def run(folder: str, result: dict, **files: dict | str) -> Path:
        run_dir = out / folder / f"{folder}-run"
        run_dir.mkdir(parents=True)
        (run_dir / "result.json").write_text(json.dumps(result))
        for name, content in files.items():
            (run_dir / name.replace("_json", ".json")).write_text(
                content if isinstance(content, str) else json.dumps(content)
            )
        return run_dir / "result.json"

    versions = {"manifest": "9" * 64}
    torch_run = {
        "heldout_masked_accuracy": 0.21,
        "heldout_majority_accuracy": 0.05,
        "chance_accuracy": 0.0625,
        "final_loss": 2.345678901234,
        "data_versions": versions,
    }
    centralised = run(
        "training",
        {
            "step": 300,
            "checkpoint": "/d/training/final.pt",
            "checkpoint_sha256": "1" * 64,
            "mlflow_run_id": "c" * 32,
            **torch_run,
        },
        config_json={"preset": "tiny", "git_sha": "a" * 40},
    )
    iteration2 = run(
        "training_iter2",
        {
            "step": 20,
            "checkpoint": "/d/iter2/final.pt",
            "checkpoint_sha256": "2" * 64,
            "mlflow_run_id": "d" * 32,
            **torch_run,
        },
        config_json={"preset": "tiny", "git_sha": "a" * 40},
    )
    distilled = run(
        "distill",
        {
            "step": 40,
            "checkpoint": "/d/distill/final.pt",
            "checkpoint_sha256": "3" * 64,
            "final_loss": 0.5,
            "student": "tiny-student",
            "student_parameters": 100_000,
            "teacher_parameters": 400_000,
            "speedup": 3.456,
            "student_audio_s_per_s": 900.0,
            "teacher_audio_s_per_s": 260.1,
            "mlflow_run_id": "e" * 32,
            "data_versions": versions,
        },
    )
    federated = run(
        "federated",
        {
            "rounds": 3,
            "checkpoint": "/d/federated/final.pt",
            "checkpoint_sha256": "4" * 64,
            "final_train_loss": 3.03368966634272757,
            "heldout_masked_accuracy": 0.03368966634272757,
            "heldout_majority_accuracy": 0.04,
            "round_summaries": [{"round": 1}, {"round": 2}, {"round": 3}],
            "data_versions": versions,
        },
        provenance_json={
            "checkpoint_sha256": "4" * 64,
            "git_sha": "a" * 40,
            "mlflow_run_id": "f" * 32,
            "dagster_run_id": "run-fed",
        },
        settings_json={"preset": "tiny"},
    )
    export = out / "export" / "abc-layer4" / "encoder.json"
    export.parent.mkdir(parents=True)
    export.write_text(
        json.dumps(
            {
                "checkpoint_sha256": "1" * 64,
                "output": {"layer": 4},
                "parity": {"max_abs_diff": 3.2e-6, "torchscript_max_abs_diff": 1.1e-6, "utterances": 8, "frames": 2400},
            }
        )
    )
    return {
        "training_results": [centralised],
        "exports": [export],
        "model_results": {"federated": [federated], "distilled": [distilled], "iteration2": [iteration2]},
    }


@pytest.fixture(scope="module")
def page(database: Path) -> Path:
    extras = report.ReportInputs(
        cluster_counts={"client_00": np.array([50, 30, 10, 5, 3, 1, 1, 0])},
        training_metrics={
            "run1": [{"step": s, "loss": 5 - s / 10, "masked_accuracy": s / 100, "lr": 1e-3} for s in range(10, 60, 10)]
        },
    )
    extras = report.ReportInputs(
        cluster_counts=extras.cluster_counts,
        training_metrics=extras.training_metrics,
        header=HEADER,
        corpus_root=database.parent / "corpus",
        vad=VadConfig(),
        probe_results=database.parent / "probe" / "results.parquet",
    )
    return report.write_report(database, database.parent / "report" / "index.html", extras)


def test_report_is_self_contained_and_shows_its_sql(page: Path) -> None:
    text = page.read_text()
    assert "http://" not in text and "https://" not in text and "<script" not in text  # offline, no CDN, escaped
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert text.count("<img ") >= 5 and text.count("<summary>SQL</summary>") >= 8
    assert "FROM rejects_by_reason" in text and "unreadable" in text and "client_01" in text


def test_report_leads_with_the_verdicts_then_models_then_data_and_folds_raw_rows(page: Path) -> None:
    """Title and first screen: the probe leaderboard and the fine-tuning table with their verdicts,
    built by the functions of the asset metadata and the CLI; then models, data quality, header;
    the per-seed rows folded in ``<details>``. Kills: today's order (a data-quality report with the
    probe's 30 raw rows at the bottom and no leaderboard)."""
    from speech_assets.evaluation.compare import leaderboard_rows, load_leaderboard, reading_note
    from speech_assets.evaluation.finetune_results import verdicts

    text = page.read_text()
    title = re.search(r"<h1>(.*?)</h1>", text).group(1)
    assert "verdicts" in title and "data-quality report" not in title
    order = [
        text.index(h)
        for h in (
            "<h2>Probe leaderboard</h2>",
            "<h2>Fine-tuning against scratch</h2>",
            "<h2>Summary</h2>",
            "<h2>Training runs</h2>",
            "<h2>Federated rounds</h2>",
            "<h2>Corpus</h2>",
            "<h2>Rejects by reason</h2>",
            "<h2>About this report</h2>",
        )
    ]
    assert order == sorted(order)
    probe = text.split("<h2>Probe leaderboard</h2>", 1)[1].split("</section>", 1)[0]
    board, min_speakers = load_leaderboard(page.parent.parent / "probe" / "results.parquet")
    table, raw = probe.split('<details class="raw">', 1)
    for row in leaderboard_rows(board):  # the UI's and the CLI's rows, cell for cell
        assert (
            "".join(f'<td class="nowrap">{html.escape(str(row[c]))}</td>' for c in ("encoder", "normalisation"))
            in table
        )
        assert f'<td class="nowrap">{html.escape(row["CER"])}</td>' in table
        assert f'<td class="nowrap">{row["verdict"]}</td>' in table
    # the caveat once, beside the table; the raw per-seed rows (both splits) folded below it
    assert table.count("indicative only") == 1 and html.escape(reading_note(board, min_speakers)) in table
    assert raw.count("<tr>") == 1 + 12 and "<td>train</td>" in raw and "<td>train</td>" not in table
    finetune = text.split("<h2>Fine-tuning against scratch</h2>", 1)[1].split("</section>", 1)[0]
    shown, folded = finetune.split('<details class="raw">', 1)
    assert html.escape(verdicts(FINETUNE_ROWS, min_heldout_speakers=3)[0]) in shown
    assert "<th>held-out CER</th>" in shown and folded.count("<tr>") == 1 + len(FINETUNE_ROWS)


def test_report_has_a_header_and_a_summary(page: Path) -> None:
    text = page.read_text()
    header = text.split("<h2>About this report</h2>", 1)[1]
    for label, value in (("built at", HEADER["built_at"]), ("Dagster run", "run-1234"), ("corpus", "/corpora/tiny")):
        assert f"<th>{label}</th><td>{value}</td>" in header
    # long hashes shown by their first 12 characters, the full value in the title
    assert f'<th>git commit</th><td><span class="hash" title="{"a" * 40}">{"a" * 12}</span>' in header
    assert f'<th>settings hash</th><td><span class="hash" title="{"b" * 64}">{"b" * 12}</span>' in header
    summary = text.split("<h2>Summary</h2>", 1)[1].split("</section>", 1)[0]
    assert "3 speakers" in summary and "1 held-out speaker" in summary and "7 rejects" in summary
    for line in (
        "centralised model: 300 steps",
        "federated model: 3 rounds",
        "distilled model: 40 steps",
        "iteration2 model: 20 steps",
    ):
        assert line in summary
    assert "3.456x the teacher" in summary and "ONNX max |diff| 3.20e-06" in summary


def test_report_tables_are_rounded_and_list_every_speaker_and_checkpoint(page: Path) -> None:
    text = page.read_text()
    assert "0.03368966634272757" not in text and "2.345678901234" not in text and "1" * 64 + "<" not in text
    speakers = text.split("<h2>Speakers</h2>", 1)[1].split("</section>", 1)[0]
    assert speakers.count("<tr>") == 4  # a header and one row per speaker, with client and split
    assert (
        "<td>s3</td><td>client_01</td><td>heldout</td>" in speakers
        and "<td>s1</td><td>client_00</td><td>train</td>" in speakers
    )
    checkpoints = text.split("<h2>Checkpoints</h2>", 1)[1].split("</section>", 1)[0]
    for kind in ("centralised", "federated", "distilled", "iteration2"):
        assert f"<td>{kind}</td>" in checkpoints
    assert "<td>federated</td><td>3</td><td>round</td>" in checkpoints and "run-fed" in checkpoints
    assert "Export parity" in text and "Distilled student" in text and "<td>3.46</td>" in text
    export = text.split("<h2>Export parity</h2>", 1)[1].split("</section>", 1)[0]
    assert (
        f'title="{"1" * 64}"' in export
        and "<td>4</td><td>3.20e-06</td><td>1.10e-06</td><td>8</td><td>2,400</td>" in export
    )


def test_every_playable_reject_has_an_audio_player_on_a_copied_clip(page: Path) -> None:
    text = page.read_text()
    sources = re.findall(r'<audio controls preload="metadata" src="([^"]+)"></audio>', text)
    assert len(sources) == 3  # no_speech, too_short, too_long; never the unreadable or outside ones
    folder = page.parent / "audio"
    assert sorted(p.name for p in folder.iterdir()) == sorted(Path(src).name for src in sources)
    for src in sources:
        assert re.fullmatch(r"audio/reject-[0-9a-f]{24}\.flac", src)  # a generated name, nothing from the manifest
        info = sf.info(page.parent / src)
        assert info.samplerate == 16_000 and info.channels == 1 and info.duration <= 6.0
    assert sum((page.parent / src).stat().st_size for src in sources) < 400_000
    # the no_speech reject has the VAD's decision drawn over its waveform
    row = text.split("<td>s1-c-9</td>", 1)[1].split("</tr>", 1)[0]
    assert '<img class="vad"' in row and "<audio" in row
    for utt in ("s3-c-8", "s3-c-7", "s3-c-6", "bad-1"):  # outside the corpus (a path, a symlink, ..) or unreadable
        assert "<audio" not in text.split(f"<td>{utt}</td>", 1)[1].split("</tr>", 1)[0]


def test_audio_examples_are_bounded_and_stale_clips_removed(database: Path, tmp_path: Path) -> None:
    from speech_assets.stats.examples import reject_examples, remove_unused

    corpus = database.parent / "corpus"
    rows = [("manifest", "too_long", f"u{i}", str(corpus / "s3" / "c" / "s3-c-9.flac"), "") for i in range(5)]
    shown = reject_examples(rows, corpus, tmp_path, max_examples=2)
    assert [e.clip is not None for e in shown] == [True, True, False, False, False]
    shown = reject_examples(rows, corpus, tmp_path, max_bytes=1)  # the first clip passes the bound: none is copied
    assert all(e.clip is None for e in shown) and "bound" in shown[0].note
    quiet = str(corpus / "s1" / "c" / "s1-c-9.flac")
    original, copy = reject_examples(
        [("vad", "no_speech", "s1-c-9", quiet, ""), ("vad", "no_speech", "s1-c-9-sp1_1", quiet, "")],
        corpus,
        tmp_path,
        VadConfig(),
    )
    assert (
        original.vad_png and copy.clip and copy.vad_png is None and "speed-perturbed" in copy.note
    )  # its decision was on other audio
    (tmp_path / "reject-stale.flac").write_bytes(b"old")
    remove_unused(tmp_path, {e.clip for e in reject_examples(rows[:1], corpus, tmp_path)})
    assert len(list(tmp_path.glob("*.flac"))) == 1


@pytest.mark.slow
def test_report_renders_in_headless_chromium(page: Path, tmp_path: Path) -> None:
    if CHROMIUM is None:
        pytest.skip(
            "LOUD SKIP: Debian's chromium is not installed (make test installs it with apt-get when run as root)"
        )
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
            images = view.evaluate(
                "Array.from(document.images).map(i => [i.complete, i.naturalWidth, i.naturalHeight])"
            )
            # every reject's player has read its clip's header (HAVE_METADATA), or failed
            view.wait_for_function(
                "Array.from(document.querySelectorAll('audio')).every(a => a.readyState >= 1 || a.error)",
                timeout=30_000,
            )
            players = view.evaluate(
                "Array.from(document.querySelectorAll('audio')).map(a => [a.readyState, a.duration, a.error "
                "&& a.error.code])"
            )
            plot_width = view.evaluate(
                "Math.min(...Array.from(document.querySelectorAll('img.plot')).map(i => "
                "i.getBoundingClientRect().width))"
            )
            shot = view.screenshot(full_page=True)
        finally:
            browser.close()
    assert errors == []
    assert len(images) >= 5 and all(done and width > 100 and height > 50 for done, width, height in images)
    assert len(players) == 3 and all(
        state >= 1 and 0 < duration <= 6.0 and error is None for state, duration, error in players
    )
    assert plot_width > 1000  # full width of the 1200-pixel window, not a 500-pixel thumbnail
    pixels = np.asarray(Image.open(io.BytesIO(shot)).convert("L"), dtype=np.float32)
    assert pixels.shape[0] > 900 and pixels.std() > 10  # a blank page would be one flat colour


def test_report_states_the_finetune_indicative_verdict_of_the_cli(tmp_path: Path) -> None:
    """The report's fine-tuning section carries the CLI's verdict lines: a stuck baseline is not
    measured, and one held-out speaker makes the verdict indicative only."""
    import duckdb

    from speech_assets.evaluation.finetune_results import verdicts
    from speech_assets.stats.database import FINETUNE_COLUMNS

    rows = [
        {"model": m, "labelled_minutes": 5.0, "seed": seed, "decoder": "greedy", "split": split, "cer": cer,
         "wer": 1.0, "utterances": 40, "steps": 300, "dev_cer": 0.5, "labelled_seconds": 300.0,
         "checkpoint_sha256": "ab" * 32, "lr": 1e-3, "heldout_speakers": 1, "text_overlap": 0, "oov_rate": 0.2}
        for m, cers in (("pretrained", {"train": 0.2, "heldout": 0.4}), ("scratch", {"train": 1.0, "heldout": 1.0}))
        for split, cer in cers.items()
        for seed in (0, 1)
    ]  # fmt: skip
    with duckdb.connect(str(tmp_path / "db.duckdb")) as con:
        con.execute(f"CREATE TABLE finetune_results ({FINETUNE_COLUMNS})")
        con.executemany(
            f"INSERT INTO finetune_results BY NAME SELECT * FROM (SELECT {', '.join(f'? AS {k}' for k in rows[0])})",
            [list(r.values()) for r in rows],
        )
        block = report._finetune_section(con, report.ReportInputs(min_heldout_speakers=3))
    lines = verdicts(rows, min_heldout_speakers=3)
    assert "baseline did not train" in lines[0] and "indicative only" in lines[0] and "beats" not in lines[0]
    assert html.escape(lines[0]) in block
