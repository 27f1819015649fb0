#!/usr/bin/env bash
# The prefill path on a Hopper GPU in one call, from the working tree (nothing installed; torch 2.11 and triton 3.6
# as on the GPU machine). Two modes:
#
#   bash scripts/prefill_gpu.sh          (full, under 8 minutes on an H200)
#     1. its GPU tests (tests/prefill/test_prefill_gpu.py: 4 shapes, prompts 1/17/1000/4109 at several chunk
#        sizes, a cached prefix with several segments per call, each attention; decode after prefill through the
#        engine on the megakernel; and the megakernel backend's own test), cut at 150 s;
#     2. `mimw bench prefill`: Llama-3.2-1B and Llama-3.1-8B shapes (random weights), prompts 2k/8k/32k/128k, every
#        attention, a plain PyTorch SDPA prefill, the in-run GEMM roofline (MFU); then attention alone at several
#        tiles, a chunk sweep and engine TTFT, rows after 250 s skipped (killed at 300 s).
#
#   bash scripts/prefill_gpu.sh long     (the long-prompt attentions against each other, under 7 minutes)
#     1. the bf16 GPU tests of the gluon (the serving default) and triton attentions against the fp32 reference
#        (4 shapes, chunked, cached prefix, several segments per call) and of the short steps' CUDA graphs, cut at
#        150 s (the fp8 cases run in the full mode);
#     2. `mimw bench prefill` at 32k and 128k on both shapes: plain SDPA, gluon (the warp-specialized TMA kernel),
#        triton (tiles by head dim), no-attention (the runner's GEMMs and elementwise kernels alone: TTFT minus it
#        is a row's attention time); then attention alone for the last 16k-token pass of a 32k prompt (the paged
#        kernels at several tiles) and of a 128k prompt; rows after 190 s skipped (killed at 240 s).
#
# $OUT (default bench/results) receives prefill-tests.log, prefill-bench.log and <stamp>-<gpu>-prefill.{json,md,png};
# the last lines printed are the tests' verdict, attention alone, and the TTFT/MFU table.
#   COMMIT=<sha> bash scripts/prefill_gpu.sh [long]      (COMMIT: recorded in the JSON; the GPU copy has no .git)
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=${OUT:-bench/results}
mode=${1:-full}
mkdir -p "$out"

case "$mode" in
full)
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/prefill/test_prefill_gpu.py \
        tests/engine/test_megakernel_backend_gpu.py > "$out/prefill-tests.log" 2>&1
    tests_rc=$?
    timeout 300 python3 -m mimw.bench.main prefill --out "$out" --deadline-s 250 ${COMMIT:+--commit "$COMMIT"} \
        > "$out/prefill-bench.log" 2>&1
    bench_rc=$?
    ;;
long)
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/prefill/test_prefill_gpu.py \
        tests/engine/test_step_graphs_gpu.py -k "(gluon or triton or graph_replays) and not fp8" \
        > "$out/prefill-tests.log" 2>&1
    tests_rc=$?
    timeout 240 python3 -m mimw.bench.main prefill --out "$out" --deadline-s 190 --lengths 32768,131072 \
        --impls plain-sdpa,gluon,triton,no-attention --chunk-sweep '' --no-engine \
        --attention-lengths 32768,131072 \
        ${COMMIT:+--commit "$COMMIT"} > "$out/prefill-bench.log" 2>&1
    bench_rc=$?
    ;;
*)
    echo "usage: bash scripts/prefill_gpu.sh [full|long]" >&2
    exit 2
    ;;
esac

grep -E "^(FAILED|ERROR)" "$out/prefill-tests.log" | head -20
echo "tests (rc $tests_rc): $(tail -n 1 "$out/prefill-tests.log")"
echo "bench (rc $bench_rc): $(ls "$out"/*-prefill.json 2>/dev/null | tail -n 1)"
python3 -m mimw.bench.prefill_summary "$out"
