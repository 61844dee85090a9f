"""The model alone: training steps of the old (``nn.TransformerEncoder``) and new (SDPA) encoder.

    python bench/gpu_model.py --device cuda --preset base --precision bf16 --batch-seconds 400
    python bench/gpu_model.py --device cpu --preset base --batch-seconds 24 --steps 2 --position-only
    python bench/gpu_model.py --device cuda --attention --compile   # only the compiled SDPA encoder

For each attention path and per-device batch: ``--steps`` timed optimizer steps (AdamW, fused on
CUDA; masked-prediction loss of two 500-cluster heads; autocast to ``--precision``) on utterances
of ``--seconds`` (one length per batch, as a batch cropped to its shortest utterance: no padding,
so the SDPA path passes no mask; the reference encoder always takes one). The model is called as
the trainer calls it, with ``padded=False``, so the harness reads no
device value. This is the model alone on a batch already on the device; bench/gpu_trainer.py
measures the trainer on its own batches. Reports seconds of audio per second, MFU (the preset's
analytic FLOPs over the device's dense bf16 peak, read from its name), and from a torch.profiler
trace of ``--profile-steps`` steps: the share of the wall time the GPU spends in kernels, the SDPA
backend (aten ops) and attention kernels by backend (bench/gpu_trace.py), the positional
convolution's share of a step (its forward and backward ops, picked by their weight shape). On
CUDA also: host-device synchronisations reported by ``torch.cuda.set_sync_debug_mode("warn")``
during the timed steps, allocator retries, peak memory; with ``--compile``, the number of graphs
compiled.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
from torch.profiler import profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_trace import (  # noqa: E402
    attention_backends,
    attention_kernels,
    kernel_busy_us,
    profiled_steps,
    timed_steps,
)

from speech_assets.model.hubert import HubertPretrainModel, output_lengths  # noqa: E402
from speech_assets.model.loss import masked_prediction_loss  # noqa: E402
from speech_assets.model.masking import span_mask  # noqa: E402
from speech_assets.model.presets import get_preset  # noqa: E402
from speech_assets.train.autoconfig import peak_bf16_flops  # noqa: E402
from speech_assets.train.engine import AUTOCAST_DTYPES, build_optimizer  # noqa: E402

KS = {"a": 500, "b": 500}


def make_batch(batch: int, frames: int, device: torch.device, seed: int = 0) -> dict[str, Any]:
    """Random CMVN-like features ``(B, T, 80)``, host ``lengths (B,)``, two clients' rows, targets
    and mask ``(B, L)``."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.full((batch,), frames)
    out = (frames + 1) // 2
    mask = span_mask(output_lengths(lengths), 0.08, 10, generator)
    half = (batch + 1) // 2
    return {
        "feats": torch.randn(batch, frames, 80, generator=generator).to(device),
        "lengths": lengths,  # on the host, as the trainer's
        "clients": (torch.arange(batch) >= half).long().to(device),
        "targets": torch.randint(0, 500, (batch, out), generator=generator).to(device),
        "mask": mask.to(device),
    }


def step(model: HubertPretrainModel, optimizer: torch.optim.Optimizer, data: dict[str, Any], precision: str) -> None:
    device = data["feats"].device
    dtype = AUTOCAST_DTYPES.get(precision)
    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
        # as the trainer calls it: no padding, so the harness reads nothing from the device
        output = model(data["feats"], data["lengths"], data["clients"], data["mask"], padded=False)
        loss = masked_prediction_loss(output.logits, data["targets"], data["mask"], 1.0).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def position_events(prof: profile, weight_shape: list[int]) -> tuple[float, float]:
    """(CPU-side inclusive µs, device µs) of the convolution ops whose inputs include ``weight_shape``."""
    cpu_us = device_us = 0.0
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key in ("aten::convolution", "aten::convolution_backward") and weight_shape in [
            list(shape) for shape in event.input_shapes
        ]:
            cpu_us += event.cpu_time_total
            device_us += getattr(event, "device_time_total", 0.0)
    return cpu_us, device_us


