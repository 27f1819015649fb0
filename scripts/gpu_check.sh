#!/usr/bin/env bash
# The megakernel's verification on a Hopper GPU, from the working tree (nothing installed; needs torch and triton
# 3.6 with Gluon, as on the H200 machine): the GPU tests (4 shapes x contexts 1/17/1000/8191, 64 steps each, both
# consumers, the heads finished in attention, merged releases, the K/V pipeline, the standalone GEMV and the
# engine's megakernel backend),
# compute-sanitizer synccheck and racecheck on small shapes, and the per-instruction trace of the 1B and 8B shapes
# at context 1024. Logs go to $OUT (default bench/results/gpu-check); a table of what passed last.
#   bash scripts/gpu_check.sh            # ~15 minutes on an H200: tests (53) ~7, versioned (25) ~4,
#                                        # sanitize ~2.5, trace ~2.5 — so split it over two calls with PARTS
#   COMMIT=<sha> VARIANTS=a,b bash scripts/gpu_check.sh   # record the commit; time these KernelConfig variants
#   TRACE_TILES=1 bash scripts/gpu_check.sh                # the trace also stamps every weight tile
#   PARTS="tests versioned" bash scripts/gpu_check.sh      # only these parts (default: all four; the whole
#                                                          # script runs past one 10-minute device call)
# "versioned": the opt-in versioned-word tests, in their own process under a time limit (a reader whose words
# never come spins: a hang must not eat the call).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=${OUT:-bench/results/gpu-check}
mkdir -p "$out"
sanitizer=${COMPUTE_SANITIZER:-compute-sanitizer}
declare -A rc

parts=" ${PARTS:-tests versioned sanitize trace} "
has() { [[ "$parts" == *" $1 "* ]]; }

if has tests; then
    python3 -m pytest -q -p no:cacheprovider tests/megakernel/test_kernel_gpu.py tests/megakernel/test_gemv_gpu.py \
        tests/engine/test_megakernel_backend_gpu.py -k "not versioned" > "$out/gpu-tests.log" 2>&1
    rc[gpu-tests]=$?
    tail -n 3 "$out/gpu-tests.log"
fi
if has versioned; then
    timeout "${VERSIONED_TIMEOUT:-330}" python3 -m pytest -v -x -p no:cacheprovider tests/megakernel/test_kernel_gpu.py \
        -k versioned > "$out/versioned-tests.log" 2>&1
    rc[versioned]=$?
    tail -n 3 "$out/versioned-tests.log"
fi
if has sanitize; then
    for tool in synccheck racecheck; do
        timeout "${SANITIZER_TIMEOUT:-200}" "$sanitizer" --tool "$tool" python3 -m mimw.megakernel.gpu.sanitize \
            > "$out/$tool.log" 2>&1
        rc[$tool]=$?
    done
    grep -h "ERROR SUMMARY\|RACECHECK SUMMARY" "$out/synccheck.log" "$out/racecheck.log"
    # racecheck's reports per kernel and source line: ws_control (sanitize.py) is the warp_specialize baseline
    grep -o "access at [a-z_]*+0x[0-9a-f]* in [a-z_]*\.py:[0-9]*" "$out/racecheck.log" | sed 's/+0x[0-9a-f]*//' \
        | sort | uniq -c
fi
if has trace; then
    python3 -m mimw.megakernel.gpu.variants --models llama-3.2-1b,llama-3.1-8b --variants "${VARIANTS:-default}" \
        ${COMMIT:+--commit "$COMMIT"} --check-steps "${CHECK_STEPS:-8}" --trace ${TRACE_TILES:+--trace-tiles} \
        --out "$out" > "$out/trace.log" 2>&1
    rc[trace]=$?
    sed -n '/^model /,$p' "$out/trace.log"
fi
status=0
for k in "${!rc[@]}"; do
    printf '%-10s exit %s\n' "$k" "${rc[$k]}"
    [ "${rc[$k]}" -eq 0 ] || status=1
done
exit $status
