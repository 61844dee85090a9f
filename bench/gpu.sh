#!/usr/bin/env bash
# The GPU benchmark: training as it runs, one prepared script for a lent GPU machine, one report
# ($OUT/report.json and a summary with the targets at the end). Sections, and their limits on a GPU:
#   machine   10 s  torch, CUDA, GPU name and memory, peak bf16 FLOP/s (autoconfig's table); nvidia-smi
#   model     50 s  the model alone (bench/gpu_model.py), `base` bf16, old (nn.TransformerEncoder) and
#                   new (SDPA) encoder, equal-length 12 s utterances, 400 s per step: audio s/s, MFU,
#                   kernel-busy share, attention backend and kernels, sync warnings
#   compile   60 s  the new encoder torch.compile'd at that batch (graphs compiled)
#   trainer  135 s  the real trainer (bench/gpu_trainer.py) on its own batches: synthetic shards of
#                   2-16 s utterances, 4 clients, its sampler, loader workers and grouped heads, old
#                   (padded batches with a key mask, the per-client head loop) vs new (its defaults)
#                   in one run, and CTC fine-tuning (its FineTuning run) on the same shards: audio
#                   s/s, MFU, kernel-busy share and the attention kernel from a profiler capture of
#                   one step, host syncs of one step (census) and sync warnings
#   fp16      45 s  the trainer's new path in fp16 with the GradScaler (its host reads counted)
#   ddp       20 s  DDP over NCCL (torchrun, every GPU here)
#   oom       70 s  out-of-memory back-off through the real launcher
#   report    10 s  bench/gpu_report.py: old vs new, and PASS/MISS/UNMEASURED against the targets
# With the dependency check's 20 s the limits add up to 420 s: within 7 minutes on one H100/H200.
#     OUT=/tmp/gpu_bench bash bench/gpu.sh            # a GPU machine
#     OUT=/tmp/gpu_smoke bash bench/gpu.sh --smoke    # any machine: CPU, `tiny`, CUDA sections skipped
# First it checks its dependencies (python imports of torch, numpy, pyarrow, psutil, tqdm,
# dagster-pipes; nvidia-smi unless --smoke): a missing one is named on one line and the script
# exits 2 before any section runs. Each section runs under `timeout`; a failing one prints its
# error and the next one runs. PY picks the interpreter (default python3).
set -u
SMOKE=0
[ "${1:-}" = "--smoke" ] && SMOKE=1
OUT=${OUT:-/tmp/gpu_bench}
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

if [ "$SMOKE" = 0 ] && ! command -v nvidia-smi >/dev/null; then
    echo "!! gpu.sh: missing dependency: nvidia-smi is not on PATH (no NVIDIA driver?); try --smoke" >&2
    exit 2
