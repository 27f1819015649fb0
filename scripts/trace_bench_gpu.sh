#!/usr/bin/env bash
# The trace-replay benchmark at GPU scale (H100/H200): for each model shape (random weights), generate a synthetic
# agent trace, then replay it in-process twice on the same device pool - GPU-only LRU (the baseline) and session
# retention + host tier - with the pool sized so that the trace's working set is 4x larger. Prints one short table
# per model and writes <date>-<gpu>-<model>-<trace>.json/.md/.png (and the generated traces) to $OUT.
#
#   MODELS=llama-3.2-1b OUT=/some/dir COMMIT=<sha> bash scripts/trace_bench_gpu.sh   # one shape per call: each
#   MODELS=llama-3.1-8b OUT=/some/dir COMMIT=<sha> bash scripts/trace_bench_gpu.sh   # fits a 10-minute limit
#   OUT=/some/dir bash scripts/trace_bench_gpu.sh                                     # both shapes in one call
#   BACKEND=reference MODELS=llama-3.2-1b OUT=/some/dir bash scripts/trace_bench_gpu.sh   # the PyTorch oracle instead
#   SCALE=long MODELS=llama-3.2-1b OUT=/some/dir bash scripts/trace_bench_gpu.sh   # contexts ~16k-64k tokens
#
# The backend is the megakernel's unless BACKEND says otherwise (the bench's own default, auto, picks it on a Hopper
# GPU too; naming it here makes a run on another GPU fail instead of quietly measuring the reference decoder: on an
# H100 its steps took ~20 ms for one decode token and ~10 ms more per sequence, bench/NOTES.md "Agent sessions").
#
# Runs from the working tree (PYTHONPATH=src); needs torch, numpy, matplotlib; no server, no network.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/trace}
MODELS=${MODELS:-"llama-3.2-1b llama-3.1-8b"}
BACKEND=${BACKEND:-megakernel}
SCALE=${SCALE:-short}  # short: contexts ~2k-6k; long: ~16k-64k (the public agent traces' scale)
MAX_DURATION=${MAX_DURATION:-240}  # seconds per setup at most; requests still open then are reported as cut
PY=${PYTHON:-python3}
export PYTHONPATH=src
mkdir -p "$OUT"
commit=()
if [ -n "${COMMIT:-}" ]; then commit=(--commit "$COMMIT"); fi

for model in $MODELS; do
  if [ "$SCALE" = long ]; then
    trace="$OUT/agent-gpu-long-$model.jsonl"
    # the public agent traces' scale: 8 sessions of 8-10 turns, a 2k-token shared prefix, contexts growing from
    # ~16k to at most 64k tokens (tool outputs median 2k), think times median 2 s
    "$PY" -m mimw.bench.main trace-gen --out "$trace" --sessions 8 --min-turns 8 --max-turns 10 \
      --system-tokens 512 --tool-tokens 1536 --first-user-tokens 14336 --tool-output-tokens 2048 --output-tokens 32 \
      --max-context 65536 --subagent-prob 0.05 --subagent-turns 2 --think-s 2 --max-think-s 15 --ramp-s 5 \
      --block-size 64 --seed 0
  else
    trace="$OUT/agent-gpu-$model.jsonl"
    # 10 agent sessions of 10-12 turns: a 1k-token shared prefix, contexts growing from ~2k to at most 6k tokens,
    # heavy-tailed tool outputs (median 128 tokens) and think times (median 2 s), occasional sub-agents.
    "$PY" -m mimw.bench.main trace-gen --out "$trace" --sessions 10 --min-turns 10 --max-turns 12 \
      --system-tokens 256 --tool-tokens 768 --first-user-tokens 1024 --tool-output-tokens 128 --output-tokens 32 \
      --max-context 6144 --subagent-prob 0.05 --subagent-turns 2 --think-s 2 --max-think-s 15 --ramp-s 5 \
      --block-size 64 --seed 0
  fi
  "$PY" -m mimw.bench.main trace --trace "$trace" --model "$model" --backend "$BACKEND" --device cuda --dtype bfloat16 \
    --setups lru,session+host --working-set-ratio 4 --page-size 16 --max-batch 32 --max-step-tokens 2048 \
    --max-duration "$MAX_DURATION" --out "$OUT" "${commit[@]}"
done
