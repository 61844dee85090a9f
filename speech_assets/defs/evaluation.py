"""Stage 5: what the encoder is worth (`downstream_probe`), the encoder for deployment
(`encoder_export`) and a small student distilled from it (`distilled_checkpoint`).

The ML lives in speech_assets/evaluation/; torch, onnx and jiwer are imported inside the assets.
"""

import json
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq

from speech_assets import locations
from speech_assets.corpus.clients import read_clients
from speech_assets.defs.lineage import bounded_versions, git_commit, input_versions, latest_data_version, latest_materialization
from speech_assets.defs.resources import (
    DistillSettings,
    ExportSettings,
    PipelineSettings,
    ProbeSettings,
    StoragePaths,
    effective,
    overrides_of,
)
from speech_assets.defs.runs import record_run_process
from speech_assets.defs.training import TRAINING_INPUTS, training_curve_metadata
from speech_assets.utils import atomic_path, atomic_write_text, current_umask, sha256_file, sha256_strings

PROBE_CODE_VERSION = "probe-v1"
EXPORT_CODE_VERSION = "export-v1"
DISTILL_CODE_VERSION = "distill-v1"
# an exported encoder whose ONNX output differs from PyTorch's by more than this (fp32) fails its check
ONNX_PARITY_ATOL = 1e-4


class ProbeOverrides(overrides_of(ProbeSettings)):
    """Run-config overrides of the `[probe]` settings for one manual run."""


class ExportOverrides(overrides_of(ExportSettings)):
    """Run-config overrides of the `[export]` settings for one manual run."""


class DistillOverrides(overrides_of(DistillSettings)):
    """Run-config overrides of the `[distill]` settings for one manual run."""


def checkpoint_of(context: dg.AssetExecutionContext, asset: str) -> tuple[str, str] | None:
    """(``final.pt`` path, data version) of ``asset``'s latest materialization, if it exists on disk."""
    materialization = latest_materialization(context.instance, asset)
    if materialization is None or "checkpoint" not in (materialization.metadata or {}):
        return None
    path = str(materialization.metadata["checkpoint"].value)
    if not Path(path).is_file():
        context.log.warning(f"{asset}'s checkpoint {path} is gone: materialize {asset} again")
        return None
    return path, latest_data_version(context.instance, asset) or ""


def _required_checkpoint(context: dg.AssetExecutionContext, asset: str) -> tuple[str, str]:
    found = checkpoint_of(context, asset)
    if found is None:
        raise dg.Failure(description=f"no {asset} checkpoint: materialize {asset} first")
    return found


def _transcripts(paths: StoragePaths) -> dict[str, str]:
    table = pq.read_table(paths.manifest_file, columns=["utt_id", "transcript"])
    return dict(zip(table.column("utt_id").to_pylist(), table.column("transcript").to_pylist(), strict=True))


def _speaker_clients(paths: StoragePaths) -> dict[str, str]:
    return {row.speaker_id: row.client_id for row in read_clients(paths.clients_file)}


def _threads(requested: int):
    import torch

    torch.set_num_threads(requested or torch.get_num_threads())


