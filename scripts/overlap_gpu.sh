#!/usr/bin/env bash
# The overlap scheduler (engine/overlap.py) on a Hopper GPU in one call, from the working tree (nothing installed;
# torch and triton as on the GPU machine; no server, no network):
#   tests   its GPU tests (tests/engine/test_overlap.py: the overlapped engine equals the synchronous one on the GPU,
#           the megakernel's decode + device sampling never synchronise the host, the megakernel engine with overlap
#           equals it without), the megakernel backend's engine test and the short steps' graphs against the eager
#           pass (tests/engine/test_step_graphs_gpu.py), cut at 180 s;
#   bench   `mimw bench overlap`: Llama-3.2-1B shape (random weights), megakernel backend, batches 1, 8 and 32: the
#           backend's step, the kernel's graph replay and the engine's inter-token latency through an EngineLoop
#           (in-process), overlap off and on, with the graph captures and eager first sightings inside each
#           measure; cut at 200 s (about 2 minutes once the kernels are compiled).
# $OUT (default bench/results/overlap) receives overlap-tests.log, overlap-bench.log and overlap-<gpu>-<model>.json;
# the last lines printed are the tests' verdict and the table.
#   OUT=/some/dir bash scripts/overlap_gpu.sh                 # both parts
#   PARTS=bench OUT=/some/dir bash scripts/overlap_gpu.sh     # the measurement only
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=${OUT:-bench/results/overlap}
mkdir -p "$out"
parts=" ${PARTS:-tests bench} "

if [[ "$parts" == *" tests "* ]]; then
    timeout 180 python3 -m pytest -q -p no:cacheprovider -rfEs tests/engine/test_overlap.py \
        tests/engine/test_megakernel_backend_gpu.py tests/engine/test_step_graphs_gpu.py > "$out/overlap-tests.log" 2>&1
    tests_rc=$?
    grep -E "^(FAILED|ERROR)" "$out/overlap-tests.log" | head -20
    echo "tests (rc $tests_rc): $(tail -n 1 "$out/overlap-tests.log")"
fi
if [[ "$parts" == *" bench "* ]]; then
    timeout 200 python3 -m mimw.bench.overlap --model llama-3.2-1b --backend megakernel --batches 1,8,32 \
        --tokens 128 --out "$out" > "$out/overlap-bench.log" 2>&1
    bench_rc=$?
    echo "bench (rc $bench_rc):"
    tail -n 8 "$out/overlap-bench.log"
fi
