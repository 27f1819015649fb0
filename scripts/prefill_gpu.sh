#!/usr/bin/env bash
# The prefill path on a Hopper GPU in one call (under 8 minutes on an H200), from the working tree (nothing
# installed; torch 2.11 and triton 3.6 as on the GPU machine):
#   1. its GPU tests (tests/prefill/test_prefill_gpu.py: 4 shapes, prompts 1/17/1000/4109 at several chunk sizes,
#      a cached prefix with several segments per call, each attention; decode after prefill through the engine on
#      the megakernel; and the megakernel backend's own test), cut at 150 s;
#   2. `mimw bench prefill`: Llama-3.2-1B and Llama-3.1-8B shapes (random weights), prompts 2k/8k/32k/128k, mimw's
#      paged Triton attention, torch SDPA and FlexAttention over gathered pages, a plain PyTorch SDPA prefill, the
#      in-run GEMM roofline (MFU); then attention alone at several tiles, a chunk sweep and engine TTFT, rows after
#      250 s skipped (killed at 300 s).
# $OUT (default bench/results) receives prefill-tests.log, prefill-bench.log and <stamp>-<gpu>-prefill.{json,md,png};
# the last lines printed are the tests' verdict and the TTFT/MFU table.
#   COMMIT=<sha> bash scripts/prefill_gpu.sh      (COMMIT: recorded in the JSON; the GPU copy has no .git)
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=${OUT:-bench/results}
mkdir -p "$out"

timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/prefill/test_prefill_gpu.py \
    tests/engine/test_megakernel_backend_gpu.py > "$out/prefill-tests.log" 2>&1
tests_rc=$?

timeout 300 python3 -m mimw.bench.main prefill --out "$out" --deadline-s 250 ${COMMIT:+--commit "$COMMIT"} > "$out/prefill-bench.log" 2>&1
bench_rc=$?

grep -E "^(FAILED|ERROR)" "$out/prefill-tests.log" | head -20
echo "tests (rc $tests_rc): $(tail -n 1 "$out/prefill-tests.log")"
echo "bench (rc $bench_rc): $(ls "$out"/*-prefill.json 2>/dev/null | tail -n 1)"
python3 - "$out" <<'PY'
import json, sys
from pathlib import Path
from mimw.bench.prefill_report import summary
runs = sorted(Path(sys.argv[1]).glob("*-prefill.json"))
if not runs:
    sys.exit("no bench JSON: see prefill-bench.log")
doc = json.loads(runs[-1].read_text())
best = {}
for a in doc["attention"]:
    if a.get("tflops"):
        best.setdefault(a["model"], []).append(f"{a['impl']}{a.get('tiles') or ''} {a['tflops']:.0f}")
for model, cells in best.items():
    print(f"attention alone, {model}, TFLOP/s: " + "; ".join(cells))
print(f"bf16 GEMM {doc['gemm_tflops']:.0f} TFLOP/s on {doc['gpu']}")
print(summary(doc))
PY
