#!/usr/bin/env bash
# A one-token step's ring walk on the tensor cores (Tuning.attn_mma, ops/attn_ring_mma.py) on a Hopper GPU, from the
# working tree (nothing installed); ~8 min on an H100, each part well inside one 10-minute device call:
#   hang    tools/hang.py with attn_mma=1 on small cases first (a deadlock shows as a report, not a hung call):
#           smollm2-135m at context 1000 over bf16 and fp8, the 1B at 40000 over fp8 for 2 launches
#   tests   tests/megakernel/test_kernel_gpu.py -k attn_mma: the kernel with attn_mma=1 against the reference over 64
#           steps (smollm2 17, 1B 1000 and 40000, 8B 8191 on 8 layers; bf16 and fp8)
#   bench   `mimw bench decode` A/B: the 1B at 8192 and 131072, fp8 and bf16, attn_mma 0 and 1; the 8B at 131072
#           bf16 with attn_mma=1 (its bf16 slot keeps the lanes' walk: the default kernel, a regression check); then
#           a table of ms, floor and x floor per row, and attn_mma 1 over 0
# Logs, the bench JSON and table.md go to $OUT (default bench/results/attn-mma-gpu).
#   bash scripts/attn_mma_gpu.sh                 # every part
#   PARTS=bench bash scripts/attn_mma_gpu.sh     # one part
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=${OUT:-bench/results/attn-mma-gpu}
mkdir -p "$out"
work=$(mktemp -d)
parts=" ${PARTS:-hang tests bench} "
status=()

if [[ "$parts" == *" hang "* ]]; then
    for case in "smollm2-135m 1000 bf16 1" "smollm2-135m 1000 fp8 1" "llama-3.2-1b 40000 fp8 2"; do
        set -- $case
        log="$out/hang-$1-$2-$3.log"
        timeout 120 python3 -m mimw.megakernel.tools.hang --model "$1" --context "$2" --kv-dtype "$3" --steps "$4" \
            --megakernel attn_mma=1 --timeout 20 > "$log" 2>&1
        status+=("hang $1 ctx $2 $3: exit $? ($(tail -n 1 "$log"))")
    done
fi
if [[ "$parts" == *" tests "* ]]; then
    timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider tests/megakernel/test_kernel_gpu.py \
        -k attn_mma > "$out/attn-mma-tests.log" 2>&1
    status+=("attn_mma GPU tests: exit $? ($(tail -n 1 "$out/attn-mma-tests.log"))")
fi
if [[ "$parts" == *" bench "* ]]; then
    run() {  # tag model contexts kv attn_mma timeout
        timeout "$6" python3 -m mimw.bench.main decode --model "$2" --context "$3" --backends mimw-megakernel \
            --kv-dtype "$4" --megakernel "attn_mma=$5" --budget-s 1 --iters 50 --out "$work/$1" \
            > "$out/bench-$1.log" 2>&1
        status+=("bench $1: exit $?")
        for f in "$work/$1"/*.json; do [[ -e "$f" ]] && cp "$f" "$out/bench-$1.json"; done
    }
    for kv in fp8 bf16; do
        for mma in 0 1; do
            run "1b-$kv-mma$mma" llama-3.2-1b 8192,131072 "$kv" "$mma" 100
        done
    done
    run "8b-bf16-mma1" llama-3.1-8b 131072 bf16 1 150
fi
printf '%s\n' "${status[@]}"
if [[ "$parts" == *" bench "* ]]; then  # the table last
    echo
    python3 - "$out" <<'EOF' | tee "$out/table.md"
import json, pathlib, sys
rows = {}
for f in sorted(pathlib.Path(sys.argv[1]).glob("bench-*.json")):
    tag = f.stem[len("bench-"):]  # e.g. 1b-fp8-mma1
    kv, mma = tag.split("-")[1], tag.split("-")[2]
    for r in json.loads(f.read_text()).get("results", []):
        rows[(r["model"], r["context"], kv, mma)] = r
print("| model | context | KV | attn_mma | ms | floor ms | x floor | mma1 / mma0 |")
print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
for (model, ctx, kv, mma), r in sorted(rows.items()):
    ms, base = r.get("ms_per_step"), rows.get((model, ctx, kv, "mma0"), {}).get("ms_per_step")
    speed = f"{base / ms:.2f}x" if mma == "mma1" and ms and base else ""
    fmt = lambda x, f: "" if x is None else format(x, f)  # noqa: E731
    print(f"| {model} | {ctx} | {kv} | {mma[-1]} | {fmt(ms, '.3f') or r.get('status')} "
          f"| {fmt(r.get('floor_ms'), '.3f')} | {fmt(r.get('ratio_to_floor'), '.2f')} | {speed} |")
EOF
fi
