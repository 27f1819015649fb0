#!/usr/bin/env bash
# Session 54, call A (~8 min, any Hopper GPU): branch normpass (normpass.patch: the multi-token staging's norm passes
# in rounds of whole chunks). Working tree = the branch; .carry/probe = main's tree (`git archive main src tests`).
# Three decode-batch checks first, then timings against main, a traced 8B run, then the rest of its GPU tests.
set -u
export PYTHONUNBUFFERED=1
out=$OUT; root=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu-e.txt"
T=tests/megakernel/test_batch_gpu.py
D=$T::test_decode_batches_match_reference_over_16_steps
V=$T::test_verify_blocks_match_reference_over_8_steps
export PYTHONPATH=src
t0=$SECONDS
timeout 90 python3 -m pytest -v -p no:cacheprovider -rfE "$D[smollm2-135m-2-17]" "$D[llama-3.2-1b-5-1000]" \
  "$D[llama-3.1-8b-8-1000]" > "$out/tests1.log" 2>&1
echo "tests1 rc $? in $((SECONDS - t0)) s: $(tail -n 1 "$out/tests1.log")"
bs() { name=$1; shift; t0=$SECONDS; OUT="$out" timeout "$@" > "$out/$name.log" 2>&1; echo "$name rc $? in $((SECONDS - t0)) s"
       cp "$out/batch_step.json" "$out/$name.json" 2>/dev/null; }
bs new1b 50 python3 -m mimw.megakernel.tools.batch_step --models llama-3.2-1b --batches 2,8,16
bs new8b 80 python3 -m mimw.megakernel.tools.batch_step --models llama-3.1-8b --batches 8 --verify 1x16
cd $root/.carry/probe
bs base8b 80 python3 -m mimw.megakernel.tools.batch_step --models llama-3.1-8b --batches 8 --verify 1x16
bs base1b 50 python3 -m mimw.megakernel.tools.batch_step --models llama-3.2-1b --batches 2,8,16
cd $root
bs tr8b 100 python3 -m mimw.megakernel.tools.batch_step --models llama-3.1-8b --batches 1,8 --verify 1x16 --trace
cd $root
grep -h "^\[batch_step\]" "$out"/new1b.log "$out"/new8b.log "$out"/base8b.log "$out"/base1b.log
t0=$SECONDS
timeout $((${T_END:-380} - SECONDS)) python3 -m pytest -v -p no:cacheprovider -rfE \
  "$D[smollm2-135m-13-1000]" "$V[llama-3.2-1b-16-ctx1000]" "$V[llama-3.2-1b-4x3x1-ctx1000]" \
  "$D[llama-3.2-1b-32-1000]" "$V[llama-3.2-1b-9x6x1-ctx1000]" "$V[llama-3.2-1b-2x1x2-padded-ctx1000]" \
  "$D[qwen3-8b-5-1000]" "$V[llama-3.2-1b-20x1-padded-ctx1000]" "$V[llama-3.2-1b-16-ctx37]" \
  "$T::test_fp8_decode_batches_match_reference_over_the_same_fp8_cache[llama-3.2-1b-8]" \
  "$D[smollm2-135m-32-1000]" "$D[llama-3.2-1b-16-1000]" "$D[llama-3.1-8b-16-1000]" "$V[llama-3.1-8b-16-ctx1000]" \
  > "$out/tests2.log" 2>&1
echo "tests2 rc $? in $((SECONDS - t0)) s: $(tail -n 1 "$out/tests2.log")"
grep -hoE "(test_[a-z_0-9]*\[[^]]*\]) (PASSED|FAILED|ERROR|SKIPPED)" "$out/tests1.log" "$out/tests2.log" | sed "s/test_[a-z_0-9]*\[//" | head -20
