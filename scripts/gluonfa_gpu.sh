#!/usr/bin/env bash
# The Gluon paged prefill attention (src/mimw/prefill/gluon_attention.py) on a Hopper GPU in one call, from the
# working tree, under 9 minutes:
#   1. its GPU tests against the fp32 reference decoder (tests/prefill/test_prefill_gpu.py -k gluon: 4 shapes,
#      prompts 1/17/1000/4109 chunked, a cached prefix with several segments per call), cut at 200 s;
#   2. `mimw bench prefill` on the Llama-3.2-1B (hd 64) and Llama-3.1-8B (hd 128) shapes at 32k: TTFT of the
#      runner with attention gluon and triton beside the plain SDPA prefill; then attention alone for the last
#      16k-token pass of the 32k prompt (the bench's attention sweep: triton and gluon at their defaults, the
#      Triton kernel's other tiles, gluon with PINGPONG flipped; each output diffed against triton's), rows after
#      250 s skipped (killed at 300 s).
# $OUT (default bench/results) receives gluonfa-tests.log, gluonfa-bench.log and <stamp>-<gpu>-prefill.{json,md,png};
# the last lines printed are the tests' verdict and a short table.
#   COMMIT=<sha> bash scripts/gluonfa_gpu.sh      (COMMIT: recorded in the JSON; the GPU copy has no .git)
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=${OUT:-bench/results}
mkdir -p "$out"

timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/prefill/test_prefill_gpu.py -k gluon \
    > "$out/gluonfa-tests.log" 2>&1
tests_rc=$?
impls=plain-sdpa,triton,gluon
if [ "$tests_rc" = 124 ]; then  # a hang (a barrier never completing) would eat the bench's time too
    echo "gluon GPU tests timed out at 200 s: the bench runs without gluon" | tee -a "$out/gluonfa-tests.log"
    impls=plain-sdpa,triton
fi
timeout 300 python3 -m mimw.bench.main prefill --out "$out" --deadline-s 250 --model llama-3.2-1b,llama-3.1-8b \
    --lengths 32768 --impls "$impls" --chunk-sweep '' --no-engine --attention-lengths 32768 \
    ${COMMIT:+--commit "$COMMIT"} > "$out/gluonfa-bench.log" 2>&1
bench_rc=$?

grep -E "^(FAILED|ERROR)" "$out/gluonfa-tests.log" | head -20
grep -E "Error|error" "$out/gluonfa-bench.log" | grep -v "^\s*$" | head -5
echo "tests (rc $tests_rc): $(tail -n 1 "$out/gluonfa-tests.log")"
echo "bench (rc $bench_rc): $(ls "$out"/*-prefill.json 2>/dev/null | tail -n 1)"
python3 - "$out" <<'EOF'
import json, sys
from pathlib import Path
runs = sorted(Path(sys.argv[1]).glob("*-prefill.json"))
if not runs:
    sys.exit("no bench JSON: see gluonfa-bench.log")
doc = json.loads(runs[-1].read_text())
print(f"{doc['gpu']}, bf16 GEMM {doc['gemm_tflops']:.0f} TFLOP/s")
print(f"{'model':14s} {'attention alone, TFLOP/s (err vs triton)':58s} {'32k TTFT s: plain / triton / gluon'}")
for model in dict.fromkeys(r["model"] for r in doc["rows"]):
    alone = []
    for a in doc["attention"]:
        if a["model"] == model and a["impl"] in ("triton", "gluon"):
            tag = a["impl"] + ("-pingpong" if a["impl"] == "gluon" and (a.get("tiles") or [0])[-1] is True else "")
            val = f"{a['tflops']:.0f}" if a.get("tflops") else str(a.get("error"))[:20]
            err = f" ({a['err_vs_triton']:.0e})" if a.get("err_vs_triton") is not None and a["impl"] == "gluon" else ""
            alone.append(f"{tag} {val}{err}")
    ttft = {r["impl"]: r for r in doc["rows"] if r["model"] == model and r["tokens"] == 32768}
    cell = " / ".join(f"{ttft[i]['ttft_s']:.3f}" if ttft.get(i, {}).get("ttft_s") else "-"
                      for i in ("plain-sdpa", "triton", "gluon"))
    g = ttft.get("gluon", {})
    chk = f" (gluon rel_err {g['rel_err']:.1e})" if g.get("rel_err") is not None else ""
    print(f"{model:14s} {'; '.join(alone[:2] + [x for x in alone[2:] if x.startswith('gluon')]):58s} {cell}{chk}")
EOF
