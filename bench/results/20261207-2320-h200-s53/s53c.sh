#!/usr/bin/env bash
# Session 53, call C (~8 min, any Hopper GPU): is a multi-token step's per-instruction cost its smaller ring?
# (branch probe: Tuning.probe skips parts of the step, wrong results, timing only; Tuning.down_parts)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu-c.txt"
bs() { name=$1; shift; t0=$SECONDS; OUT="$out" timeout "$@" > "$out/$name.log" 2>&1; echo "$name rc $? in $((SECONDS - t0)) s"
       cp "$out/batch_step.json" "$out/$name.json" 2>/dev/null; }
bs m1ring 150 python3 -m mimw.megakernel.tools.batch_step --models llama-3.2-1b,llama-3.1-8b --batches 1 \
    --tunings "default;ring=9;ring=5"
bs mt1b 170 python3 -m mimw.megakernel.tools.batch_step --models llama-3.2-1b --batches 2,8,16 \
    --tunings "default;down_parts=4;probe=1;probe=4"
bs mt8b 200 python3 -m mimw.megakernel.tools.batch_step --models llama-3.1-8b --batches 8 --verify 1x16 \
    --tunings "default;down_parts=4;probe=1"
grep -h "^\[batch_step\]" "$out"/m1ring.log "$out"/mt1b.log "$out"/mt8b.log
grep -h "Error\|error" "$out"/m1ring.log "$out"/mt1b.log "$out"/mt8b.log | tail -5