fi
CHECK_LIMIT=20
[ "$SMOKE" = 1 ] && CHECK_LIMIT=90  # a loaded CPU machine
missing=$(timeout "$CHECK_LIMIT" "$PY" -c '
import importlib
missing = []
for name in ("torch", "numpy", "pyarrow", "psutil", "tqdm", "dagster_pipes"):
    try:
        importlib.import_module(name)
    except Exception as error:
        missing.append(f"{name} ({type(error).__name__}: {error})")
print("; ".join(missing))
' 2>/dev/null) || { echo "!! gpu.sh: missing dependency: $PY cannot run, or took over $CHECK_LIMIT s to import" >&2; exit 2; }
[ -n "$missing" ] && { echo "!! gpu.sh: missing dependency: python module $missing" >&2; exit 2; }

mkdir -p "$OUT"
rm -f "$OUT"/sections.jsonl "$OUT"/{machine,model,compile,trainer,fp16,ddp,oom,report}.json

section() {  # section NAME LIMIT_SECONDS COMMAND...
    local name=$1 limit=$2 start rc
    shift 2
    echo "== $name (limit ${limit} s)"
    start=$(date +%s)
    timeout -k 2 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    grep -v '^USDT' "$OUT/$name.log" | tail -n 12
    [ "$rc" -ne 0 ] && echo "!! $name failed (exit $rc$([ "$rc" -eq 124 ] && echo ', timed out')): $OUT/$name.log"
    echo "{\"section\": \"$name\", \"rc\": $rc, \"seconds\": $(($(date +%s) - start)), \"limit\": $limit}" >>"$OUT/sections.jsonl"
    return 0
}
skip() {  # skip NAME WHY
    echo "== $1: skipped ($2)"
    echo "{\"section\": \"$1\", \"skipped\": \"$2\"}" >>"$OUT/sections.jsonl"
}

if [ "$SMOKE" = 1 ]; then
    DEVICE=cpu PRESET=tiny PRECISION=fp32
    SHORT=(--seconds 2 --steps 2 --warmup 1 --profile-steps 2 --threads 1)
    MODEL_ARGS=(--batch-seconds 24 "${SHORT[@]}")  # the trainer's batch: the two compare
    COMPILE_ARGS=(--batch-seconds 4 "${SHORT[@]}" --compile-backend eager)
    TRAINER_ARGS=(--batch-seconds 24 --steps 2 --warmup 1 --threads 1 --clients 2 --k 50)
    LIMITS=(120 300 300 600 0 0 0 60)  # generous: a loaded CPU machine
else
    DEVICE=cuda PRESET=base PRECISION=bf16
    MODEL_ARGS=(--batch-seconds 400 --seconds 12 --steps 10 --warmup 3)
    COMPILE_ARGS=(--batch-seconds 400 --seconds 12 --steps 10 --warmup 3)
    TRAINER_ARGS=(--batch-seconds 400 --steps 8 --warmup 3)
    LIMITS=(10 50 60 135 45 20 70 10)  # and the dependency check's 20: 420 s
fi

section machine "${LIMITS[0]}" "$PY" -c "
import json, os, platform, sys, torch
cuda = torch.cuda.is_available()
info = {'python': sys.version.split()[0], 'torch': torch.__version__, 'cuda': torch.version.cuda,
        'device': torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
        'cpus': os.cpu_count(), 'smoke': $SMOKE}
if cuda:
    props = torch.cuda.get_device_properties(0)
    info |= {'gpu_memory_gib': props.total_memory / 2**30, 'gpus': torch.cuda.device_count()}
    from speech_assets.train.autoconfig import peak_bf16_flops
    info['peak_bf16_tflops'] = (peak_bf16_flops(info['device']) or 0) / 1e12 or None
print(json.dumps(info)); open('$OUT/machine.json', 'w').write(json.dumps(info))
"
[ "$SMOKE" = 0 ] && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv >"$OUT/gpu.txt" 2>&1

section model "${LIMITS[1]}" "$PY" bench/gpu_model.py --device $DEVICE --preset $PRESET --precision $PRECISION \
    --attention reference sdpa "${MODEL_ARGS[@]}" --json-out "$OUT/model.json"
section compile "${LIMITS[2]}" "$PY" bench/gpu_model.py --device $DEVICE --preset $PRESET --precision $PRECISION \
    --attention --compile "${COMPILE_ARGS[@]}" --json-out "$OUT/compile.json"
section trainer "${LIMITS[3]}" "$PY" bench/gpu_trainer.py --device $DEVICE --preset $PRESET --precision $PRECISION \
    --variants old new finetune "${TRAINER_ARGS[@]}" --json-out "$OUT/trainer.json"
if [ "$SMOKE" = 1 ]; then
    skip fp16 "needs CUDA: fp16 with a GradScaler trains on GPUs only"
    skip ddp "needs CUDA: NCCL"
    skip oom "needs CUDA: a CUDA out-of-memory error"
else
    section fp16 "${LIMITS[4]}" "$PY" bench/gpu_trainer.py --device cuda --preset base --precision fp16 --variants new \
        --batch-seconds 200 --steps 5 --warmup 2 --json-out "$OUT/fp16.json"
    section ddp "${LIMITS[5]}" "$PY" -m torch.distributed.run --standalone \
        --nproc-per-node "$("$PY" -c 'import torch;print(torch.cuda.device_count())')" \
        bench/gpu_ddp.py --steps 10 --json-out "$OUT/ddp.json"
    section oom "${LIMITS[6]}" "$PY" bench/gpu_oom.py --batch-seconds 8000 --utterances 800 --steps 1 \
        --json-out "$OUT/oom.json"
fi
timeout "${LIMITS[7]}" "$PY" bench/gpu_report.py "$OUT" || echo "!! the report failed"