# ------------------------------------------------------------------------------------ probe
@dg.asset(
    group_name="evaluation",
    deps=[
        "pretrained_checkpoint", "federated_checkpoint", "distilled_checkpoint", "pretrained_checkpoint_iter2",
        "manifest", "cmvn_stats", "client_partitions",
    ],  # fmt: skip
    code_version=PROBE_CODE_VERSION,
    kinds={"pytorch"},
    description=(
        "A character CTC probe (SUPERB-style weighted sum of frozen layers, then linear or BiLSTM) "
        "trained on the training speakers and scored (greedy CER/WER, jiwer) on held-out speakers, "
        "for every checkpoint that exists and for the log-mel (fbank) and randomly initialised "
        "baselines: <data>/probe/results.parquet."
    ),
)
def downstream_probe(
    context: dg.AssetExecutionContext, config: ProbeOverrides, paths: StoragePaths, settings: PipelineSettings
) -> dg.MaterializeResult:
    import pyarrow as pa

    from speech_assets.evaluation.compare import RANDOM, RESULT_COLUMNS, compare_encoders, markdown_table, split_utterances
    from speech_assets.evaluation.encoders import load_encoder, load_utterances, random_encoder
    from speech_assets.evaluation.probe import ProbeOptions
    from speech_assets.features.cmvn import Cmvn
    from speech_assets.model.presets import ModelPreset
    from speech_assets.train.data import heldout_speakers

    options = effective(settings.probe, config)
    _threads(options.threads)
    pretrained_path, _ = _required_checkpoint(context, "pretrained_checkpoint")
    encoders = {"pretrained": load_encoder(pretrained_path)}
    pretrained = encoders["pretrained"]
    encoders[RANDOM] = random_encoder(ModelPreset(**pretrained.checkpoint["preset"]), seed=options.seed)
    optional = (("federated_checkpoint", "federated"), ("distilled_checkpoint", "distilled"), ("pretrained_checkpoint_iter2", "iteration2"))
    for asset, name in optional:
        if (found := checkpoint_of(context, asset)) is not None:
            encoders[name] = load_encoder(found[0])
    # the speakers pretraining held out are the probe's test speakers: never seen by any encoder
    fraction = (pretrained.checkpoint.get("config") or {}).get("heldout_fraction", settings.training.heldout_fraction)
    held = heldout_speakers(_speaker_clients(paths), fraction)
    speakers = sorted(_speaker_clients(paths))
    utterances = load_utterances(
        [paths.shard_file(s) for s in speakers], Cmvn.load(paths.cmvn_dir / "cmvn.npz"), _transcripts(paths)
    )
    train, test = split_utterances(utterances, held, options.max_train_utterances, options.max_eval_utterances, options.seed)
    context.log.info(
        f"probing {', '.join(['fbank', *encoders])}: {len(train)} training utterances, {len(test)} held-out "
        f"utterances of {len(held)} held-out speakers ({', '.join(sorted(held)[:10])})"
    )
    probe_options = ProbeOptions(
        probe=options.probe, steps=options.steps, batch_size=options.batch_size, lr=options.lr,
        hidden=options.hidden, seed=options.seed,
    )  # fmt: skip
    results = compare_encoders(
        train, test, encoders, probe_options,
        on_model=lambda r: context.log.info(f"{r.model}: held-out CER {r.cer:.3f}, WER {r.wer:.3f} ({r.seconds:.0f} s)"),
    )  # fmt: skip
    table = pa.Table.from_pylist([r.row() for r in results]).select(list(RESULT_COLUMNS))
    target = paths.root / "probe" / "results.parquet"
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(target) as tmp:
        pq.write_table(table, tmp)
    heldout = {r.model: r for r in results if r.split == "heldout"}
    input_versions = {
        asset: latest_data_version(context.instance, asset) or ""
        for asset in (
            "pretrained_checkpoint", "federated_checkpoint", "distilled_checkpoint", "pretrained_checkpoint_iter2",
            "manifest", "cmvn_stats", "client_partitions",
        )  # fmt: skip
    }
    return dg.MaterializeResult(
        data_version=dg.DataVersion(sha256_file(target)),
        metadata={
            "results": dg.MetadataValue.md(markdown_table(results)),
            "results_file": dg.MetadataValue.path(str(target)),
            **{f"heldout_cer/{model}": round(r.cer, 4) for model, r in heldout.items()},
            "pretrained_beats_fbank": heldout["pretrained"].cer < heldout["fbank"].cer,
            "probe": options.probe,
            "steps": options.steps,
            "train_utterances": len(train),
            "heldout_utterances": len(test),
            "heldout_speakers": dg.MetadataValue.json(sorted(held)[:50]),
            "seconds_per_model": dg.MetadataValue.json({r.model: round(r.seconds, 1) for r in heldout.values()}),
            "input_versions": dg.MetadataValue.json(input_versions),
        },
    )


@dg.asset_check(asset=downstream_probe, description="Warns when the pretrained encoder's probe does not beat the log-mel (fbank) baseline on held-out speakers.")
def pretrained_beats_fbank(paths: StoragePaths) -> dg.AssetCheckResult:
    rows = pq.read_table(paths.root / "probe" / "results.parquet").to_pylist()
    cer = {row["model"]: row["cer"] for row in rows if row["split"] == "heldout"}
    return dg.AssetCheckResult(
        passed=cer["pretrained"] < cer["fbank"],
        severity=dg.AssetCheckSeverity.WARN,
        metadata={f"heldout_cer/{model}": round(value, 4) for model, value in cer.items()},
        description=None if cer["pretrained"] < cer["fbank"] else (
            "the pretrained encoder's features transcribe no better than log-mel: train longer or on more data"
        ),
    )


