"""Stage 5: `finetuned_asr`, CTC fine-tuning against a from-scratch baseline over labelled budgets,
and the recogniser exported for `speech-assets transcribe`.

Runs are planned without Dagster (evaluation/finetune_plan.py); each phase's unfinished runs train in
one torchrun launch (:mod:`speech_assets.defs.torchrun`).
"""

import contextlib
import itertools
import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import dagster as dg
import pyarrow.parquet as pq

from speech_assets.corpus.clients import read_clients
from speech_assets.defs import lineage
from speech_assets.defs.partitions import ALL_SHARDS, CHECKPOINT_ASSETS
from speech_assets.defs.resources import (
    FinetuneSettings,
    PipelineSettings,
    StoragePaths,
    effective,
    overrides_of,
    vad_config,
)
from speech_assets.defs.runs import record_run_process
from speech_assets.defs.torchrun import record_finished, run_folder, run_torchrun, training_curve_metadata
from speech_assets.evaluation.protocol import ProbeLeak
from speech_assets.layout import RecogniserFiles, RunFiles
from speech_assets.locations import git_commit
from speech_assets.utils import (
    atomic_path,
    atomic_write_text,
    from_fields,
    published_folder,
    sha256_file,
    sha256_strings,
)

if TYPE_CHECKING:
    from speech_assets.evaluation.finetune_plan import PlannedRun

FINETUNE_CODE_VERSION = "finetune-v3"  # v2: dev selection, lr grid (issue 44); v3: dev evaluated in the background


FinetuneOverrides = overrides_of(FinetuneSettings)


