#!/usr/bin/env bash
# The megakernel's verification on a Hopper GPU, from the working tree (nothing installed; needs torch and triton
# 3.6 with Gluon, as on the H200 machine), in parts that each fit one 10-minute device call:
#   tests      the default kernel (cluster pairs, st.async): 4 shapes x contexts 1/17/1000/8191 x 64 steps with
#              the tensor-core consumer, the CUDA-core one at 1/8191, the traced launch, the standalone GEMV, the
#              engine's backend (29, ~4 min)
#   optin      the opt-in kernels' tests: heads finished in attention, the K/V pipeline, merged releases, O_PROJ in
#              column parts, the shuffle epilogue (42, ~7 min)
#   hold       the ring's request and release settings and session 18's builds: the release hold's other
#              settings, ended before the fence or at some boundaries only, or without the host's marks (the
#              setting before session 21), the deeper in-flight cap for some ops, the per-warp releases, DOWN_PROJ's
#              cluster pairs, and the decoder's fall-back to tickets (27, ~5.5 min)
#   s19        session 19's builds: the hold as a count (opt-in), the step's attention row as one position and a
#              DOWN_PROJ half staging its own columns (the default since session 20) beside their off settings (17,
#              ~3.5 min)
#   s22        session 22's defaults beside their off settings: the staging buffer sized for a whole DOWN_PROJ
#              (half_hbuf=False: 3) and the attention warps' merge through shared memory and without it
#              (attn_smem_merge: 12; ~2.5 min)
#   versioned  the versioned-word tests (25, ~4 min), in their own process under a time limit (a reader whose
#              words never come spins: a hang must not eat the call)
#   sanitize   compute-sanitizer synccheck (case by case, each in its own process, if it errs) and racecheck on
#              small shapes (~5 min; racecheck is cut at 200 s; SANITIZE_ARGS=--hold-count: every kernel with the
#              hold's count)
#   trace      the per-instruction trace of the 1B and 8B shapes at context 1024 (~2.5 min)
#   cluster    thread-block clusters (gpu/cluster.py): the probe's test, the GPU file's cluster_qkv modes beside
#              the default (0, tickets; 1, release arrivals: 4 shapes x contexts 1/1000/8191 x 64 steps), then the
#              probe's timings (~4 min; not in the default list)
# Logs go to $OUT (default bench/results/gpu-check); a table of what passed last.
#   PARTS="tests sanitize" bash scripts/gpu_check.sh        # these parts (default: all eight, past one call)
#   COMMIT=<sha> VARIANTS=a,b PARTS=trace bash scripts/gpu_check.sh   # record the commit; time these variants
#   TRACE_TILES=1 PARTS=trace bash scripts/gpu_check.sh      # the trace also stamps every weight tile
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=${OUT:-bench/results/gpu-check}
mkdir -p "$out"
sanitizer=${COMPUTE_SANITIZER:-compute-sanitizer}
declare -A rc

parts=" ${PARTS:-tests optin hold s19 s22 versioned sanitize trace} "
has() { [[ "$parts" == *" $1 "* ]]; }

if has tests; then
    python3 -m pytest -q -p no:cacheprovider tests/megakernel/test_kernel_gpu.py tests/megakernel/test_gemv_gpu.py \
        tests/engine/test_megakernel_backend_gpu.py \
        -k "megakernel_matches_reference or traced_launch or gemv or backend" > "$out/gpu-tests.log" 2>&1
    rc[gpu-tests]=$?
    tail -n 3 "$out/gpu-tests.log"
fi
hold_k="(release_hold or deeper_in_flight or per_warp_releases or down_proj_pairs or falls_back)"
s19_k="(hold_count or attention_row or down_half_stage)"
s22_k="(whole_hbuf or attn_smem_merge)"
if has optin; then
    python3 -m pytest -q -p no:cacheprovider tests/megakernel/test_kernel_gpu.py \
        -k "not versioned and not megakernel_matches_reference and not traced_launch and not cluster_pairs and not $hold_k \
            and not $s19_k and not $s22_k" \
        > "$out/optin-tests.log" 2>&1
    rc[optin]=$?
    tail -n 3 "$out/optin-tests.log"
