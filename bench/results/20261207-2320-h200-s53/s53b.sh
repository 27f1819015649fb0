#!/usr/bin/env bash
# Session 53, call B (~7 min, the H200 targets): overlap batch 1 and 32 (#30 item 1), prefill 1B/8B 32k + 128k,
# gluon against plain SDPA (#26).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader | tee "$out/gpu-b.txt"
t0=$SECONDS
timeout 150 python3 -m mimw.bench.overlap --model llama-3.2-1b --backend megakernel --batches 1,32 --tokens 128 \
    --out "$out" > "$out/overlap.log" 2>&1
echo "overlap rc $? in $((SECONDS - t0)) s"
grep -E '^\[overlap\] batch' "$out/overlap.log" | cut -c1-600; tail -n 6 "$out/overlap.log"
t0=$SECONDS
timeout 330 python3 -m mimw.bench.main prefill --out "$out" --deadline-s 280 --lengths 32768,131072 \
    --impls plain-sdpa,gluon --chunk-sweep '' --no-engine --attention-lengths 32768 > "$out/prefill.log" 2>&1
echo "prefill rc $? in $((SECONDS - t0)) s"
python3 -m mimw.bench.prefill_summary "$out"