@dg.asset(
    group_name="evaluation",
    deps=[*CHECKPOINT_ASSETS.values(), "manifest", "client_partitions", ALL_SHARDS],
    code_version=FINETUNE_CODE_VERSION,
    pool="training",
    kinds={"pytorch", "onnx", "mlflow"},
)
def finetuned_asr(
    context: dg.AssetExecutionContext,
    config: FinetuneOverrides,
    paths: StoragePaths,
    settings: PipelineSettings,
    pipes_subprocess_client: dg.PipesSubprocessClient,
) -> dg.MaterializeResult:
    """CTC fine-tuning on characters of each encoder and of the same architecture from scratch, on
    the same seeded labelled subset of training speakers per budget (`labelled_minutes`) and seed;
    greedy (and n-gram beam, when installed) CER/WER on the held-out speakers:
    `<data>/finetune/results.parquet`. No labelled or dev sentence is a held-out one; the dev set
    (`dev_speakers`, never labelled) selects each run's step and each model's peak lr of `lr_grid`
    (tried at the smallest budget and first seed). The pretrained recogniser at the largest budget
    exports to ONNX: `<data>/finetune/recogniser/` (what `speech-assets transcribe` uses)."""
    from speech_assets.evaluation import finetune_plan as planning
    from speech_assets.evaluation import finetune_results as results

    options = effective(settings.finetune, config)
    record_run_process(context)
    try:
        plan = planning.plan_finetune(
            options,
            pretrained=lineage.required_checkpoint(context, "pretrained_checkpoint"),
            checkpoint_of=lambda name: lineage.checkpoint_of(context, CHECKPOINT_ASSETS[name]),
            encoder_assets=CHECKPOINT_ASSETS,
            clients=lambda: read_clients(paths.layout.clients_file),
            manifest_file=paths.layout.manifest.manifest,
            shard_file=paths.shard_file,
            data_versions=lambda speakers: (
                lineage.latest_versions(context.instance, ["manifest", "client_partitions"])
                | {f"vad_features/{s}": v for s, v in lineage.shard_hashes(paths, speakers).items()}
            ),
            log=context.log.info,
            warn=context.log.warning,
        )
        # phase 1: every model tries each lr of the grid at the smallest budget, first seed; the lowest dev CER wins
        folders = _run_all(context, pipes_subprocess_client, paths, options, plan.tuning, plan.base_versions)
        tuned = dict(zip((run.lr_key for run in plan.tuning), folders, strict=True))
        chosen, dev_cers = planning.choose_lrs(tuned) if tuned else (plan.untuned(), {})
        context.log.info(f"peak lr chosen on the dev set: {chosen}")
        # phase 2: every budget and seed with the chosen lr (the tuning run of that lr is one of them, reused)
        final = plan.final_runs(chosen, context.log.warning)
        folders = _run_all(context, pipes_subprocess_client, paths, options, final, plan.base_versions)
        planned = dict(zip((run.key for run in final), folders, strict=True))
        rows, runs = planning.collect_results(planned)
    except (planning.FinetuneRefused, ProbeLeak) as error:
        raise dg.Failure(description=str(error)) from error
    target = paths.layout.finetune.results
    with atomic_path(target) as tmp:
        pq.write_table(results.results_table(rows), tmp)
    first, largest, seed = plan.recogniser_key
    chosen_run = runs[plan.recogniser_key]
    exported = _export(context, paths, chosen_run, plan.pool.heldout_texts, settings)
    lines = results.verdicts(rows, min_heldout_speakers=settings.probe.min_heldout_speakers)
    for line in lines:
        context.log.info(line)
    overlap = planning.text_overlap(runs)
    context.log.info(
        f"text overlap with the held-out sentences: {overlap} labelled/dev utterances "
        f"({plan.pool.overlap_dropped} dropped when planning); held-out OOV rate: {results.oov_by_budget(rows)}"
    )
    files = {target.name: sha256_file(target), **{f"recogniser/{k}": v for k, v in exported["files"].items()}}
    mlflow = exported["mlflow"]
    unused = {key: folder for key, folder in tuned.items() if folder not in planned.values()}  # lrs not chosen
    return dg.MaterializeResult(
        data_version=dg.DataVersion(sha256_strings(f"{k}:{v}" for k, v in sorted(files.items()))),
        metadata={
            # the UI shows metadata in this order: the verdict and the curves first, then the tables
            "verdict": dg.MetadataValue.md(results.verdict_markdown(lines)),
            **_wer_curve(rows),
            **training_curve_metadata(Path(chosen_run["checkpoint"]).parent),  # the exported recogniser's run
            "results": dg.MetadataValue.md(
                results.markdown_tables(rows, results.probe_reference(paths.layout.probe.results))
            ),
            "text": dg.MetadataValue.md("\n".join(f"- {note}" for note in results.text_notes(rows))),
            "results_file": dg.MetadataValue.path(str(target)),
            "recogniser": dg.MetadataValue.path(str(RecogniserFiles(exported["folder"]).onnx)),
            "recogniser_model": f"{first}, {largest:g} min, seed {seed}",
            "max_abs_diff": exported["max_abs_diff"],
            **({"mlflow_model": mlflow["model_uri"], "registered_model": mlflow["registered_uri"]} if mlflow else {}),
            "decoders": dg.MetadataValue.json(plan.decoders),
            **({"beam_decoder": f"unavailable: {plan.missing_decoder}"} if plan.missing_decoder else {}),
            "labelled_minutes": dg.MetadataValue.json(plan.budgets),
            "seeds": dg.MetadataValue.json(plan.seeds),
            "lr_grid": dg.MetadataValue.md(planning.lr_table(plan.lrs, chosen, dev_cers)),
            "lr_chosen": dg.MetadataValue.json(chosen),
            "text_overlap": overlap,  # labelled and dev utterances whose sentence is a held-out one: must be 0
            "overlap_dropped": plan.pool.overlap_dropped,
            "heldout_oov_rate": dg.MetadataValue.json(results.oov_by_budget(rows)),
            "dev_speakers": dg.MetadataValue.json(plan.pool.dev_speakers[:50]),
            "dev_utterances": len(plan.pool.dev_texts),
            "heldout_utterances": len(plan.pool.heldout_texts),
            "heldout_speakers": dg.MetadataValue.json(plan.pool.test_speakers[:50]),
            "available_labelled_minutes": round(plan.pool.available_minutes, 2),
            "run_dirs": dg.MetadataValue.json(
                {f"{m}/{b:g}min/seed{s}": str(Path(r["checkpoint"]).parent) for (m, b, s), r in runs.items()}
                | {f"{m}/lr{lr:g}": str(folder) for (m, lr), folder in unused.items()}
            ),
            "input_versions": dg.MetadataValue.json(
                lineage.bounded_versions(
                    {**{CHECKPOINT_ASSETS[n]: v for n, (_, v) in plan.encoders.items()}, **plan.base_versions}
                )
            ),
        },
    )


def _run_all(
    context, client, paths: StoragePaths, options: FinetuneSettings, runs: "list[PlannedRun]", versions: dict
) -> list[Path]:
    """The folder of each of ``runs``, those not finished before trained in one launch."""
    folders = [_plan(context, paths, options, run) for run in runs]
    if pending := list(dict.fromkeys(run_dir for run_dir, done in folders if not done)):
        _train(context, client, paths, options, pending, versions)
    return [run_dir for run_dir, _ in folders]