# ----------------------------------------------------------------------------------- export
@dg.asset(
    group_name="evaluation",
    deps=["pretrained_checkpoint", "cmvn_stats"],
    code_version=EXPORT_CODE_VERSION,
    kinds={"pytorch", "onnx"},
    description=(
        "The pretrained encoder without heads as ONNX (torch.onnx dynamo exporter) and TorchScript, "
        "dynamic batch and time, with encoder.json (featurisation, CMVN, frame rates, layer, parity "
        "against PyTorch on real shard features through onnxruntime): <data>/export/<checkpoint>/."
    ),
)
def encoder_export(
    context: dg.AssetExecutionContext, config: ExportOverrides, paths: StoragePaths, settings: PipelineSettings
) -> dg.MaterializeResult:
    from speech_assets.evaluation.encoders import load_encoder, load_utterances
    from speech_assets.evaluation.export import export_all, input_description
    from speech_assets.evaluation.probe import subsample
    from speech_assets.features.cmvn import Cmvn

    options = effective(settings.export, config)
    checkpoint, checkpoint_version = _required_checkpoint(context, "pretrained_checkpoint")
    encoder = load_encoder(checkpoint)
    cmvn_path = paths.cmvn_dir / "cmvn.npz"
    cmvn = Cmvn.load(cmvn_path)
    speakers = sorted(_speaker_clients(paths))
    utterances = load_utterances([paths.shard_file(s) for s in speakers[:4]], cmvn, _transcripts(paths))
    sample = [utterances[i].feats for i in subsample(len(utterances), options.parity_utterances, seed=0)]
    if not sample:
        raise dg.Failure(description="no shard features to check the export's parity on")
    folder = paths.root / "export" / f"{encoder.sha256[:16]}-layer{options.layer}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    # written in a sibling temporary folder, then renamed into place: never half an export
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        context.log.info(f"exporting {checkpoint} (layer {options.layer}) to ONNX and TorchScript")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exporter's progress chatter and torch.jit's deprecation notice
            parity = export_all(encoder.model, staging, options.layer, sample, options.opset or None)
        description = input_description(encoder, cmvn, options.layer, parity, checkpoint)
        atomic_write_text(staging / "encoder.json", json.dumps(description, indent=2, sort_keys=True) + "\n")
        shutil.copyfile(cmvn_path, staging / "cmvn.npz")
        for file in staging.iterdir():
            file.chmod(0o666 & ~current_umask())
        staging.chmod(0o777 & ~current_umask())
        if folder.exists():
            shutil.rmtree(folder)
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    files = {name: sha256_file(folder / name) for name in ("encoder.onnx", "encoder.pt", "encoder.json", "cmvn.npz")}
    context.log.info(
        f"parity on {parity.utterances} utterances ({parity.frames} frames): ONNX max |diff| "
        f"{parity.onnx_max_abs_diff:.2e}, TorchScript {parity.torchscript_max_abs_diff:.2e}"
    )
    return dg.MaterializeResult(
        data_version=dg.DataVersion(sha256_strings(f"{k}:{v}" for k, v in sorted(files.items()))),
        metadata={
            "onnx": dg.MetadataValue.path(str(folder / "encoder.onnx")),
            "torchscript": dg.MetadataValue.path(str(folder / "encoder.pt")),
            "description": dg.MetadataValue.path(str(folder / "encoder.json")),
            "max_abs_diff": parity.onnx_max_abs_diff,
            "torchscript_max_abs_diff": parity.torchscript_max_abs_diff,
            "parity_utterances": parity.utterances,
            "parity_frames": parity.frames,
            "layer": description["output"]["layer"],
            "onnx_mb": round((folder / "encoder.onnx").stat().st_size / 2**20, 2),
            "checkpoint_sha256": encoder.sha256,
            "input_versions": dg.MetadataValue.json(
                {"pretrained_checkpoint": checkpoint_version, "cmvn_stats": latest_data_version(context.instance, "cmvn_stats") or ""}
            ),
        },
    )


