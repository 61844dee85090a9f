#!/usr/bin/env bash
# The GPU benchmarks, one prepared script for a lent GPU machine, one report ($OUT/report.json and
# a summary at the end):
#   model    the model alone, `base` in bf16, old (nn.TransformerEncoder) and new (SDPA) encoder at a
#            large and a small per-device batch: audio s/s, MFU, kernel-busy share (5-step profiler
#            trace), attention kernel, positional-conv share, sync warnings, allocator retries
#   compile  the new encoder at the trainer's batch, eager and torch.compile'd (graphs compiled)
#   trainer  the real trainer (python -m speech_assets.train) at that batch: its MFU vs the model's
#   fp16     fp16 with the GradScaler through the trainer
#   ddp      DDP over NCCL (torchrun, every GPU here)
#   oom      out-of-memory back-off through the real launcher
#     OUT=/tmp/gpu_bench bash bench/gpu.sh            # a GPU machine, at most 8 minutes
#     OUT=/tmp/gpu_smoke bash bench/gpu.sh --smoke    # any machine, CPU, `tiny`, ~1-2 minutes
# Each section runs under `timeout` (the limits add up to under 8 minutes); a failing section
# prints its error and the next one runs. Needs torch plus the training path's imports (numpy,
# pyarrow, psutil, tqdm, dagster-pipes). PY picks the interpreter (default python3).
set -u
SMOKE=0
[ "${1:-}" = "--smoke" ] && SMOKE=1
OUT=${OUT:-/tmp/gpu_bench}
PY=${PY:-python3}
mkdir -p "$OUT"
rm -f "$OUT"/sections.jsonl "$OUT"/{machine,model,compile,trainer,fp16,ddp,oom,report}.json
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

section() {  # section NAME LIMIT_SECONDS COMMAND...
    local name=$1 limit=$2 start rc
    shift 2
    echo "== $name (limit ${limit} s)"
    start=$(date +%s)
    timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    grep -v '^USDT' "$OUT/$name.log" | tail -n 12
    [ "$rc" -ne 0 ] && echo "!! $name failed (exit $rc$([ "$rc" -eq 124 ] && echo ', timed out')): $OUT/$name.log"
    echo "{\"section\": \"$name\", \"rc\": $rc, \"seconds\": $(($(date +%s) - start))}" >>"$OUT/sections.jsonl"
    return 0
}
skip() {  # skip NAME WHY
    echo "== $1: skipped ($2)"
    echo "{\"section\": \"$1\", \"skipped\": \"$2\"}" >>"$OUT/sections.jsonl"
}

if [ "$SMOKE" = 1 ]; then
    DEVICE=cpu PRESET=tiny PRECISION=fp32
    SHORT=(--seconds 2 --steps 2 --warmup 1 --profile-steps 2 --threads 1)
    MODEL_ARGS=(--batch-seconds 8 4 "${SHORT[@]}")
    COMPILE_ARGS=(--batch-seconds 4 "${SHORT[@]}" --compile-backend eager)
    TRAIN_ARGS=(--steps 4 --batch-seconds 8 --threads 1)
    LIMITS=(30 90 60 90 0 0 0)
else
    DEVICE=cuda PRESET=base PRECISION=bf16
    MODEL_ARGS=(--batch-seconds 1400 120 --seconds 12 --steps 10 --warmup 3)
    COMPILE_ARGS=(--batch-seconds 400 --seconds 12 --steps 10 --warmup 3)
    TRAIN_ARGS=(--steps 10 --batch-seconds 400)
    LIMITS=(15 130 90 90 45 25 80)  # 475 s, and the report
fi

section machine "${LIMITS[0]}" $PY -c "
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

section model "${LIMITS[1]}" $PY bench/gpu_model.py --device $DEVICE --preset $PRESET --precision $PRECISION \
    --attention reference sdpa "${MODEL_ARGS[@]}" --json-out "$OUT/model.json"
section compile "${LIMITS[2]}" $PY bench/gpu_model.py --device $DEVICE --preset $PRESET --precision $PRECISION \
    --attention sdpa --compile "${COMPILE_ARGS[@]}" --json-out "$OUT/compile.json"
section trainer "${LIMITS[3]}" $PY bench/train.py --device $DEVICE --preset $PRESET --precision $PRECISION --nproc 1 \
    "${TRAIN_ARGS[@]}" --json-out "$OUT/trainer.json"
if [ "$SMOKE" = 1 ]; then
    skip fp16 "needs CUDA: fp16 with a GradScaler trains on GPUs only"
    skip ddp "needs CUDA: NCCL"
    skip oom "needs CUDA: a CUDA out-of-memory error"
else
    section fp16 "${LIMITS[4]}" $PY bench/train.py --device cuda --preset base --precision fp16 --nproc 1 --steps 8 \
        --batch-seconds 200 --json-out "$OUT/fp16.json"
    section ddp "${LIMITS[5]}" torchrun --standalone --nproc-per-node "$($PY -c 'import torch;print(torch.cuda.device_count())')" \
        bench/gpu_ddp.py --steps 10 --json-out "$OUT/ddp.json"
    section oom "${LIMITS[6]}" $PY bench/gpu_oom.py --batch-seconds 8000 --utterances 1000 --json-out "$OUT/oom.json"
fi
timeout 30 $PY bench/gpu_report.py "$OUT" || echo "!! the report failed"
