#!/usr/bin/env bash
# The megakernel's verification on a Hopper GPU, from the working tree (nothing installed; needs torch and triton
# 3.6 with Gluon, as on the H200 machine), in parts that each fit one 10-minute device call:
#   tests      tests/megakernel/test_kernel_gpu.py: the shipping kernel for 4 shapes x contexts 1/17/1000/8191 x 64
#              steps, the tickets, other SM counts, release-hold settings, the decoder's fall-back to tickets, the
#              traced launch; the cluster probe, the engine's megakernel backend (MoE decode batches included), its
#              short steps' graphs and the overlapped engine (~7 min)
#   sanitize   compute-sanitizer synccheck on small shapes (case by case, each in its own process, if it errs; ~2 min)
#   racecheck  compute-sanitizer racecheck on the same cases (cut at 200 s)
#   trace      the per-instruction trace of the 1B and 8B shapes at context 1024 (~2 min)
#   batches    tests/megakernel/test_batch_gpu.py: decode batches (B = 2, 5, 8; 4 shapes; contexts 17 and 1000) against
#              the reference, then tools/batch_step (ms vs floor vs the M = 1 step; 1B and 8B at B = 1 and 8)
# Logs go to $OUT (default bench/results/gpu-check); a table of what passed last.
#   PARTS="tests sanitize" bash scripts/gpu_check.sh        # these parts (default: tests and sanitize)
#   COMMIT=<sha> VARIANTS=a,b PARTS=trace bash scripts/gpu_check.sh   # record the commit; time these variants
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=${SRC:-src} PYTHONUNBUFFERED=1  # SRC: another source tree to check (the tests are this tree's)
out=${OUT:-bench/results/gpu-check}
mkdir -p "$out"
sanitizer=${COMPUTE_SANITIZER:-compute-sanitizer}
declare -A rc

parts=" ${PARTS:-tests sanitize} "
has() { [[ "$parts" == *" $1 "* ]]; }

if has tests; then
    # under a time limit: a cluster barrier or counter that never completes hangs the kernel
    timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -q -p no:cacheprovider tests/megakernel/test_kernel_gpu.py \
        tests/megakernel/test_cluster.py tests/engine/test_megakernel_backend_gpu.py tests/engine/test_step_graphs_gpu.py \
        tests/engine/test_overlap.py > "$out/gpu-tests.log" 2>&1
    rc[gpu-tests]=$?
    tail -n 3 "$out/gpu-tests.log"
fi
if has sanitize; then
    # synccheck over every case in one process; if it errs (an error aborts the launch and the process's CUDA
    # context, hiding the later cases), again case by case, each in its own process, to say which cases err
    timeout "${SANITIZER_TIMEOUT:-200}" "$sanitizer" --tool synccheck --print-limit 5 \
        python3 -m mimw.megakernel.tools.sanitize > "$out/synccheck.log" 2>&1
    rc[synccheck]=$?
    grep -h "ERROR SUMMARY" "$out/synccheck.log"
    if [[ ${rc[synccheck]} != 0 ]]; then
        for case in $(python3 -m mimw.megakernel.tools.sanitize --list); do
            echo "### $case" >> "$out/synccheck-cases.log"
            timeout "${SANITIZER_TIMEOUT:-200}" "$sanitizer" --tool synccheck --print-limit 5 \
                python3 -m mimw.megakernel.tools.sanitize --case "$case" >> "$out/synccheck-cases.log" 2>&1
            echo "$case: $(grep -h "ERROR SUMMARY" "$out/synccheck-cases.log" | tail -n 1)"
        done
    fi
fi
if has racecheck; then
    timeout "${SANITIZER_TIMEOUT:-200}" "$sanitizer" --tool racecheck python3 -m mimw.megakernel.tools.sanitize \
        > "$out/racecheck.log" 2>&1
    rc[racecheck]=$?
    grep -h "RACECHECK SUMMARY" "$out/racecheck.log"
    # racecheck's reports per kernel and source line: ws_control (tools/sanitize.py) is the warp_specialize baseline
    grep -o "access at [a-z_]*+0x[0-9a-f]* in [a-z_]*\.py:[0-9]*" "$out/racecheck.log" | sed 's/+0x[0-9a-f]*//' \
        | sort | uniq -c
fi
if has batches; then
    timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -q -p no:cacheprovider -x tests/megakernel/test_batch_gpu.py \
        > "$out/batch-tests.log" 2>&1
    rc[batch-tests]=$?
    tail -n 3 "$out/batch-tests.log"
    OUT="$out" timeout 240 python3 -m mimw.megakernel.tools.batch_step > "$out/batch-step.log" 2>&1
    rc[batch-step]=$?
    tail -n 12 "$out/batch-step.log"
fi
if has trace; then
    python3 -m mimw.megakernel.tools.variants --models llama-3.2-1b,llama-3.1-8b --variants "${VARIANTS:-default}" \
        ${COMMIT:+--commit "$COMMIT"} --check-steps "${CHECK_STEPS:-8}" --trace --out "$out" > "$out/trace.log" 2>&1
    rc[trace]=$?
    sed -n '/^model /,$p' "$out/trace.log"
fi
status=0
for k in "${!rc[@]}"; do
    printf '%-10s exit %s\n' "$k" "${rc[$k]}"
    [ "${rc[$k]}" -eq 0 ] || status=1
done
exit $status