@dg.asset_check(asset=encoder_export, blocking=True, description=(
    "Runs the exported ONNX (onnxruntime, CPU) and TorchScript encoders again on real shard utterances and "
    f"fails when either differs from the PyTorch checkpoint by more than {ONNX_PARITY_ATOL:g} (fp32), or when "
    "that checkpoint is not the one exported."
))
def onnx_matches_pytorch(context: dg.AssetCheckExecutionContext, paths: StoragePaths, settings: PipelineSettings) -> dg.AssetCheckResult:
    materialization = latest_materialization(context.instance, "encoder_export")
    description = (materialization.metadata or {}).get("description") if materialization else None
    if description is None:
        return dg.AssetCheckResult(passed=False, description="no export recorded: materialize encoder_export first")
    # the last speakers first: other utterances than the exporter compared on (its first four speakers)
    shards = [paths.shard_file(s) for s in sorted(_speaker_clients(paths), reverse=True)]
    return export_parity(Path(str(description.value)).parent, shards, settings.export.parity_utterances)


def export_parity(folder: Path, shards: list[Path], utterances: int) -> dg.AssetCheckResult:
    """The parity check of the export in ``folder`` on the first ``utterances`` of ``shards``."""
    from speech_assets.evaluation.export import parity_features, reverify_export

    feats = parity_features(shards, folder / "cmvn.npz", utterances)
    if not feats:
        return dg.AssetCheckResult(passed=False, description="no shard utterances to run the export on")
    parity, problems = reverify_export(folder, feats)
    metadata: dict[str, object] = {"atol": ONNX_PARITY_ATOL, "folder": dg.MetadataValue.path(str(folder))}
    if parity is not None:
        metadata |= {
            "max_abs_diff": parity.onnx_max_abs_diff, "torchscript_max_abs_diff": parity.torchscript_max_abs_diff,
            "utterances": parity.utterances, "frames": parity.frames,
        }  # fmt: skip
        problems += [
            f"{runtime} differs from PyTorch by up to {diff:.2e}"
            for runtime, diff in (("ONNX", parity.onnx_max_abs_diff), ("TorchScript", parity.torchscript_max_abs_diff))
            if not diff <= ONNX_PARITY_ATOL  # NaN fails too
        ]
    return dg.AssetCheckResult(passed=not problems, description="; ".join(problems) or None, metadata=metadata)


