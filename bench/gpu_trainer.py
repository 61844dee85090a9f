"""The real trainer's steps on its own batches, old vs new and fine-tuning, in one process (issue 49).

    python bench/gpu_trainer.py --device cuda --preset base --batch-seconds 400 --json-out trainer.json
    python bench/gpu_trainer.py --device cpu --preset tiny --batch-seconds 8 --steps 2   # smoke

Writes a synthetic corpus in the real shard and label formats: 2-16 s
utterances, ``--clients`` clients of ``--k`` clusters, one shard per speaker, so the trainer's
``BlockShuffleSampler`` mixes clients in a batch and the grouped heads run. For each variant it
builds the real :class:`~speech_assets.train.trainer.Trainer` (its dataset, sampler, loader
workers, ``BatchStream`` with the CUDA side-stream copy, model, objective and engine) and takes
the engine's own steps (``Engine.train_step``) on the stream's batches:

* ``old``: today's path: padded batches with a key mask (``TrainConfig.crop_batches=False`` where
  the setting exists; before it, the trainer pads anyway) and the per-client head loop with fp32
  cross-entropy over all frames: :class:`LoopHeads`, a copy kept here as the reference.
* ``new``: the trainer as configured by default (its objective, its heads, its batches).
* ``finetune``: CTC fine-tuning (the real ``FineTuning`` run: its sampler, stream and objective)
  of a fresh encoder of the preset on the same shards, with made-up transcripts, at the same
  batch: issue 49's target is within 1.5x of pretraining's audio s/s per step.

Per variant: ``--warmup`` untimed steps, ``--steps`` timed steps (device synchronised at both
ends; on CUDA under ``torch.cuda.set_sync_debug_mode("warn")``, its warnings counted), then
``--profile-steps`` steps under torch.profiler (attention backend from the aten ops and CUDA
kernel names; kernel-busy share = union of kernel time / wall time), then one step under the
host-read census (bench/gpu_trace.py). MFU = the preset's analytic training FLOPs
(``ModelPreset.train_flops_per_frame``, the count autoconfig uses) of the useful frames of the
timed batches over the timed wall time and the GPU's dense bf16 peak (autoconfig's table).
Nothing here reads a device value inside a measured step: the batches' bookkeeping uses host
fields only (``seconds``, ``padded``, shapes).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from gpu_trace import (  # noqa: E402
    HostReads,
    attention_backends,
    attention_kernels,
    host_syncs,
    kernel_busy_us,
    profiled_steps,
    timed_steps,
)

from speech_assets.model.loss import IGNORE_INDEX, STAT_FIELDS  # noqa: E402
from speech_assets.model.presets import get_preset  # noqa: E402
from speech_assets.train.autoconfig import peak_bf16_flops  # noqa: E402
from speech_assets.train.config import TrainConfig  # noqa: E402
from speech_assets.train.data import Batch  # noqa: E402
from speech_assets.train.engine import Distributed  # noqa: E402
from speech_assets.train.trainer import Trainer  # noqa: E402

CROP_SETTING = "crop_batches"
WORDS = [
    "AB",
    "CAT",
    "DOG",
    "SAT",
    "RAN",
    "THE",
]  # fine-tuning's made-up transcripts  # TrainConfig's switch between cropped (default) and padded batches


def crop_setting_exists() -> bool:
    return CROP_SETTING in {field.name for field in dataclasses.fields(TrainConfig)}


def variant_settings(variant: str) -> dict[str, Any]:
    """The config overrides of ``variant``: ``old`` pads (where the trainer can be told to), ``new`` is the default."""
    return {CROP_SETTING: False} if variant == "old" and crop_setting_exists() else {}


class LoopHeads:
    """Today's masked prediction (the ``old`` reference): the encoder, then each client's head in a
    Python loop over the batch's clients and fp32 cross-entropy over every frame, summed where
    masked; statistics in :data:`STAT_FIELDS` order. Masks are the trainer objective's. The old
    collate handed the clients' row ranges on the host; the batch no longer carries them, so the
    loop reads ``clients`` once per micro-batch (one host read in this row the old trainer had not)."""

    def __init__(self, objective: Any) -> None:
        self.objective, self.masking, self.device = objective, objective.masking, objective.device

    def __call__(self, model: nn.Module, batch: Batch, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        drawn_for = (self.masking, step, micro)
        if batch.mask is None or batch.masked_for != drawn_for:
            batch = dataclasses.replace(batch, mask=self.masking(batch.lengths, step, micro), masked_for=drawn_for)
        batch = batch.to(self.device)
        model = getattr(model, "module", model)
        if not isinstance(model.heads, nn.ModuleList):
            raise TypeError("the reference loop needs per-client nn.Linear heads")
        hidden = model.encode(batch.feats, batch.lengths, batch.mask, batch.padded).hidden
        sums = torch.zeros(len(STAT_FIELDS), dtype=torch.float64, device=batch.targets.device)
        total = torch.zeros((), device=batch.targets.device)
        present = set()
        rows: dict[int, list[int]] = {}
        for row, client in enumerate(batch.clients.tolist()):
            rows.setdefault(client, []).append(row)
        for client, indices in rows.items():
            present.add(client)
            index = torch.tensor(indices, device=hidden.device)
            logits = model.heads[client](hidden.index_select(0, index))
            targets, mask = batch.targets.index_select(0, index), batch.mask.index_select(0, index)
            ce = F.cross_entropy(logits.float().transpose(1, 2), targets, ignore_index=IGNORE_INDEX, reduction="none")
            valid = targets != IGNORE_INDEX
            correct = logits.argmax(dim=-1) == targets
            masked, unmasked = valid & mask, valid & ~mask
            masked_sum, unmasked_sum = torch.where(masked, ce, 0.0).sum(), torch.where(unmasked, ce, 0.0).sum()
            total = total + masked_sum
            counts = [(correct & masked).sum(), masked.sum(), (correct & unmasked).sum(), unmasked.sum()]
            sums += torch.stack([masked_sum.detach(), *counts[:2], unmasked_sum.detach(), *counts[2:]]).double()
        idle = [p.sum() for i, head in enumerate(model.heads) if i not in present for p in head.parameters()]
        loss = total / sums[2].clamp(min=1).float() + sum(idle, torch.zeros((), device=total.device)) * 0.0
        return loss, sums

    def metrics(self, totals: torch.Tensor) -> dict[str, float]:
        return self.objective.metrics(totals)


class Recorded:
    """The stream's batches, each noted by host fields only (no device read)."""

    def __init__(self, stream: Iterator[Batch]) -> None:
        self.stream, self.batches = stream, []

    def __iter__(self) -> Recorded:
        return self

    def __next__(self) -> Batch:
        batch = next(self.stream)
        rows, frames = batch.feats.shape[:2]
        self.batches.append({"seconds": batch.seconds, "rows": rows, "frames": frames, "padded": batch.padded})
        return batch


