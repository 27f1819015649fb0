#!/usr/bin/env bash
# Session 54, call B (~5 min, H200): the overlap bench with the prepare/frozen-heap fixes (batches 1, 8, 32), then
# a profiled batch-1 run (where the ~80 us between the kernel's step and the ITL goes).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=$OUT
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu-b.txt"
PARTS=bench OUT=$out bash scripts/overlap_gpu.sh
mkdir -p $out/prof
t0=$SECONDS
timeout 150 python3 -m mimw.bench.overlap --model llama-3.2-1b --backend megakernel --batches 1 --tokens 128 \
  --profile --out $out/prof > $out/prof/prof.log 2>&1
echo "profile rc $? in $((SECONDS - t0)) s"
grep -E "device only|device us a step|host ops recorded|^\[overlap\] batch|^gaps" $out/prof/prof.log | cut -c1-1500