def _plan(context, paths: StoragePaths, options: FinetuneSettings, run: "PlannedRun") -> tuple[Path, bool]:
    """(the folder of ``run``, whether it finished before); writes its labelled utterances and config unless it did."""
    from speech_assets.evaluation.finetune import finished_result
    from speech_assets.train.config import FinetuneConfig

    job = options.model_copy(update=run.settings)
    run_dir = run_folder(paths.layout.finetune.runs, run.versions, job, FINETUNE_CODE_VERSION)
    if finished_result(run_dir) is not None:
        context.log.info(f"{run.model}, {run.minutes:g} min, seed {run.seed}, lr {run.lr:g}: done before in {run_dir}")
        return run_dir, True
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(RunFiles(run_dir).labelled, run.labelled_text)
    config = from_fields(  # from the run's own settings: its lr, and for scratch no freezing
        FinetuneConfig,
        job,
        run_dir=str(run_dir),
        shards=[str(paths.shard_file(s)) for s in run.shard_speakers],
        cmvn=str(paths.layout.cmvn.cmvn),
        clients={},
        encoder=run.encoder,
        labelled=str(RunFiles(run_dir).labelled),
        init=run.init,
        budget_minutes=run.minutes,
        seed=run.seed,
        data_versions=run.versions,
        git_sha=git_commit(),
        threads=options.threads or None,
        mlflow_tracking_uri=paths.mlflow_tracking_uri,
        mlflow_artifact_location=paths.mlflow_artifact_location,
        mlflow_run_name=f"finetune-{run.model}-{run.minutes:g}min-s{run.seed}-lr{run.lr:g}-{run_dir.name}",
        dagster_run_id=context.run.run_id,
    )
    config.to_json(RunFiles(run_dir).config)
    context.log.info(
        f"to fine-tune: {run.model} on {len(run.labelled['train'])} labelled utterances ({run.minutes:g} min "
        f"budget), seed {run.seed}, peak lr {run.lr:g}"
    )
    return run_dir, False


def _train(
    context, client, paths: StoragePaths, options: FinetuneSettings, run_dirs: list[Path], data_versions: dict[str, str]
) -> None:
    """Train ``run_dirs`` in one torchrun launch: one start-up of the workers, imports and data for all.
    Each run folder is held as a lone launch holds it."""
    import torch

    from speech_assets.train import launch
    from speech_assets.train.autoconfig import available_cores
    from speech_assets.train.config import FinetuneBatch

    nproc, parallel = options.nproc or 1, False
    if nproc == 1:
        at_once = options.parallel_runs or (1 if torch.cuda.is_available() else available_cores())
        nproc = max(1, min(at_once, len(run_dirs)))
        parallel = nproc > 1
    batch_dir = paths.layout.finetune.batches / sha256_strings([str(d) for d in run_dirs])[:16]
    batch = FinetuneBatch(
        run_dir=str(batch_dir),
        runs=[str(d) for d in run_dirs],
        batch_seconds=options.batch_seconds,
        parallel=parallel,
        git_sha=git_commit(),
    )
    context.log.info(
        f"fine-tuning {len(run_dirs)} run(s) in one launch ({batch_dir}): "
        + (f"{nproc} at once, one process each" if parallel else f"one after another, {nproc} process(es) each")
    )
    with contextlib.ExitStack() as held:
        for run_dir in run_dirs:
            held.enter_context(
                launch.launching(run_dir, dagster_run_id=context.run.run_id, command="dagster asset finetuned_asr")
            )
        run_torchrun(
            context,
            client,
            paths,
            batch_dir,
            batch,
            data_versions,
            nproc=nproc,
            module="speech_assets.evaluation.finetune",
        )
    for run_dir in run_dirs:
        record_finished(run_dir, batch.git_sha, context.run.run_id)


