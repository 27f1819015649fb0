#!/usr/bin/env bash
set -u
out=$OUT; cd .carry/probe
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT="$out" timeout 120 python3 -m mimw.megakernel.tools.batch_step --models llama-3.2-1b --batches 2,8 \
    --tunings "default;probe=2;probe=1" > "$out/p2_1b.log" 2>&1; echo "rc $?"
OUT="$out" timeout 150 python3 -m mimw.megakernel.tools.batch_step --models llama-3.1-8b --batches 8 --verify 1x16 \
    --tunings "probe=2" > "$out/p2_8b.log" 2>&1; echo "rc $?"
grep -h "^\[batch_step\]" "$out"/p2_1b.log "$out"/p2_8b.log
