"""Stage 5: a small student distilled from the pretrained encoder: `distilled_checkpoint`,
a training loop launched like pretraining (torchrun through Pipes, :mod:`speech_assets.defs.torchrun`).

The distillation worker lives in speech_assets/train/distill.py; it times student and teacher
too. The step builds no model: the teacher's shape is read from its run's config.
"""

import json
from pathlib import Path

import dagster as dg

from speech_assets.corpus.clients import read_clients
from speech_assets.defs.lineage import input_versions, required_checkpoint
from speech_assets.defs.partitions import TRAINING_INPUTS
from speech_assets.defs.resources import DistillSettings, StoragePaths
from speech_assets.defs.torchrun import run_folder, run_inputs, run_torchrun, torchrun_asset
from speech_assets.layout import RunFiles
from speech_assets.model.presets import get_preset
from speech_assets.train.config import DistillConfig
from speech_assets.utils import atomic_write_text, from_fields, read_json

DISTILL_CODE_VERSION = "distill-v2"  # v2: the default student three quarters wide (was half)


@torchrun_asset(
    "distill",
    group_name="evaluation",
    deps=["pretrained_checkpoint", *TRAINING_INPUTS],
    code_version=DISTILL_CODE_VERSION,
)
def distilled_checkpoint(context, options: DistillSettings, paths: StoragePaths, pipes) -> dg.MaterializeResult:
    """A small student (default 576 wide, 6 layers for `base`) distilled DistilHuBERT-style from the pretrained
    encoder (L1 + cosine on chosen teacher layers) on the training speakers, launched like
    training (torchrun, Pipes, MLflow); parameters and CPU forward speed against the teacher."""
    teacher, teacher_version = required_checkpoint(context, "pretrained_checkpoint")
    table = read_clients(paths.layout.clients_file)
    data_versions = {"pretrained_checkpoint": teacher_version, **input_versions(context, paths, table.speakers)}
    run_dir = run_folder(paths.layout.distill_dir, data_versions, options, DISTILL_CODE_VERSION)
    distill_config = from_fields(
        DistillConfig,
        options,
        **run_inputs(paths, table, data_versions, run_dir, "distill"),
        teacher=teacher,
        **student_shape(teacher, options),
        warmup_steps=min(options.warmup_steps, max(1, options.max_steps // 10)),
        threads=options.threads or None,
    )
    result = run_torchrun(
        context,
        pipes,
        paths,
        run_dir,
        distill_config,
        data_versions,
        nproc=options.nproc or 1,
        module="speech_assets.train.distill",
    )
    finished = read_json(RunFiles(run_dir).result)
    speed = {key: finished[key] for key in SPEED_KEYS}  # timed by the worker, which holds both models
    atomic_write_text(RunFiles(run_dir).speed, json.dumps(speed, indent=1, sort_keys=True) + "\n")
    context.log.info(
        f"student {speed['student_parameters']:,} encoder parameters vs teacher {speed['teacher_parameters']:,}; "
        f"CPU forward {speed['student_audio_s_per_s']:.0f} vs {speed['teacher_audio_s_per_s']:.0f} audio s/s "
        f"({speed['speedup']:.2f}x)"
    )
    return dg.MaterializeResult(data_version=result.data_version, metadata={**result.metadata, **speed})


SPEED_KEYS = ("student_parameters", "teacher_parameters", "student_audio_s_per_s", "teacher_audio_s_per_s", "speedup")


def student_shape(teacher: str, options: DistillSettings) -> dict[str, int]:
    """The student's width, depth, heads and FFN: the settings', or where 0 three quarters of the
    ``teacher`` checkpoint's width with its heads, half its depth and a 4x FFN (its preset read from the
    config its run recorded beside it, no model built). On the learning benchmark a half-width student
    probed 1.25x its teacher's CER, three quarters 1.10x (docs/BENCHMARKS.md)."""
    preset = read_json(RunFiles(Path(teacher).parent).config, strict=True).get("preset")
    if preset is None:
        raise dg.Failure(description=f"no config beside {teacher} names its preset: materialize pretrained_checkpoint")
    shape = get_preset(preset)
    heads = options.heads or shape.heads
    dim = options.dim or max(heads, shape.dim * 3 // 4 // heads * heads)
    while dim % heads:
        heads -= 1
    return {
        "dim": dim,
        "layers": options.layers or max(1, shape.layers // 2),
        "heads": heads,
        "ffn_dim": options.ffn_dim or 4 * dim,
    }
