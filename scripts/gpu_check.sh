#!/usr/bin/env bash
# The megakernel's verification on a Hopper GPU, from the working tree (nothing installed; needs torch and triton
# 3.6 with Gluon, as on the H200 machine): the GPU tests (4 shapes x contexts 1/17/1000/8191, 64 steps each, the
# standalone GEMV and the engine's megakernel backend), compute-sanitizer synccheck and racecheck on small shapes, and the per-instruction trace of the
# 1B and 8B shapes at context 1024. Logs go to $OUT (default bench/results/gpu-check); a table of what passed last.
#   bash scripts/gpu_check.sh            # ~7 minutes on an H200 (both matvec consumers: 33 GPU tests)
#   COMMIT=<sha> VARIANTS=a,b bash scripts/gpu_check.sh   # record the commit; time these KernelConfig variants
#   TRACE_TILES=1 bash scripts/gpu_check.sh                # the trace also stamps every weight tile
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=${OUT:-bench/results/gpu-check}
mkdir -p "$out"
sanitizer=${COMPUTE_SANITIZER:-compute-sanitizer}
declare -A rc

python3 -m pytest -q -p no:cacheprovider tests/megakernel/test_kernel_gpu.py tests/megakernel/test_gemv_gpu.py \
    tests/engine/test_megakernel_backend_gpu.py > "$out/gpu-tests.log" 2>&1
rc[gpu-tests]=$?
for tool in synccheck racecheck; do
    "$sanitizer" --tool "$tool" python3 -m mimw.megakernel.gpu.sanitize > "$out/$tool.log" 2>&1
    rc[$tool]=$?
done
python3 -m mimw.megakernel.gpu.variants --models llama-3.2-1b,llama-3.1-8b --variants "${VARIANTS:-default}" ${COMMIT:+--commit "$COMMIT"} \
    --check-steps 8 --trace ${TRACE_TILES:+--trace-tiles} --out "$out" > "$out/trace.log" 2>&1
rc[trace]=$?

tail -n 3 "$out/gpu-tests.log"
grep -h "ERROR SUMMARY\|RACECHECK SUMMARY" "$out/synccheck.log" "$out/racecheck.log"
# racecheck's reports per kernel and source line: ws_control (sanitize.py) is the warp_specialize baseline
grep -o "access at [a-z_]*+0x[0-9a-f]* in [a-z_]*\.py:[0-9]*" "$out/racecheck.log" | sed 's/+0x[0-9a-f]*//' \
    | sort | uniq -c
sed -n '/^model /,$p' "$out/trace.log"
status=0
for k in gpu-tests synccheck racecheck trace; do
    printf '%-10s exit %s\n' "$k" "${rc[$k]}"
    [ "${rc[$k]}" -eq 0 ] || status=1
done
exit $status
