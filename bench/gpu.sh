#!/usr/bin/env bash
# The GPU benchmarks, one prepared script for a lent GPU machine (python3 there holds torch):
# MFU of `base` in bf16, fp16 with GradScaler, DDP over NCCL, out-of-memory back-off.
#     OUT=/tmp/gpu_bench bash bench/gpu.sh
# Needs torch with CUDA plus the training path's imports (numpy, pyarrow, psutil, tqdm, dagster-pipes;
# a bare CUDA image may lack dagster-pipes: install its wheel first). PYTHONPATH is kept.
set -u
OUT=${OUT:-/tmp/gpu_bench}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch,sys,os;print('python',sys.version.split()[0],'torch',torch.__version__,'cuda',torch.version.cuda,torch.cuda.get_device_name(),'cpus',os.cpu_count())" | tee -a "$OUT/gpu.txt"
echo "== bf16, base, 1 GPU"
timeout 150 $PY bench/train.py --device cuda --preset base --precision bf16 --nproc 1 --steps 40 --batch-seconds 400 --utterances 600 --json-out "$OUT/bf16.json" 2>&1 | tail -4
echo "== fp16 + GradScaler, base, 1 GPU"
timeout 120 $PY bench/train.py --device cuda --preset base --precision fp16 --nproc 1 --steps 40 --batch-seconds 400 --utterances 600 --json-out "$OUT/fp16.json" 2>&1 | tail -3
echo "== DDP over NCCL (torchrun, every GPU here)"
timeout 100 torchrun --standalone --nproc-per-node "$($PY -c 'import torch;print(torch.cuda.device_count())')" bench/gpu_ddp.py --json-out "$OUT/ddp.json" 2>&1 | tail -22
echo "== out-of-memory back-off"
timeout 180 $PY bench/gpu_oom.py --json-out "$OUT/oom.json" 2>&1 | tail -40
nvidia-smi --query-gpu=memory.used,temperature.gpu --format=csv
