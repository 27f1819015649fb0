#!/usr/bin/env bash
# The overlap scheduler (engine/overlap.py) on a Hopper GPU in one call (a few minutes), from the working tree:
#   1. its GPU tests: the overlapped engine equals the synchronous one on the GPU (reference backend), and the
#      megakernel backend's engine test (decode token ids now fed on the device), cut at 90 s;
#   2. `mimw bench overlap`: Llama-3.2-1B shape (random weights), megakernel backend, batches 1, 8 and 32: the
#      backend's step, the kernel's graph replay and the engine's inter-token latency through an EngineLoop
#      (in-process, no HTTP), overlap off and on; cut at 180 s.
# $OUT (default bench/results/overlap) receives overlap-tests.log, overlap-bench.log and overlap-<gpu>-<model>.json;
# the last lines printed are the tests' verdict and the table.
#   OUT=/some/dir bash scripts/overlap_gpu.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=${OUT:-bench/results/overlap}
mkdir -p "$out"

timeout 90 python3 -m pytest -q -p no:cacheprovider -rfE tests/engine/test_overlap.py \
    tests/engine/test_megakernel_backend_gpu.py > "$out/overlap-tests.log" 2>&1
tests_rc=$?

timeout 180 python3 -m mimw.bench.overlap --model llama-3.2-1b --backend megakernel --batches 1,8,32 \
    --tokens 128 --out "$out" > "$out/overlap-bench.log" 2>&1
bench_rc=$?

grep -E "^(FAILED|ERROR)" "$out/overlap-tests.log" | head -20
echo "tests (rc $tests_rc): $(tail -n 1 "$out/overlap-tests.log")"
echo "bench (rc $bench_rc):"
tail -n 8 "$out/overlap-bench.log"