fi
if has hold; then
    python3 -m pytest -q -p no:cacheprovider tests/megakernel/test_kernel_gpu.py \
        -k "$hold_k" > "$out/hold-tests.log" 2>&1
    rc[hold]=$?
    tail -n 3 "$out/hold-tests.log"
fi
if has s19; then
    python3 -m pytest -q -p no:cacheprovider tests/megakernel/test_kernel_gpu.py \
        -k "$s19_k" > "$out/s19-tests.log" 2>&1
    rc[s19]=$?
    tail -n 3 "$out/s19-tests.log"
fi
if has s22; then
    python3 -m pytest -q -p no:cacheprovider tests/megakernel/test_kernel_gpu.py \
        -k "$s22_k" > "$out/s22-tests.log" 2>&1
    rc[s22]=$?
    tail -n 3 "$out/s22-tests.log"
fi
if has versioned; then
    timeout "${VERSIONED_TIMEOUT:-330}" python3 -m pytest -v -x -p no:cacheprovider tests/megakernel/test_kernel_gpu.py \
        -k versioned > "$out/versioned-tests.log" 2>&1
    rc[versioned]=$?
    tail -n 3 "$out/versioned-tests.log"
fi
if has sanitize; then
    # synccheck over every case in one process; if it errs (an error aborts the launch and the process's CUDA
    # context, hiding the later cases), again case by case, each in its own process, to say which cases err.
    # SANITIZE_ARGS=--hold-count runs every kernel with the release hold's count instead of its mbarrier
    timeout "${SANITIZER_TIMEOUT:-200}" "$sanitizer" --tool synccheck --print-limit 5 \
        python3 -m mimw.megakernel.gpu.sanitize ${SANITIZE_ARGS:-} > "$out/synccheck.log" 2>&1
    rc[synccheck]=$?
    grep -h "ERROR SUMMARY" "$out/synccheck.log"
    if [[ ${rc[synccheck]} != 0 ]]; then
        for case in $(python3 -m mimw.megakernel.gpu.sanitize --list ${SANITIZE_ARGS:-}); do
            echo "### $case" >> "$out/synccheck-cases.log"
            timeout "${SANITIZER_TIMEOUT:-200}" "$sanitizer" --tool synccheck --print-limit 5 \
                python3 -m mimw.megakernel.gpu.sanitize --case "$case" ${SANITIZE_ARGS:-} \
                >> "$out/synccheck-cases.log" 2>&1
            echo "$case: $(grep -h "ERROR SUMMARY" "$out/synccheck-cases.log" | tail -n 1)"
        done
    fi
    timeout "${SANITIZER_TIMEOUT:-200}" "$sanitizer" --tool racecheck python3 -m mimw.megakernel.gpu.sanitize \
        ${SANITIZE_ARGS:-} > "$out/racecheck.log" 2>&1
    rc[racecheck]=$?
    grep -h "RACECHECK SUMMARY" "$out/racecheck.log"
    # racecheck's reports per kernel and source line: ws_control (sanitize.py) is the warp_specialize baseline
    grep -o "access at [a-z_]*+0x[0-9a-f]* in [a-z_]*\.py:[0-9]*" "$out/racecheck.log" | sed 's/+0x[0-9a-f]*//' \
        | sort | uniq -c
fi
if has cluster; then
    # under a time limit: a cluster barrier that a peer never reaches hangs the kernel
    { timeout "${CLUSTER_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider tests/megakernel/test_cluster.py \
        tests/megakernel/test_kernel_gpu.py -k "cluster" \
        && timeout "${CLUSTER_TIMEOUT:-300}" python3 -m mimw.megakernel.gpu.cluster; } > "$out/cluster.log" 2>&1
    rc[cluster]=$?
    tail -n 2 "$out/cluster.log"
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
