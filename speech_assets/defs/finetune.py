"""Stage 5: from pretrained encoder to speech recogniser: `finetuned_asr`, CTC fine-tuning against a
from-scratch baseline over labelled budgets, and the recogniser exported for `speech-assets transcribe`.

Each (model, labelled budget, seed) is one run of the fine-tuning worker
(speech_assets/evaluation/finetune.py), in its own run folder; the runs not finished before train
in a single launch (on a CPU several at once, a process each), like every training loop (torchrun
through Pipes, :mod:`speech_assets.defs.torchrun`); torch is imported inside the asset.
"""

import contextlib
import json
import shutil
import tempfile
import warnings
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq

from speech_assets.corpus.clients import read_clients
from speech_assets.defs.lineage import (
    bounded_versions,
    checkpoint_of,
    git_commit,
    latest_data_version,
    record_provenance,
    required_checkpoint,
    shard_hashes,
)
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
from speech_assets.defs.torchrun import run_folder, run_torchrun, training_curve_metadata
from speech_assets.evaluation.protocol import ProbeLeak, probe_split
from speech_assets.layout import RECOGNISER_ONNX, RECOGNISER_PT, FinetuneFiles, RecogniserFiles, RunFiles
from speech_assets.utils import atomic_path, atomic_write_text, from_fields, publish_folder, sha256_file, sha256_strings

FINETUNE_CODE_VERSION = "finetune-v1"
ENCODER_ASSETS = CHECKPOINT_ASSETS  # every encoder it may fine-tune


class FinetuneOverrides(overrides_of(FinetuneSettings)):
    """Run-config overrides of the `[finetune]` settings for one manual run."""


