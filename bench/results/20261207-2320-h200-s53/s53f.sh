#!/usr/bin/env bash
# Session 53, call F (~2.5 min, any Hopper GPU): branch normpass's three decode-batch checks, then the 8B's decode
# batch of 8 on it and on main (.carry/probe at its default tuning), then more checks while time is left.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=src
out=$OUT; root=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu-f.txt"
T=tests/megakernel/test_batch_gpu.py
D=$T::test_decode_batches_match_reference_over_16_steps
V=$T::test_verify_blocks_match_reference_over_8_steps
timeout 70 python3 -m pytest -v -p no:cacheprovider -rfE "$D[smollm2-135m-2-17]" "$D[llama-3.2-1b-5-1000]" \
  "$D[llama-3.1-8b-8-1000]" > "$out/tests1.log" 2>&1
echo "tests1 rc $? at $SECONDS s"
bs() { name=$1; shift; OUT="$out" timeout "$@" > "$out/$name.log" 2>&1; echo "$name rc $? at $SECONDS s"; }
bs new8b 45 python3 -m mimw.megakernel.tools.batch_step --models llama-3.1-8b --batches 8
cd $root/.carry/probe; bs base8b 45 python3 -m mimw.megakernel.tools.batch_step --models llama-3.1-8b --batches 8
cd $root
grep -h "^\[batch_step\]" "$out"/new8b.log "$out"/base8b.log
timeout $((${T_END:-150} - SECONDS)) python3 -m pytest -v -p no:cacheprovider -rfE "$V[llama-3.2-1b-16-ctx1000]" \
  "$V[llama-3.2-1b-4x3x1-ctx1000]" "$D[smollm2-135m-13-1000]" "$D[llama-3.2-1b-32-1000]" > "$out/tests2.log" 2>&1
grep -hoE "(test_[a-z_0-9]*\[[^]]*\]) (PASSED|FAILED|ERROR|SKIPPED)" "$out/tests1.log" "$out/tests2.log" | sed "s/test_[a-z_0-9]*\[//"
