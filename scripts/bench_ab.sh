#!/usr/bin/env bash
# A same-run A/B of the megakernel's decode step: a base source tree (BASE, e.g. `git archive <rev> src` unpacked
# into an ignored folder) against this tree's src, each benched with `mimw bench decode` (mimw-megakernel only) in
# turn, base then head, PASSES times, on the same GPU; a table of every cell's median ms and head/base ratio last.
#   BASE=.ab/old/src BASE_COMMIT=c0c2570 OUT=$OUT bash scripts/bench_ab.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
base=${BASE:?set BASE to the base tree src folder}
out=${OUT:-bench/results/ab}
head_commit=${HEAD_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
for pass in $(seq 1 "${PASSES:-2}"); do
    for tree in base head; do
        if [ "$tree" = base ]; then src=$base; commit=${BASE_COMMIT:-base}; else src=src; commit=$head_commit; fi
        PYTHONPATH=$src python3 -m mimw.bench.main decode --model "${MODELS:-llama-3.2-1b,llama-3.1-8b}" \
            --context "${CONTEXTS:-1024,8192}" --backends mimw-megakernel --backend-timeout 120 --commit "$commit" \
            --out "$out/$tree-$pass" > "$out-$tree-$pass.log" 2>&1 || echo "$tree pass $pass: exit $?"
    done
done
python3 - "$out" <<'PY'
import glob, json, os, sys
from collections import defaultdict
cells = defaultdict(dict)
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*-*", "*.json"))):
    tree_pass = os.path.basename(os.path.dirname(path))
    d = json.load(open(path))
    for r in d["results"]:
        if r["status"] == "ok":
            cells[(r["model"], r["context"])][tree_pass] = (r["ms_per_step"], r["ratio_to_floor"], d["read_TBps"])
print(f"{'model':14s} {'ctx':>5s} {'tree-pass':>9s} {'ms':>8s} {'x floor':>8s} {'read TB/s':>9s}")
for (model, ctx), runs in sorted(cells.items()):
    for k, (ms, ratio, bw) in sorted(runs.items()):
        print(f"{model:14s} {ctx:5d} {k:>9s} {ms:8.4f} {ratio:8.3f} {bw:9.2f}")
    base = [v[0] for k, v in runs.items() if k.startswith("base")]
    head = [v[0] for k, v in runs.items() if k.startswith("head")]
    if base and head:
        print(f"{model:14s} {ctx:5d} head/base {min(head) / min(base):.4f} (best of each), "
              f"{sum(head) / len(head) / (sum(base) / len(base)):.4f} (means)")
PY
