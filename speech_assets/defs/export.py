"""Stage 5: the encoder for deployment: `encoder_export` (ONNX and TorchScript) and its parity check.

The exporter lives in speech_assets/model/export.py; torch and onnx are imported inside the asset.
"""

import json
import warnings
from pathlib import Path

import dagster as dg

from speech_assets.corpus.clients import read_clients
from speech_assets.defs.lineage import latest_metadata, required_checkpoint
from speech_assets.defs.resources import ExportSettings, PipelineSettings, StoragePaths, effective, overrides_of
from speech_assets.layout import ExportFiles
from speech_assets.utils import atomic_write_text, published_folder, sha256_file, sha256_strings

EXPORT_CODE_VERSION = "export-v3"  # v3: the folder names the layer's index (layer4, not layer-1 for the last)
# an exported encoder whose ONNX output differs from PyTorch's by more than this (fp32) fails its check
ONNX_PARITY_ATOL = 1e-4


ExportOverrides = overrides_of(ExportSettings)


@dg.asset(
    group_name="evaluation",
    deps=["pretrained_checkpoint"],
    code_version=EXPORT_CODE_VERSION,
    kinds={"pytorch", "onnx"},
)
def encoder_export(
    context: dg.AssetExecutionContext, config: ExportOverrides, paths: StoragePaths, settings: PipelineSettings
) -> dg.MaterializeResult:
    """The pretrained encoder without heads as ONNX and TorchScript (dynamic batch and time), with
    encoder.json (featurisation, CMVN, frame rates, layer, parity against PyTorch on real shard
    features): `<data>/export/<checkpoint>/`."""
    from speech_assets.evaluation.encoders import manifest_utterances
    from speech_assets.evaluation.probe import subsample
    from speech_assets.features.cmvn import from_record
    from speech_assets.model.encoders import load_encoder
    from speech_assets.model.export import export_all, input_description, resolve_layer
    from speech_assets.train.tracking import ENCODER_MODEL, export_signature, log_exported_model

    options = effective(settings.export, config)
    checkpoint, checkpoint_version = required_checkpoint(context, "pretrained_checkpoint")
    encoder = load_encoder(checkpoint)
    cmvn = from_record(encoder.checkpoint.get("normalisation"))
    if cmvn is None:
        raise dg.Failure(
            description=f"{checkpoint} records no input normalisation: re-materialise pretrained_checkpoint"
        )
    utterances = manifest_utterances(
        paths.layout.manifest.manifest,
        [paths.shard_file(s) for s in sorted(read_clients(paths.layout.clients_file).client_of)[:4]],
    )
    sample = [
        cmvn.apply(utterances[i].feats, "logmel") for i in subsample(len(utterances), options.parity_utterances, seed=0)
    ]
    if not sample:
        raise dg.Failure(description="no shard features to check the export's parity on")
    try:
        layer = resolve_layer(encoder.model, options.layer)  # the folder names the layer it holds, never -1
    except ValueError as error:
        raise dg.Failure(description=f"[export] {error}") from error
    exported = paths.layout.export(encoder.sha256, layer)
    context.log.info(f"exporting {checkpoint} (layer {layer}) to ONNX and TorchScript")
    with published_folder(exported.root) as staging, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's progress chatter and torch.jit's deprecation notice
        parity = export_all(encoder.model, staging, layer, sample, options.opset or None)
        description = input_description(encoder, cmvn, layer, parity, checkpoint)
        atomic_write_text(ExportFiles(staging).card, json.dumps(description, indent=2, sort_keys=True) + "\n")
    files = {path.name: sha256_file(path) for path in exported.published}
    # the ONNX encoder as an MLflow model in its checkpoint's run; {} (and a warning) when it cannot be logged
    model = log_exported_model(
        paths.mlflow_tracking_uri,
        checkpoint,
        encoder.checkpoint,
        exported.onnx,
        [exported.card],
        context.log.warning,
        name=ENCODER_MODEL,
        signature=export_signature(encoder.model.preset.dim),
        tags={"checkpoint_sha256": encoder.sha256},
    )
    context.log.info(
        f"parity on {parity.utterances} utterances ({parity.frames} frames): ONNX max |diff| "
        f"{parity.onnx_max_abs_diff:.2e}, TorchScript {parity.torchscript_max_abs_diff:.2e}"
    )
    return dg.MaterializeResult(
        data_version=dg.DataVersion(sha256_strings(f"{k}:{v}" for k, v in sorted(files.items()))),
        metadata={
            "onnx": dg.MetadataValue.path(str(exported.onnx)),
            "torchscript": dg.MetadataValue.path(str(exported.torch)),
            "description": dg.MetadataValue.path(str(exported.card)),
            "max_abs_diff": parity.onnx_max_abs_diff,
            "torchscript_max_abs_diff": parity.torchscript_max_abs_diff,
            "parity_utterances": parity.utterances,
            "parity_frames": parity.frames,
            "layer": description["output"]["layer"],
            "onnx_mb": round(exported.onnx.stat().st_size / 2**20, 2),
            "checkpoint_sha256": encoder.sha256,
            "normalisation": description["cmvn"]["kind"],
            "input_versions": dg.MetadataValue.json({"pretrained_checkpoint": checkpoint_version}),
            **({"mlflow_model": model["model_uri"]} if model else {}),
        },
    )


@dg.asset_check(
    asset=encoder_export,
    blocking=True,
    description=(
        "Runs the exported ONNX (onnxruntime, CPU) and TorchScript encoders again on real shard utterances and "
        f"fails when either differs from the PyTorch checkpoint by more than {ONNX_PARITY_ATOL:g} (fp32), or when "
        "that checkpoint is not the one exported."
    ),
)
def onnx_matches_pytorch(
    context: dg.AssetCheckExecutionContext, paths: StoragePaths, settings: PipelineSettings
) -> dg.AssetCheckResult:
    description = latest_metadata(context.instance, "encoder_export").get("description")
    if description is None:
        return dg.AssetCheckResult(passed=False, description="no export recorded: materialize encoder_export first")
    # the last speakers first: other utterances than the exporter compared on (its first four speakers)
    shards = [paths.shard_file(s) for s in sorted(read_clients(paths.layout.clients_file).client_of, reverse=True)]
    return export_parity(Path(str(description)).parent, shards, settings.export.parity_utterances)


def export_parity(folder: Path, shards: list[Path], utterances: int) -> dg.AssetCheckResult:
    from speech_assets.features.cmvn import from_record
    from speech_assets.model.export import parity_features, reverify_export

    cmvn = from_record(json.loads(ExportFiles(folder).card.read_text())["cmvn"])
    feats = parity_features(shards, cmvn, utterances)
    if not feats:
        return dg.AssetCheckResult(passed=False, description="no shard utterances to run the export on")
    parity, problems = reverify_export(folder, feats)
    metadata: dict[str, object] = {"atol": ONNX_PARITY_ATOL, "folder": dg.MetadataValue.path(str(folder))}
    if parity is not None:
        metadata |= {
            "max_abs_diff": parity.onnx_max_abs_diff,
            "torchscript_max_abs_diff": parity.torchscript_max_abs_diff,
            "utterances": parity.utterances,
            "frames": parity.frames,
        }
        problems += [
            f"{runtime} differs from PyTorch by up to {diff:.2e}"
            for runtime, diff in (("ONNX", parity.onnx_max_abs_diff), ("TorchScript", parity.torchscript_max_abs_diff))
            if not diff <= ONNX_PARITY_ATOL  # NaN fails too
        ]
    return dg.AssetCheckResult(passed=not problems, description="; ".join(problems) or None, metadata=metadata)