@dg.asset(
    group_name="evaluation",
    deps=[*ENCODER_ASSETS.values(), "manifest", "client_partitions", ALL_SHARDS],
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
    """CTC fine-tuning on characters (the probe's 29 tokens, a linear head on the last layer) of
    each encoder and of the same architecture from scratch, on the same seeded labelled subset of
    the training speakers per budget (`labelled_minutes`) and seed; greedy (and n-gram beam, when
    installed) CER/WER on the held-out speakers: <data>/finetune/results.parquet. The pretrained
    recogniser at the largest budget exports to ONNX with its featurisation, CMVN, vocabulary and
    parity: <data>/finetune/recogniser/ (what `speech-assets transcribe` uses)."""
    from speech_assets.evaluation import decoding
    from speech_assets.evaluation.finetune import finished_result, labelled_subset
    from speech_assets.evaluation.finetune_results import SCRATCH, markdown_tables, results_table, verdicts

    options = effective(settings.finetune, config)
    record_run_process(context)
    encoders = {"pretrained": required_checkpoint(context, "pretrained_checkpoint")}
    for name in options.encoders:
        if name not in ENCODER_ASSETS:
            raise dg.Failure(description=f"[finetune] encoders: unknown {name!r}; known: {sorted(ENCODER_ASSETS)}")
        if name not in encoders and (found := checkpoint_of(context, ENCODER_ASSETS[name])) is not None:
            encoders[name] = found
    encoders = {name: encoders[name] for name in options.encoders if name in encoders} or {
        "pretrained": encoders["pretrained"]
    }
    table = read_clients(paths.clients_file)
    try:
        train_speakers, test_speakers = probe_split(
            table, {name: _speakers(path) for name, (path, _) in encoders.items()}
        )
    except ProbeLeak as error:
        raise dg.Failure(description=str(error)) from error
    candidates, heldout_texts, transcripts, skipped = _utterances(paths, train_speakers, test_speakers, options)
    if not candidates or not heldout_texts:
        raise dg.Failure(
            description=f"nothing to fine-tune on: {len(candidates)} labellable training utterances, "
            f"{len(heldout_texts)} held-out"
        )
    available = sum(c.seconds for c in candidates) / 60
    context.log.info(
        f"{len(candidates)} transcribed utterances ({available:.1f} min) of {len(train_speakers)} training "
        f"speakers to label from"
        f" ({skipped} too long or too short for CTC), {len(heldout_texts)} held-out utterances of "
        f"{len(test_speakers)} speakers"
    )
    decoders = ["greedy"]
    missing_decoder = decoding.unavailable() if any(d != "greedy" for d in options.decoders) else None
    if any(d != "greedy" for d in options.decoders):
        if missing_decoder:
            context.log.warning(f"beam decoding skipped: {missing_decoder}; greedy only")
        else:
            decoders.append("beam")
    base_versions = {
        "manifest": latest_data_version(context.instance, "manifest") or "",
        "client_partitions": latest_data_version(context.instance, "client_partitions") or "",
        **{
            f"vad_features/{s}": v
            for s, v in shard_hashes(paths, sorted(set(train_speakers) | set(test_speakers))).items()
        },
    }
    root = paths.finetune.root
    budgets = sorted(set(float(m) for m in options.labelled_minutes))
    planned: dict[tuple[str, float, int], Path] = {}
    for minutes in budgets:
        for seed in options.seeds:
            subset = labelled_subset(candidates, test_speakers, minutes, seed)
            labelled = {"train": {u: transcripts[u] for u in subset}, "heldout": heldout_texts}
            seconds = sum(c.seconds for c in candidates if c.utt_id in set(subset))
            if seconds < minutes * 60:
                context.log.warning(
                    f"{minutes:g} min asked, {seconds / 60:.1f} min of training speakers' audio available: "
                    f"using all of it"
                )
            for model in [*encoders, SCRATCH]:
                path, version = encoders["pretrained"] if model == SCRATCH else encoders[model]
                planned[(model, minutes, seed)] = _plan(
                    context,
                    paths,
                    root,
                    options,
                    model,
                    minutes,
                    seed,
                    path,
                    {ENCODER_ASSETS.get(model, "pretrained_checkpoint"): version, **base_versions},
                    labelled,
                    decoders,
                )
    pending = list(dict.fromkeys(run_dir for run_dir in planned.values() if finished_result(run_dir) is None))
    if pending:
        _train(context, pipes_subprocess_client, paths, root, options, pending, base_versions)
    rows, runs = [], {}
    for (model, minutes, seed), run_dir in planned.items():
        result = finished_result(run_dir)
        if result is None:
            raise dg.Failure(description=f"{model}, {minutes:g} min, seed {seed}: no result in {run_dir}")
        runs[(model, minutes, seed)] = result
        rows += [
            {
                "model": model,
                "labelled_minutes": minutes,
                "seed": seed,
                **score,
                "steps": result["step"],
                "labelled_seconds": result["labelled_seconds"],
                "checkpoint_sha256": result["checkpoint_sha256"],
            }
            for score in result["scores"]
        ]
    target = paths.finetune.results
    with atomic_path(target) as tmp:
        pq.write_table(results_table(rows), tmp)
    first = next(iter(encoders))
    chosen = runs[(first, budgets[-1], options.seeds[0])]
    exported = _export(context, paths, chosen, heldout_texts, settings)
    lines = verdicts(rows)
    for line in lines:
        context.log.info(line)
    files = {target.name: sha256_file(target), **{f"recogniser/{k}": v for k, v in exported["files"].items()}}
    return dg.MaterializeResult(
        data_version=dg.DataVersion(sha256_strings(f"{k}:{v}" for k, v in sorted(files.items()))),
        metadata={
            "verdict": dg.MetadataValue.md("\n".join(f"- {line}" for line in lines)),
            "results": dg.MetadataValue.md(markdown_tables(rows, _probe_reference(paths))),
            "results_file": dg.MetadataValue.path(str(target)),
            **_wer_curve(rows),
            **training_curve_metadata(Path(chosen["checkpoint"]).parent),  # the exported recogniser's run
            "recogniser": dg.MetadataValue.path(str(RecogniserFiles(exported["folder"]).onnx)),
            "recogniser_model": f"{first}, {budgets[-1]:g} min, seed {options.seeds[0]}",
            "max_abs_diff": exported["max_abs_diff"],
            "decoders": dg.MetadataValue.json(decoders),
            **({"beam_decoder": f"unavailable: {missing_decoder}"} if missing_decoder else {}),
            "labelled_minutes": dg.MetadataValue.json(budgets),
            "seeds": dg.MetadataValue.json(list(options.seeds)),
            "heldout_utterances": len(heldout_texts),
            "heldout_speakers": dg.MetadataValue.json(test_speakers[:50]),
            "available_labelled_minutes": round(available, 2),
            "run_dirs": dg.MetadataValue.json(
                {f"{m}/{b:g}min/seed{s}": str(Path(r["checkpoint"]).parent) for (m, b, s), r in runs.items()}
            ),
            "input_versions": dg.MetadataValue.json(
                bounded_versions({**{ENCODER_ASSETS[n]: v for n, (_, v) in encoders.items()}, **base_versions})
            ),
        },
    )


def _speakers(checkpoint: str) -> dict | None:
    import torch

    return torch.load(checkpoint, map_location="cpu", weights_only=True).get("speakers")


def _utterances(paths: StoragePaths, train_speakers: list[str], test_speakers: list[str], options: FinetuneSettings):
    """(labelling candidates of the training speakers, ``{utt_id: text}`` of the scored held-out
    utterances, every transcript, how many transcribed utterances CTC cannot use)."""
    from speech_assets.evaluation.finetune import Candidate, ctc_feasible
    from speech_assets.evaluation.probe import subsample
    from speech_assets.evaluation.text import normalise
    from speech_assets.features.shards import read_shard_table

    manifest = pq.read_table(paths.manifest_file, columns=["utt_id", "transcript"])
    texts = {
        u: normalise(t or "")
        for u, t in zip(manifest.column("utt_id").to_pylist(), manifest.column("transcript").to_pylist(), strict=True)
    }
    candidates, heldout, skipped = [], [], 0
    for speaker in sorted(set(train_speakers) | set(test_speakers)):
        shard = read_shard_table(paths.shard_file(speaker), columns=["utt_id", "num_frames"]).to_pylist()
        for row in shard:
            text = texts.get(row["utt_id"], "")
            if not text:
                continue
            if not (ctc_feasible(row["num_frames"], text) and row["num_frames"] <= options.max_frames):
                skipped += 1
                continue
            if speaker in test_speakers:
                heldout.append(row["utt_id"])
            else:
                candidates.append(Candidate(row["utt_id"], speaker, row["num_frames"] / 100.0))
    heldout = sorted(heldout)
    chosen = [heldout[i] for i in subsample(len(heldout), options.max_eval_utterances, seed=0)]
    return candidates, {u: texts[u] for u in chosen}, texts, skipped


def _plan(
    context,
    paths: StoragePaths,
    root: Path,
    options: FinetuneSettings,
    model: str,
    minutes: float,
    seed: int,
    encoder: str,
    data_versions: dict[str, str],
    labelled: dict,
    decoders: list[str],
) -> Path:
    """One fine-tuning run's folder (named by its inputs and settings), with its labelled
    utterances and config written unless it finished before."""
    from speech_assets.evaluation.finetune import finished_result
    from speech_assets.train.config import FinetuneConfig

    job = options.model_copy(  # how many runs train at once does not name a run: parallel_runs 0
        update={
            "labelled_minutes": [minutes],
            "seeds": [seed],
            "encoders": [model],
            "decoders": decoders,
            "parallel_runs": 0,
        }
    )
    labelled_text = json.dumps(labelled, indent=1, sort_keys=True)
    versions = {**data_versions, "labelled": sha256_strings([labelled_text])}
    run_dir = run_folder(FinetuneFiles(root).runs, versions, job, FINETUNE_CODE_VERSION)
    if finished_result(run_dir) is not None:
        context.log.info(f"{model}, {minutes:g} min, seed {seed}: done before in {run_dir}")
        return run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(RunFiles(run_dir).labelled, labelled_text)
    shard_speakers = sorted({k.split("/", 1)[1] for k in data_versions if k.startswith("vad_features/")})
    config = from_fields(
        FinetuneConfig,
        options,
        run_dir=str(run_dir),
        shards=[str(paths.shard_file(s)) for s in shard_speakers],
        cmvn=str(paths.cmvn.cmvn),
        clients={},
        encoder=encoder,
        labelled=str(RunFiles(run_dir).labelled),
        init="scratch" if model == "scratch" else "pretrained",
        seed=seed,
        data_versions=versions,
        git_sha=git_commit(),
        decoders=decoders,
        threads=options.threads or None,
        max_frames=options.max_frames,
        mlflow_tracking_uri=paths.mlflow_tracking_uri,
        mlflow_artifact_location=paths.mlflow_artifact_location,
        mlflow_run_name=f"finetune-{model}-{minutes:g}min-s{seed}-{run_dir.name}",
        dagster_run_id=context.run.run_id,
    )
    config.to_json(RunFiles(run_dir).config)
    context.log.info(
        f"to fine-tune: {model} on {len(labelled['train'])} labelled utterances ({minutes:g} min budget), seed {seed}"
    )
    return run_dir


def _train(
    context,
    client,
    paths: StoragePaths,
    root: Path,
    options: FinetuneSettings,
    run_dirs: list[Path],
    data_versions: dict[str, str],
) -> None:
    """Train the runs of ``run_dirs`` (planned by :func:`_plan`) one after another in one torchrun
    launch (:class:`~speech_assets.train.config.FinetuneBatch`): one start-up of the workers, the
    imports and the data for all of them. Each run folder is held as a lone launch holds it."""
    import torch

    from speech_assets.evaluation.finetune import finished_result
    from speech_assets.train import launch
    from speech_assets.train.autoconfig import available_cores
    from speech_assets.train.config import FinetuneBatch

    nproc, parallel = options.nproc or 1, False
    if nproc == 1:
        at_once = options.parallel_runs or (1 if torch.cuda.is_available() else available_cores())
        nproc = max(1, min(at_once, len(run_dirs)))
        parallel = nproc > 1
    batch_dir = FinetuneFiles(root).batches / sha256_strings([str(d) for d in run_dirs])[:16]
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
            asset_name="finetuned_asr",
            nproc=nproc,
            module="speech_assets.evaluation.finetune",
        )
    for run_dir in run_dirs:
        if (result := finished_result(run_dir)) is not None:
            record_provenance(
                run_dir,
                result["checkpoint_sha256"],
                git_sha=batch.git_sha,
                mlflow_run_id=result.get("mlflow_run_id"),
                dagster_run_id=context.run.run_id,
            )