def profiled(model, optimizer, data, precision: str, steps: int = 5) -> dict[str, Any]:
    device = data["feats"].device
    prof, wall_us = profiled_steps(
        device, steps, functools.partial(step, model, optimizer, data, precision), record_shapes=True
    )
    preset = model.preset
    weight = [preset.dim, preset.dim // preset.pos_groups, preset.pos_kernel]
    cpu_us, device_us = position_events(prof, weight)
    result: dict[str, Any] = {"profiled_steps": steps, "profiled_wall_ms": wall_us / 1e3}
    events = prof.events()
    result["attention_backends"] = attention_backends(events)
    if device.type == "cuda":
        busy = kernel_busy_us(events)
        result["kernel_busy_share"] = busy / wall_us
        kernels = attention_kernels(events)
        result["attention_kernels"] = kernels
        result["attention_kernel"] = next(iter(kernels), None)
        result["position_conv_share"] = device_us / max(busy, 1e-9)
        result["position_conv_share_of"] = "GPU kernel time"
    else:
        result["attention_kernel"] = (result["attention_backends"] or [None])[0]
        result["position_conv_share"] = cpu_us / wall_us
        result["position_conv_share_of"] = "CPU wall time"
    return result


def bench_one(args: argparse.Namespace, attention: str, batch_seconds: float, compiled: bool) -> dict[str, Any]:
    device = torch.device(args.device)
    preset = get_preset(args.preset)
    frames = int(args.seconds * 100)
    batch = max(1, round(batch_seconds / args.seconds))
    torch.manual_seed(0)
    model = HubertPretrainModel(preset, KS, attention=attention).to(device).train()
    if compiled:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model.compile_encoder(**({"backend": args.compile_backend} if args.compile_backend else {}))
    optimizer = build_optimizer(model, 1e-4, 0.01)
    data = make_batch(batch, frames, device)
    row: dict[str, Any] = {
        "attention": attention,
        "batch_seconds": batch * args.seconds,
        "utterances": batch,
        "seconds_per_utterance": args.seconds,
        "precision": args.precision,
        "compiled": compiled,
        "fused_adamw": bool(optimizer.defaults.get("fused")),
    }
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.warmup):
        step(model, optimizer, data, args.precision)
    if not args.position_only:
        elapsed, syncs = timed_steps(device, args.steps, lambda: step(model, optimizer, data, args.precision))
        speed = args.steps * batch * args.seconds / elapsed
        flops = preset.train_flops_per_frame(frames / 2, list(KS.values())) * 50  # per second of audio
        peak = peak_bf16_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        row |= {
            "steps": args.steps,
            "step_ms": 1e3 * elapsed / args.steps,
            "audio_seconds_per_second": speed,
            "achieved_tflops": speed * flops / 1e12,
            "mfu": speed * flops / peak if peak else None,
            "sync_warnings": len(syncs) if device.type == "cuda" else None,
            "sync_sites": sorted({f"{Path(w.filename).name}:{w.lineno}" for w in syncs})[:8],
        }
    row |= profiled(model, optimizer, data, args.precision, args.profile_steps)
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        row |= {
            "alloc_retries": stats.get("num_alloc_retries", 0),
            "peak_gib": stats["allocated_bytes.all.peak"] / 2**30,
        }
    if compiled:
        row["compiled_graphs"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", default="base")
    parser.add_argument("--precision", default=None, help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--attention", nargs="*", default=["reference", "sdpa"], help="none: only --compile's runs")
    parser.add_argument("--batch-seconds", type=float, nargs="+", default=[400.0])
    parser.add_argument("--seconds", type=float, default=12.0, help="length of every utterance")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="also the SDPA encoder torch.compile'd")
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--compile-backend", default=None, help="e.g. eager (fast, for a CPU smoke run)")
    parser.add_argument("--position-only", action="store_true", help="only the profiled steps")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json-out")
    args = parser.parse_args()
    args.precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    runs = [(b, a, False) for b in args.batch_seconds for a in args.attention]
    if args.compile:
        runs += [(b, "sdpa", True) for b in args.batch_seconds]
    for batch_seconds, attention, compiled in runs:
        try:
            row = bench_one(args, attention, batch_seconds, compiled)
        except Exception as error:  # one failing configuration must not hide the others
            traceback.print_exc()
            row = {"attention": attention, "batch_seconds": batch_seconds, "error": repr(error)[:500]}
            if args.device == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json_out:  # after every row: a section cut short by its time limit still reports
            Path(args.json_out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