# ---------------------------------------------------------------------------------- distill
@dg.asset(
    group_name="evaluation",
    deps=["pretrained_checkpoint", *TRAINING_INPUTS],
    code_version=DISTILL_CODE_VERSION,
    pool="training",
    kinds={"pytorch", "mlflow"},
    description=(
        "A small student (default 384 wide, 6 layers) distilled DistilHuBERT-style from the pretrained "
        "encoder (L1 + cosine on chosen teacher layers) on the training speakers, launched like "
        "training (torchrun, Pipes, MLflow); parameters and CPU forward speed against the teacher."
    ),
)
def distilled_checkpoint(
    context: dg.AssetExecutionContext,
    config: DistillOverrides,
    paths: StoragePaths,
    settings: PipelineSettings,
    pipes_subprocess_client: dg.PipesSubprocessClient,
) -> dg.MaterializeResult:
    from speech_assets.evaluation.distill import DistillConfig
    from speech_assets.train import launch
    from speech_assets.train.config import ClientTargets

    options = effective(settings.distill, config)
    record_run_process(context)
    teacher, teacher_version = _required_checkpoint(context, "pretrained_checkpoint")
    clients: dict[str, list[str]] = {}
    for speaker, client in _speaker_clients(paths).items():
        clients.setdefault(client, []).append(speaker)
    data_versions = {"pretrained_checkpoint": teacher_version, **input_versions(context, paths, clients)}
    run_name = sha256_strings([json.dumps(data_versions, sort_keys=True), options.model_dump_json(), DISTILL_CODE_VERSION])[:16]
    run_dir = paths.root / "distill" / run_name
    from speech_assets.evaluation.encoders import load_encoder

    teacher_model = load_encoder(teacher)
    teacher_config = teacher_model.checkpoint.get("config") or {}
    shape = student_shape(teacher_model.model.preset, options)
    distill_config = DistillConfig(
        run_dir=str(run_dir),
        teacher=teacher,
        shards=[str(paths.shard_file(s)) for s in sorted(s for speakers in clients.values() for s in speakers)],
        cmvn=str(paths.cmvn_dir / "cmvn.npz"),
        clients={
            client: ClientTargets(
                labels=str(paths.kmeans_dir(client) / "labels.parquet"),
                k=json.loads((paths.kmeans_dir(client) / "quality.json").read_text())["k"],
            )
            for client in sorted(clients)
        },
        heldout_fraction=teacher_config.get("heldout_fraction", settings.training.heldout_fraction),
        **shape,
        teacher_layers=list(options.teacher_layers), cosine_weight=options.cosine_weight,
        max_steps=options.max_steps, batch_seconds=options.batch_seconds, lr=options.lr,
        warmup_steps=min(options.warmup_steps, max(1, options.max_steps // 10)), seed=options.seed,
        max_frames=options.max_frames, threads=options.threads or None,
        data_versions=data_versions, git_sha=git_commit(),
        mlflow_tracking_uri=paths.mlflow_tracking_uri, mlflow_artifact_location=paths.mlflow_artifact_location,
        mlflow_run_name=f"distill-{run_name}",
    )  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.json"
    nproc = options.nproc or 1
    with launch.launching(run_dir, dagster_run_id=context.run.run_id, command="dagster asset distilled_checkpoint"):
        atomic_write_text(config_path, distill_config.to_json())
        command = launch.build_torchrun_command(
            config_path, nproc=nproc, max_restarts=0, python=sys.executable, module="speech_assets.evaluation.distill"
        )
        context.log.info("launching: " + " ".join(command))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", dg.PreviewWarning)
            invocation = pipes_subprocess_client.run(
                context=context, command=launch.guarded(command), cwd=str(locations.repo_root()),
                env=launch.torchrun_env(nproc=nproc, tracking_uri=paths.mlflow_tracking_uri),
            )  # fmt: skip
        result = invocation.get_materialize_result()
    speed = _student_speed(teacher, str(run_dir / "final.pt"), paths)
    context.log.info(
        f"student {speed['student_parameters']:,} encoder parameters vs teacher {speed['teacher_parameters']:,}; "
        f"CPU forward {speed['student_audio_s_per_s']:.0f} vs {speed['teacher_audio_s_per_s']:.0f} audio s/s "
        f"({speed['speedup']:.2f}x)"
    )
    return dg.MaterializeResult(
        data_version=result.data_version,
        metadata={
            **(result.metadata or {}),
            **speed,
            **training_curve_metadata(run_dir),
            "run_dir": dg.MetadataValue.path(str(run_dir)),
            "input_versions": dg.MetadataValue.json(bounded_versions(data_versions)),
        },
    )


def student_shape(teacher, options: DistillSettings) -> dict[str, int]:
    """The student's width, depth, heads and FFN: the settings', or half the teacher's where 0."""
    dim = options.dim or max(8, teacher.dim // 2)
    heads = options.heads or max(1, teacher.heads // 2)
    while dim % heads:
        heads -= 1
    return {"dim": dim, "layers": options.layers or max(1, teacher.layers // 2), "heads": heads, "ffn_dim": options.ffn_dim or 4 * dim}


def _student_speed(teacher_path: str, student_path: str, paths: StoragePaths) -> dict[str, float]:
    """Parameters and single-thread CPU forward speed of student and teacher, on the same utterances."""
    from speech_assets.evaluation.distill import encoder_parameters
    from speech_assets.evaluation.encoders import load_encoder, load_utterances
    from speech_assets.evaluation.speed import forward_speed
    from speech_assets.features.cmvn import Cmvn

    teacher, student = load_encoder(teacher_path).model, load_encoder(student_path).model
    speakers = sorted(_speaker_clients(paths))[:2]
    feats = [u.feats for u in load_utterances([paths.shard_file(s) for s in speakers], Cmvn.load(paths.cmvn_dir / "cmvn.npz"), _transcripts(paths))][:16]
    speed = forward_speed({"teacher": teacher, "student": student}, feats, repeats=2, threads=1)
    return {
        "student_parameters": encoder_parameters(student),
        "teacher_parameters": encoder_parameters(teacher),
        "student_audio_s_per_s": round(speed["student"], 1),
        "teacher_audio_s_per_s": round(speed["teacher"], 1),
        "speedup": round(speed["student"] / speed["teacher"], 3),
    }


ASSETS = [downstream_probe, encoder_export, distilled_checkpoint]
CHECKS = [pretrained_beats_fbank, onnx_matches_pytorch]