def useful_frames(noted: dict[str, Any]) -> float:
    """100 Hz frames of real audio the batch trained on (a cropped batch: all of its ``rows x frames``)."""
    return min(noted["seconds"] * 100.0, float(noted["rows"] * noted["frames"]))


def ctc_vocabulary() -> int:
    from speech_assets.evaluation.text import VOCAB_SIZE

    return VOCAB_SIZE


def write_or_reuse_corpus(root: Path, args: argparse.Namespace) -> Any:
    from speech_assets_tests.support.training_data import write_corpus

    speakers = 4
    per_speaker = max(1, args.utterances // (speakers * args.clients))
    return write_corpus(
        root,
        clients={f"client_{i}": args.k for i in range(args.clients)},
        speakers_per_client=speakers,
        utterances_per_speaker=per_speaker,
        seconds=(2.0, 16.0),
        unlabelled_per_shard=0,
    )


def pretraining(variant: str, corpus: Any, run_dir: Path, args: argparse.Namespace, job: Distributed) -> Any:
    """The real trainer of ``corpus`` for ``variant`` (``old``: padded where settable; ``new``: its defaults)."""
    config = corpus.config(
        run_dir,
        preset=args.preset,
        device=args.device,
        precision=args.precision,
        batch_seconds=args.batch_seconds,
        grad_accum=1,
        max_steps=args.warmup + args.steps + args.profile_steps + 2,
        warmup_steps=1,
        lr=1e-4,
        heldout_fraction=0.0,
        checkpoint_every=10**6,
        log_every=10**6,
        threads=args.threads,
        num_workers=args.workers,
        **variant_settings(variant),
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    return Trainer(config, job)


def finetuning(corpus: Any, run_dir: Path, args: argparse.Namespace, job: Distributed) -> Any:
    """The real CTC fine-tuning (``FineTuning``) of a fresh encoder of the preset on ``corpus``, with
    made-up transcripts (one speaker held out), every part but the frozen frontend training."""
    from speech_assets.evaluation.finetune import FineTuning
    from speech_assets.features.shards import read_shard_table
    from speech_assets.model.hubert import HubertPretrainModel
    from speech_assets.train.config import FinetuneConfig

    run_dir.mkdir(parents=True, exist_ok=True)
    texts: dict[str, dict[str, str]] = {"train": {}, "heldout": {}}
    for shard in corpus.shards:
        for i, row in enumerate(read_shard_table(shard, columns=["utt_id", "speaker_id"]).to_pylist()):
            split = "heldout" if row["speaker_id"] == "client_0-spk0" else "train"
            texts[split][row["utt_id"]] = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(3))
    (run_dir / "labelled.json").write_text(json.dumps(texts))
    torch.manual_seed(0)
    model = HubertPretrainModel(get_preset(args.preset), {"none": 2})
    encoder = {k: v for k, v in model.state_dict().items() if not k.startswith("heads.")}
    torch.save({"encoder": encoder, "preset": model.preset.to_dict()}, run_dir / "encoder.pt")
    config = FinetuneConfig(
        run_dir=str(run_dir / "run"),
        shards=corpus.shards,
        cmvn=corpus.cmvn,
        clients={},
        encoder=str(run_dir / "encoder.pt"),
        labelled=str(run_dir / "labelled.json"),
        max_steps=args.warmup + args.steps + args.profile_steps + 2,
        freeze_steps=0,
        checkpoint_every=10**6,
        eval_every=10**6,
        log_every=10**6,
        batch_seconds=args.batch_seconds,
        precision=args.precision,
        device=args.device,
        threads=args.threads,
        decoders=["greedy"],
    )
    return FineTuning(job, config)


def measure(variant: str, corpus: Any, run_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    job = Distributed(0, 0, 1, 1, device)
    fit = (
        finetuning(corpus, run_dir, args, job)
        if variant == "finetune"
        else pretraining(variant, corpus, run_dir, args, job)
    )
    config, engine, stream = fit.config, fit.engine, fit.stream
    objective: Any = LoopHeads(fit.objective) if variant == "old" else fit.objective
    stream.schedule(engine.step, engine.grad_accum, getattr(objective, "masking", None))
    batches = Recorded(stream)
    preset = fit.model.preset
    ks = [client.k for client in config.clients.values()] or [ctc_vocabulary()]  # fine-tuning: one CTC head
    row: dict[str, Any] = {
        "variant": variant,
        "settings": variant_settings(variant),
        CROP_SETTING: getattr(config, CROP_SETTING, "absent from TrainConfig"),
        "heads": {"old": "reference loop (bench)", "new": "the model's", "finetune": "CTC"}[variant],
        "preset": preset.name,
        "precision": engine.precision,
        "batch_seconds": args.batch_seconds,
        "clients": len(ks),
        "loader_workers": stream.sampler.num_workers,
        "fused_adamw": bool(engine.optimizer.defaults.get("fused")),
    }
    for _ in range(args.warmup):
        engine.train_step(objective, batches)
    batches.batches.clear()

    elapsed, syncs = timed_steps(device, args.steps, functools.partial(engine.train_step, objective, batches))
    timed = list(batches.batches)
    frames = sum(useful_frames(b) for b in timed)
    flops = sum(
        preset.train_flops_per_frame(useful_frames(b) / b["rows"] / 2, ks) * useful_frames(b) / 2 for b in timed
    )
    peak = peak_bf16_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    row |= {
        "steps": args.steps,
        "step_ms": 1e3 * elapsed / args.steps,
        "audio_seconds_per_second": frames / 100.0 / elapsed,
        "achieved_tflops": flops / elapsed / 1e12,
        "mfu": flops / elapsed / peak if peak else None,
        "padded_batch_share": sum(1 for b in timed if b["padded"]) / len(timed),
        "padding_share": 1.0 - frames / sum(b["rows"] * b["frames"] for b in timed),
        "mean_utterance_seconds": frames / 100.0 / sum(b["rows"] for b in timed),
        "sync_warnings": len(syncs) if device.type == "cuda" else None,
        "sync_warning_sites": sorted({f"{Path(w.filename).name}:{w.lineno}" for w in syncs})[:8],
    }

    prof, wall_us = profiled_steps(device, args.profile_steps, functools.partial(engine.train_step, objective, batches))
    events = prof.events()
    backends = attention_backends(events)
    kernels = attention_kernels(events)
    row |= {
        "profiled_steps": args.profile_steps,
        "attention_backends": backends,
        "attention_kernels": kernels,
        # CUDA: the backend whose kernels ran; CPU: the SDPA backend of the aten ops
        "attention_kernel": next(iter(kernels), None) if device.type == "cuda" else (backends or [None])[0],
        "kernel_busy_share": kernel_busy_us(events) / wall_us if device.type == "cuda" else None,
    }

    with profile(activities=[ProfilerActivity.CPU]) as prof, HostReads():
        engine.train_step(objective, batches)
    events = prof.events()
    found = host_syncs(events)
    row |= {
        "census_ops": sum(1 for e in events if e.name in ("aten::linear", "aten::addmm", "aten::mm")),
        "host_syncs": sum(found.values()),
        "host_sync_sites": dict(found.most_common(8)),
    }
    if device.type == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    del fit, engine, stream, batches, objective
    gc.collect()  # the persistent loader workers and the batch copied ahead go with the run
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", default="base")
    parser.add_argument("--precision", default=None, help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--variants", nargs="+", default=["old", "new", "finetune"], choices=("old", "new", "finetune"))
    parser.add_argument("--batch-seconds", type=float, default=400.0)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=1)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--k", type=int, default=500, help="clusters per client")
    parser.add_argument("--utterances", type=int, default=None, help="default: the steps' audio and a half")
    parser.add_argument("--workers", type=int, default=-1, help="loader workers (-1: the trainer's choice)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json-out")
    args = parser.parse_args()
    args.precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    if args.threads:
        torch.set_num_threads(args.threads)
    steps = args.warmup + args.steps + args.profile_steps + 2
    args.utterances = args.utterances or max(16 * args.clients, int(1.5 * steps * args.batch_seconds / 9.0))
    with tempfile.TemporaryDirectory(prefix="bench_gpu_trainer_") as folder:
        root = Path(folder)
        corpus_dir = root / "corpus"
        started = time.perf_counter()
        corpus = write_or_reuse_corpus(corpus_dir, args)
        print(f"corpus: {corpus_dir} ({time.perf_counter() - started:.1f} s)", flush=True)
        rows = []
        for variant in args.variants:
            try:
                row = measure(variant, corpus, root / variant, args)
            except Exception as error:  # one failing variant must not hide the other
                traceback.print_exc()
                row = {"variant": variant, "error": repr(error)[:500]}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.json_out:  # after every row: a section cut short by its time limit still reports
                Path(args.json_out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
