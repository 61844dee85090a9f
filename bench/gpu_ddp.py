"""DDP over NCCL on a GPU: step time of ``base`` in bf16 with and without DistributedDataParallel.

    torchrun --standalone --nproc-per-node N bench/gpu_ddp.py [--steps 20] [--batch 16] [--seconds 15]

Every rank builds the real ``HubertPretrainModel`` (preset ``--preset``), joins an NCCL process
group and times ``--steps`` forward+backward+AdamW steps on random CMVN-like features, first bare,
then wrapped in DDP (gradient all-reduce in buckets, overlapped with backward). With one GPU the
all-reduce is NCCL's single-rank path: the figure is DDP's own overhead (bucketing, hooks), not
the interconnect. Also times one all-reduce of a buffer the size of the model's gradients.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from speech_assets.model.hubert import HubertPretrainModel  # noqa: E402
from speech_assets.model.presets import get_preset  # noqa: E402


def timed_steps(
    model: torch.nn.Module,
    steps: int,
    feats: torch.Tensor,
    lengths: torch.Tensor,
    clients: torch.Tensor,
    mask: torch.Tensor,
) -> float:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    for step in range(steps + 3):  # 3 warm-up steps
        if step == 3:
            torch.cuda.synchronize()
            start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(feats, lengths, clients, mask)
            loss = out.logits.float().logsumexp(-1).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="base")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16, help="utterances per rank")
    parser.add_argument("--seconds", type=float, default=15.0, help="utterance length")
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile the model first (headroom of a fused graph)"
    )
    parser.add_argument("--json-out")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    torch.manual_seed(dist.get_rank())
    frames = int(args.seconds * 100)
    feats = torch.randn(args.batch, frames, 80, device=device)
    lengths = torch.full((args.batch,), frames, device=device)
    clients = torch.arange(args.batch, device=device) % 2
    mask = torch.rand(args.batch, (frames + 1) // 2, device=device) < 0.08  # every parameter gets a gradient
    model = HubertPretrainModel(get_preset(args.preset), {"a": 500, "b": 500}).to(device)
    if args.compile:
        model = torch.compile(model)
    bare = timed_steps(model, args.steps, feats, lengths, clients, mask)
    ddp = timed_steps(
        DistributedDataParallel(model, device_ids=[local_rank]), args.steps, feats, lengths, clients, mask
    )
    grads = torch.zeros(sum(p.numel() for p in model.parameters()), device=device)
    dist.all_reduce(grads)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dist.all_reduce(grads)
    torch.cuda.synchronize()
    reduce_s = (time.perf_counter() - start) / 10
    row = {
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "gpu": torch.cuda.get_device_name(device),
        "preset": args.preset,
        "compiled": args.compile,
        "batch_audio_seconds_per_rank": args.batch * args.seconds,
        "bare_step_s": bare,
        "ddp_step_s": ddp,
        "ddp_overhead": ddp / bare - 1,
        "allreduce_fp32_grads_ms": reduce_s * 1e3,
        "allreduce_GBps": grads.numel() * 4 / reduce_s / 1e9,
        "audio_seconds_per_second_ddp": args.batch * args.seconds * dist.get_world_size() / ddp,
        "audio_seconds_per_second_bare": args.batch * args.seconds / bare,
    }
    if dist.get_rank() == 0:
        print(json.dumps(row, indent=1))
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(row, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
