#!/usr/bin/env bash
# Session 54, call C (~6 min, any Hopper GPU; an H200 for the #28 targets): branch fp8v (an fp8 slot's V^T fragments
# from words: one prmt a byte pair, one cvt a register). The working tree is the branch; .carry/base is main's tree
# (`mkdir -p .carry/base && git archive main src | tar -x -C .carry/base`). First its GPU tests (the ring walks and
# every fp8 decode case), then a same-run A/B of the fp8 decode step at 32k and 128k (1B) and 32k (8B), main first.
set -u
export PYTHONUNBUFFERED=1
out=$OUT
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu-c.txt"
t0=$SECONDS
PYTHONPATH=src timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE tests/megakernel/test_kernel_gpu.py \
  -k "ring_walks or fp8_kv_megakernel or fp8_kv_tickets" > "$out/fp8v-tests.log" 2>&1
echo "tests rc $? in $((SECONDS - t0)) s: $(tail -n 1 "$out/fp8v-tests.log")"
KV=fp8 MODELS=llama-3.2-1b CONTEXTS=32768,131072 PASSES=1 TREES="base=.carry/base/src head=src" OUT=$out/ab1b \
  bash scripts/bench_ab.sh | tail -n 8
KV=fp8 MODELS=llama-3.1-8b CONTEXTS=32768 PASSES=1 TREES="base=.carry/base/src head=src" OUT=$out/ab8b \
  bash scripts/bench_ab.sh | tail -n 4
KV=bf16 MODELS=llama-3.2-1b CONTEXTS=131072 PASSES=1 TREES="head=src" OUT=$out/bf16 bash scripts/bench_ab.sh | tail -n 3
