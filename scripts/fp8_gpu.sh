#!/usr/bin/env bash
# The megakernel over an fp8 KV cache on a Hopper GPU (H200: ~6-7 min, at most 9 by the parts' time limits), from
# the working tree (nothing installed):
#   tests   tests/megakernel/test_kernel_gpu.py -k "fp8 or 2_31": the kernel over an fp8 cache against the reference
#           over the same fp8 cache (4 shapes x contexts 17 and 8191 x 64 steps, and the tickets), the finisher's row
#           store bit for bit against kv/fp8.py's quantiser, and the 8B over a pool past 2^31 elements (bf16, fp8);
#           tests/megakernel/test_batch_gpu.py -k fp8: decode batches (1B x 8, 8B x 16) and verify blocks at
#           context 17 (block 0's rows of the same launch reloaded after the wait, with their scales) over fp8
#   bench   `mimw bench decode` of mimw-megakernel at contexts 8192, 32768, 131072 for llama-3.2-1b and
#           llama-3.1-8b, batch 1, once with --kv-dtype bf16 and once with fp8 (each row's floor at its own KV
#           bytes), then the two side by side (mimw.bench.kv_compare), the table last
# JSON (the bench records, kv-compare.json) and logs go to $OUT (default bench/results/fp8-gpu).
#   bash scripts/fp8_gpu.sh                  # both parts
#   PARTS=bench bash scripts/fp8_gpu.sh      # one part (each fits one 10-minute device call on its own)
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=${OUT:-bench/results/fp8-gpu}
mkdir -p "$out"
work=$(mktemp -d)  # the bench's .md/.png stay here: $OUT brings back a few files only
parts=" ${PARTS:-tests bench} "
status=()

if [[ "$parts" == *" tests "* ]]; then
    timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider tests/megakernel/test_kernel_gpu.py \
        tests/megakernel/test_batch_gpu.py -k "fp8 or 2_31" > "$out/fp8-tests.log" 2>&1
    status+=("fp8 GPU tests: exit $? ($(tail -n 1 "$out/fp8-tests.log"))")
fi
if [[ "$parts" == *" bench "* ]]; then
    for kv in bf16 fp8; do
        timeout "${BENCH_TIMEOUT:-150}" python3 -m mimw.bench.main decode --model llama-3.2-1b,llama-3.1-8b \
            --context 8192,32768,131072 --backends mimw-megakernel --kv-dtype "$kv" --budget-s 1 --iters 50 \
            --out "$work/$kv" > "$out/bench-$kv.log" 2>&1
        status+=("bench decode --kv-dtype $kv: exit $?")
        cp "$work/$kv"/*.json "$out/" 2>/dev/null
    done
fi
printf '%s\n' "${status[@]}"
if [[ "$parts" == *" bench "* ]]; then  # the table last
    echo
    python3 -m mimw.bench.kv_compare "$work"/*/*.json --json "$out/kv-compare.json"
fi
