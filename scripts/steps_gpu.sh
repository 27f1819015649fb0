#!/usr/bin/env bash
# Multi-token steps on a Hopper GPU in one call (~5 minutes on an H100/H200), from the working tree:
#   1. GPU tests of the megakernel backend's step paths (StepGraphs, the router, a mixed step; cut at 150 s);
#   2. `python -m mimw.bench.batch_steps`: decode batches 1..64 and verify blocks against their floor, per-sequence
#      replays against one pass (Llama-3.2-1B and Llama-3.1-8B shapes, random weights, context 1024), and against
#      the peers in $PEERS (default torch-graph: the batched PyTorch decoder in a CUDA graph, built and captured in
#      seconds a shape; PEERS= for none), each peer at most $PEER_BUDGET_S seconds a model (default 30; later
#      shapes say it was skipped); the JSON, the tables and the chart (ms per step vs tokens per step) land in $OUT
#      as <stamp>-batch-steps.json/.md/.png. PEERS=torch-graph,torch-compile compiles every shape with Inductor
#      max-autotune (not yet timed on a GPU; each row records <peer>_build_s): too slow for this script's share of
#      the call; run it as a call of its own (the command in bench/README.md, "Multi-token steps");
#   3. `python -m mimw.bench.spec_steps`: verify-step timings through the megakernel backend x the acceptance that
#      `mimw bench spec` measured on the CPU with the real default model (SPEC_RESULTS).
# $OUT (default bench/results/steps) receives the logs and JSON; the tables are printed last.
#   COMMIT=<sha> OUT=$OUT bash scripts/steps_gpu.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=${OUT:-bench/results/steps}
mkdir -p "$out"
models=${MODELS:-llama-3.2-1b,llama-3.1-8b}
spec_results=${SPEC_RESULTS:-$(ls bench/results/*-cpu-spec-*.json | tail -n 1)}
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/engine/test_step_graphs_gpu.py \
    tests/engine/test_megakernel_backend_gpu.py > "$out/steps-tests.log" 2>&1
echo "tests (rc $?): $(tail -n 1 "$out/steps-tests.log")"
timeout 270 python3 -m mimw.bench.main steps --model "$models" --context "${CONTEXT:-1024}" \
    --batch 1,2,4,8,16,32,64 --verify 4,16 --budget-s 0.3 --peers "${PEERS-torch-graph}" \
    --peer-budget-s "${PEER_BUDGET_S:-30}" --out "$out" > "$out/batch-steps.md" 2> "$out/batch-steps.log"
echo "batch_steps (rc $?)"
timeout 170 python3 -m mimw.bench.spec_steps --results "$spec_results" --model "$models" --backend megakernel \
    --context "${CONTEXT:-1024}" --budget-s 0.3 --out "$out" > "$out/spec-steps.md" 2> "$out/spec-steps.log"
echo "spec_steps (rc $?)"
grep -h "k=" "$out/spec-steps.log" | sed 's/^\[spec_steps\] //'
# a bench cut by its timeout printed no table: its stamped markdown, rewritten after every shape, has the rows
[ -s "$out/batch-steps.md" ] || cat "$(ls "$out"/*-batch-steps.md 2>/dev/null | tail -n 1)" > "$out/batch-steps.md" 2>/dev/null
cat "$out/batch-steps.md" "$out/spec-steps.md"
