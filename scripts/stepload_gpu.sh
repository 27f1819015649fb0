#!/usr/bin/env bash
# A graphed step's inputs in one copy (mimw/step_inputs.py: one device buffer, one non-blocking copy a step from a
# ring of pinned host buffers) on a Hopper GPU in one call, from the working tree (nothing installed; no network):
#   tests   the megakernel backend's GPU tests (tests/engine/test_megakernel_backend_gpu.py: decode, batch, verify
#           and MoE steps against the reference, 32 concurrent requests), the overlap tests
#           (tests/engine/test_overlap.py: the overlapped engine equals the synchronous one; the megakernel's
#           replays, multi-token steps and graphed pass, and the device sampler, never synchronise) and the
#           step-graph replays against the eager pass (tests/engine/test_step_graphs_gpu.py); cut at 210 s;
#   bench   `mimw bench overlap --profile`: Llama-3.2-1B shape (random weights), megakernel backend, batches 1, 8
#           and 32, 128 tokens a request: the backend's step, the kernel's graph replay and the engine's
#           inter-token latency, overlap off and on; then each engine's timed requests at batch 32 under
#           torch.profiler (the host calls that wait for the device by CPU time; a Chrome trace per mode); cut at
#           220 s.
# $OUT (default bench/results/stepload) receives stepload-tests.log, stepload-bench.log (the table and both
# profiles), overlap-<gpu>-<model>.json and profile-{sync,overlap}-b32.json; the last lines printed are the tests'
# verdict, the table and each profile's top rows.
#   OUT=/some/dir bash scripts/stepload_gpu.sh                 # both parts (under 8 minutes)
#   PARTS=bench OUT=/some/dir bash scripts/stepload_gpu.sh     # the measurement only
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=${OUT:-bench/results/stepload}
mkdir -p "$out"
parts=" ${PARTS:-tests bench} "

if [[ "$parts" == *" tests "* ]]; then
    timeout 210 python3 -m pytest -q -p no:cacheprovider -rfEs tests/engine/test_megakernel_backend_gpu.py \
        tests/engine/test_overlap.py tests/engine/test_step_graphs_gpu.py > "$out/stepload-tests.log" 2>&1
    tests_rc=$?
    grep -E "^(FAILED|ERROR)" "$out/stepload-tests.log" | head -20
    echo "tests (rc $tests_rc): $(tail -n 1 "$out/stepload-tests.log")"
fi
if [[ "$parts" == *" bench "* ]]; then
    timeout 220 python3 -m mimw.bench.overlap --model llama-3.2-1b --backend megakernel --batches 1,8,32 \
        --tokens 128 --out "$out" --profile > "$out/stepload-bench.log" 2>&1
    bench_rc=$?
    echo "bench (rc $bench_rc):"
    grep -E "^\[overlap\] batch|^\| " "$out/stepload-bench.log" | head -8
    # each profile's header and its top rows by self CPU time (a host wait shows as cudaStreamSynchronize,
    # cudaEventSynchronize, cudaHostAlloc or a blocking Memcpy here)
    grep -A 14 -E "^\[overlap\] profile" "$out/stepload-bench.log" | cut -c 1-160
fi