def _export(context, paths: StoragePaths, result: dict, heldout_texts: dict, settings: PipelineSettings) -> dict:
    """The recogniser of ``result``'s checkpoint as ONNX and TorchScript with recogniser.json, in
    <data>/finetune/recogniser/ (replaced whole, never half written); parity on held-out utterances."""
    from speech_assets.corpus.manifest import read_manifest
    from speech_assets.evaluation import decoding
    from speech_assets.evaluation.recognise import audio_parity, vocabulary
    from speech_assets.features.cmvn import describe, from_record
    from speech_assets.features.featurize import FeatureExtractor
    from speech_assets.features.shards import iter_shard
    from speech_assets.model.encoders import load_encoder
    from speech_assets.model.export import RECOGNISER_OUTPUT_NAMES, export_recogniser
    from speech_assets.train import tracking

    loaded = load_encoder(result["checkpoint"])
    cmvn = from_record(loaded.checkpoint.get("normalisation"))
    heldout = (
        record
        for speaker in loaded.checkpoint["speakers"]["heldout"]
        for record in iter_shard(paths.shard_file(speaker), features=("logmel",))
        if record.utt_id in heldout_texts and record.logmel is not None and record.num_frames >= 2
    )
    chosen = list(itertools.islice(heldout, settings.export.parity_utterances))
    feats = [cmvn.apply(record.logmel, "logmel") for record in chosen]
    folder = paths.layout.finetune.recogniser
    with published_folder(folder) as staging:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            parity = export_recogniser(loaded.model, staging, feats, settings.export.opset or None, cmvn)
        vad = vad_config(settings.features)
        spec = {
            "inputs": {
                "feats": "float32 (batch, time, 80): log-mel at 100 Hz of 16 kHz mono audio (peak-normalised, "
                "VAD-trimmed), CMVN applied",
                "lengths": "int64 (batch,): valid frames per row",
            },
            "outputs": {
                "log_probs": "float32 (batch, (time + 1) // 2, 29): CTC log-probabilities, padded frames 0",
                "output_lengths": "int64 (batch,)",
                "frame_rate_hz": 50,
            },
            "frontend": {
                "inputs": {"audio": "float32 (batch, samples): 16 kHz mono, peak-normalised", "audio_lengths": "int64"},
                "outputs": "feats, lengths: the recogniser's inputs",
            },
            "featurisation": {"feature": "logmel", **FeatureExtractor().describe(), "vad": vad.as_dict()},
            "cmvn": describe(cmvn),
            "vocabulary": vocabulary(),
            "blank": 0,
            "decoding": "greedy: per-frame argmax, merge repeats, drop blanks; beam: lexicon beam search, n-gram LM",
            "files": {
                "onnx": RecogniserFiles.onnx.name,
                "torchscript": RecogniserFiles.torch.name,
                "frontend": RecogniserFiles.frontend.name,
            },
            "checkpoint": result["checkpoint"],
            "checkpoint_sha256": loaded.sha256,
            "init": result["init"],
            "labelled_seconds": result["labelled_seconds"],
            "heldout_cer": result.get("heldout_cer"),
            "heldout_wer": result.get("heldout_wer"),
            "preset": loaded.model.preset.to_dict(),
            "parity": parity.record(),
        }
        trained = loaded.checkpoint.get("config") or {}
        if any(d != "greedy" for d in trained.get("decoders", [])) and decoding.unavailable() is None:
            # the beam decoder of `transcribe --decoder beam`: the exported run's labelled transcripts only
            labelled = RunFiles(Path(result["checkpoint"]).parent).labelled
            texts = json.loads(labelled.read_text(encoding="utf-8"))
            spec["beam"] = decoding.write_lm_files(list(texts["train"].values()), trained["lm_order"], staging)
            if "beam" in result:  # the weights the run chose on its dev set
                spec["beam"] |= {key: result["beam"][key] for key in ("lm_weight", "word_score")}
        card = RecogniserFiles(staging).card
        atomic_write_text(card, json.dumps(spec, indent=2, sort_keys=True) + "\n")
        # the same held-out utterances from their audio files: frontend.onnx + recogniser.onnx against the pipeline
        audio = {row.utt_id: row.path for row in read_manifest(paths.layout.manifest.manifest)}
        used = [audio[r.utt_id] for r in chosen if r.utt_id in audio]
        spec["audio_parity"] = audio_parity(staging, loaded.model, cmvn, used)
        atomic_write_text(card, json.dumps(spec, indent=2, sort_keys=True) + "\n")
    context.log.info(
        f"recogniser exported to {folder}: ONNX max |diff| {parity.onnx_max_abs_diff:.2e} on "
        f"{parity.utterances} held-out utterances"
    )
    beam = [folder / spec["beam"][key] for key in ("lm", "lexicon")] if "beam" in spec else []
    exported = RecogniserFiles(folder)
    files = {path.name: sha256_file(path) for path in (*exported.published, exported.frontend, *beam)}
    # in its fine-tuning run, registered as a new version of speech_assets_recogniser; {} when it cannot be logged
    model = tracking.log_exported_model(
        paths.mlflow_tracking_uri,
        result["checkpoint"],
        loaded.checkpoint,
        exported.onnx,
        [exported.card, exported.frontend, *beam],
        context.log.warning,
        name=tracking.RECOGNISER_MODEL,
        signature=tracking.export_signature(len(vocabulary()), RECOGNISER_OUTPUT_NAMES),
        tags={"checkpoint_sha256": loaded.sha256},
        registered_name=tracking.RECOGNISER_REGISTERED_NAME,
    )
    if model.get("registered_uri"):
        context.log.info(f"recogniser registered in MLflow as {model['registered_uri']} (run {model['run_id']})")
    return {"folder": folder, "files": files, "max_abs_diff": parity.onnx_max_abs_diff, "mlflow": model}


def _wer_curve(rows: list[dict]) -> dict[str, object]:
    """The papers' figure: mean held-out greedy WER against labelled minutes, one line per model."""
    from speech_assets.evaluation.finetune_results import wer_by_budget
    from speech_assets.stats import plots

    budgets, series = wer_by_budget(rows)
    if len(budgets) < 2:
        return {}

    png = plots.curves(budgets, series, "held-out WER (greedy) against labelled minutes", "labelled minutes")
    return {"wer_curve": dg.MetadataValue.md(plots.markdown_image(png, "WER against labelled minutes"))}