def _export(context, paths: StoragePaths, result: dict, heldout_texts: dict, settings: PipelineSettings) -> dict:
    """The recogniser of ``result``'s checkpoint as ONNX and TorchScript with recogniser.json, in
    <data>/finetune/recogniser/ (replaced whole, never half written); parity on held-out utterances."""
    from speech_assets.evaluation import decoding
    from speech_assets.evaluation.recognise import vocabulary
    from speech_assets.features.cmvn import describe, from_record
    from speech_assets.features.featurize import FeatureExtractor
    from speech_assets.features.shards import iter_shard
    from speech_assets.model.encoders import load_encoder
    from speech_assets.model.export import export_recogniser

    loaded = load_encoder(result["checkpoint"])
    cmvn = from_record(loaded.checkpoint.get("normalisation"))
    speakers = loaded.checkpoint["speakers"]["heldout"]
    feats = []
    for speaker in speakers:
        for record in iter_shard(paths.shard_file(speaker), features=("logmel",)):
            if (
                record.utt_id in heldout_texts
                and record.logmel is not None
                and record.num_frames >= 2
                and len(feats) < settings.export.parity_utterances
            ):
                feats.append(cmvn.apply(record.logmel, "logmel"))
    folder = paths.finetune.recogniser
    staging = Path(tempfile.mkdtemp(prefix=".recogniser.", dir=folder.parent))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            parity = export_recogniser(loaded.model, staging, feats, settings.export.opset or None)
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
            },
            "featurisation": {"feature": "logmel", **FeatureExtractor().describe(), "vad": vad.as_dict()},
            "cmvn": describe(cmvn),
            "vocabulary": vocabulary(),
            "blank": 0,
            "decoding": "greedy: per-frame argmax, merge repeats, drop blanks; beam: lexicon beam search, n-gram LM",
            "files": {"onnx": RECOGNISER_ONNX, "torchscript": RECOGNISER_PT},
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
        atomic_write_text(RecogniserFiles(staging).card, json.dumps(spec, indent=2, sort_keys=True) + "\n")
        publish_folder(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    context.log.info(
        f"recogniser exported to {folder}: ONNX max |diff| {parity.onnx_max_abs_diff:.2e} on "
        f"{parity.utterances} held-out utterances"
    )
    beam = [folder / spec["beam"][key] for key in ("lm", "lexicon")] if "beam" in spec else []
    files = {path.name: sha256_file(path) for path in (*RecogniserFiles(folder).published, *beam)}
    return {"folder": folder, "files": files, "max_abs_diff": parity.onnx_max_abs_diff}


def _probe_reference(paths: StoragePaths) -> dict[str, str]:
    """The frozen probe's held-out CER (mean ± std) of pretrained and fbank, if it has run."""
    from speech_assets.evaluation.compare import read_results, summarise

    path = paths.probe.results
    if not path.is_file():
        return {}
    try:
        held = summarise(read_results(path))
    except ValueError:
        return {}
    return {name: str(held[name].cer) for name in ("pretrained", "fbank") if name in held}


def _wer_curve(rows: list[dict]) -> dict[str, object]:
    """The papers' figure: mean held-out greedy WER against labelled minutes, one line per model."""
    from speech_assets.evaluation.finetune_results import wer_by_budget

    budgets, series = wer_by_budget(rows)
    if len(budgets) < 2:
        return {}
    from speech_assets.stats import plots

    png = plots.curves(budgets, series, "held-out WER (greedy) against labelled minutes", "labelled minutes")
    return {"wer_curve": dg.MetadataValue.md(plots.markdown_image(png, "WER against labelled minutes"))}
