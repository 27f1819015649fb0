#!/usr/bin/env bash
# A same-run A/B of the megakernel's decode step across source trees: each tree of TREES ("name=path ...", path a
# src folder, e.g. `git archive <rev> src` unpacked into an ignored folder) benched with `mimw bench decode`
# (mimw-megakernel only) in turn, PASSES times, on the same GPU; a table of every cell's median ms and each tree's
# ratio to the first tree's last. KV (bf16 or fp8, default bf16) is the cache's element type.
#   TREES="base=.ab/base/src head=src" OUT=$OUT bash scripts/bench_ab.sh
#   KV=fp8 CONTEXTS=32768,131072 MODELS=llama-3.2-1b TREES="base=.ab/base/src head=src" bash scripts/bench_ab.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
out=${OUT:-bench/results/ab}
mkdir -p "$out"
for pass in $(seq 1 "${PASSES:-2}"); do
    for tree in ${TREES:?set TREES to "name=path ..."}; do
        name=${tree%%=*}
        PYTHONPATH=${tree#*=} python3 -m mimw.bench.main decode --model "${MODELS:-llama-3.2-1b,llama-3.1-8b}" \
            --context "${CONTEXTS:-1024,8192}" --backends mimw-megakernel --kv-dtype "${KV:-bf16}" \
            --backend-timeout 120 --commit "$name" --iters "${ITERS:-100}" --budget-s "${BUDGET_S:-1}" \
            --out "$out/$name-$pass" > "$out/$name-$pass.log" 2>&1 \
            || echo "$name pass $pass: exit $?"
    done
done
python3 - "$out" ${TREES} <<'PY'
import glob, json, os, sys
from collections import defaultdict
out, names = sys.argv[1], [t.split("=")[0] for t in sys.argv[2:]]
cells = defaultdict(dict)
for path in sorted(glob.glob(os.path.join(out, "*-*", "*.json"))):
    tree_pass = os.path.basename(os.path.dirname(path))
    d = json.load(open(path))
    for r in d["results"]:
        if r["status"] == "ok":
            cells[(r["model"], r["context"])][tree_pass] = (r["ms_per_step"], r["ratio_to_floor"], d["read_TBps"])
print(f"{'model':14s} {'ctx':>5s} {'tree-pass':>12s} {'ms':>8s} {'x floor':>8s} {'read TB/s':>9s}")
for (model, ctx), runs in sorted(cells.items()):
    for k, (ms, ratio, bw) in sorted(runs.items()):
        print(f"{model:14s} {ctx:5d} {k:>12s} {ms:8.4f} {ratio:8.3f} {bw:9.2f}")
    best = {n: min(v[0] for k, v in runs.items() if k.rsplit("-", 1)[0] == n) for n in names
            if any(k.rsplit("-", 1)[0] == n for k in runs)}
    if names[0] in best:
        print(f"{model:14s} {ctx:5d} best of passes vs {names[0]}: " +
              ", ".join(f"{n} {best[n] / best[names[0]]:.4f}" for n in best))
PY
