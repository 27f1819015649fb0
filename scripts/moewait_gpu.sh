#!/usr/bin/env bash
# Issue 31, the MoE routing wait (device/route_wait.py), on a Hopper GPU in one device call (at most ~9 min by the
# parts' time limits), from the working tree (nothing installed):
#   tests  tests/megakernel/test_moe_gpu.py (200 s at most): the MoE steps against the fp32 oracle, and every
#          routing wait traced with the default tuning
#   bench  tools/batch_step: 12 layers of qwen3-30b-a3b, batches 1 and 8, context 1024, the default tuning, each cell
#          also traced once: per op the wait and busy times, the critical path per layer, and the loaders' routing
#          wait per layer (mean and longest over the SMs that waited); the table last
# Logs and batch_step.json go to $OUT (default bench/results/moewait-gpu).
#   OUT=/some/dir bash scripts/moewait_gpu.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=${OUT:-bench/results/moewait-gpu}
mkdir -p "$out"
status=()

timeout "${TESTS_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider tests/megakernel/test_moe_gpu.py \
    > "$out/moe-gpu-tests.log" 2>&1
status+=("MoE GPU tests: exit $? ($(tail -n 1 "$out/moe-gpu-tests.log"))")

OUT="$out" timeout "${BENCH_TIMEOUT:-300}" python3 -m mimw.megakernel.tools.batch_step --models qwen3-30b-a3b \
    --layers 12 --batches 1,8 --trace > "$out/batch-step.log" 2>&1
status+=("batch_step: exit $?")

printf '%s\n' "${status[@]}"
grep -E "FAILED|Error" "$out/moe-gpu-tests.log" | head -n 20
echo
# each traced cell: its label, step time, the MoE layer's ops, the critical path and the routing waits
grep -E "^(---|step |read bandwidth|ATTN_IN |ATTN_PARTIAL |O_PROJ |ROUTER |EXPERT_IN |EXPERT_DOWN |critical path|loader routing wait)" \
    "$out/batch-step.log"
echo
grep -A 8 "^model " "$out/batch-step.log" | tail -n 9  # the table last
