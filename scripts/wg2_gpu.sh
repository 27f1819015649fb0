#!/usr/bin/env bash
# The multi-token matvec with one wgmma a chunk pair (device/matvec_mt.py) on a Hopper GPU, from the working tree
# (~6 minutes on an H100 with the tests, ~2 without; with BASE_SRC ~8, never past 9.5):
#   1. correctness: tests/megakernel/test_batch_gpu.py's decode batches and verify blocks at every staged width
#      (MB = 8, 16, 32: wgmma N = 16, 32, 64) on the four shapes, the fp8 8B batch; 14 cases, cut at 240 s.
#      TESTS=all runs every `-k "decode_batches or verify"` case instead (100 cases, ~20 minutes: a call of its
#      own); TESTS=0 none (a baseline's timing run);
#   2. timing: tools/batch_step on the 1B and 8B shapes (random weights, context 1024), decode batches 1, 8, 16, 32
#      and a verify block of 16 (as query blocks and per token), of the source tree SRC (default src) and, where
#      BASE_SRC names another source tree (e.g. main's src copied beside this one), of that tree first, in the same
#      call (each run cut at 170 s; a cut run's cells measured so far are kept); a table of both and their
#      difference last, read from each run's log.
# $OUT (default bench/results/wg2) receives the logs and each tree's batch_step.json.
#   OUT=$OUT bash scripts/wg2_gpu.sh                          # this tree: tests, then its timings
#   TESTS=0 OUT=$OUT bash scripts/wg2_gpu.sh                  # timings only (run it on main for the baseline)
#   BASE_SRC=/path/to/main/src OUT=$OUT bash scripts/wg2_gpu.sh   # tests, then main's and this tree's timings
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
out=${OUT:-bench/results/wg2}
mkdir -p "$out"
src=${SRC:-src}
tests=${TESTS:-subset}

T=tests/megakernel/test_batch_gpu.py
dec=test_decode_batches_match_reference_over_16_steps
ver=test_verify_blocks_match_reference_over_8_steps
subset=("$T::$dec[smollm2-135m-5-17]" "$T::$dec[smollm2-135m-13-1000]" "$T::$dec[smollm2-135m-32-1000]"
        "$T::$dec[llama-3.2-1b-8-1000]" "$T::$dec[llama-3.2-1b-16-17]" "$T::$dec[llama-3.2-1b-32-1000]"
        "$T::$dec[llama-3.1-8b-16-1000]" "$T::$dec[qwen3-8b-13-1000]"
        "$T::$ver[smollm2-135m-4x3x1-ctx1000]" "$T::$ver[llama-3.2-1b-16-ctx1000]"
        "$T::$ver[llama-3.2-1b-20x1-padded-ctx1000]" "$T::$ver[llama-3.1-8b-16-ctx1000]"
        "$T::$ver[llama-3.1-8b-1x5x1x6-padded-ctx1000]"
        "$T::test_fp8_decode_batches_match_reference_over_the_same_fp8_cache[llama-3.1-8b-16]")
if [[ "$tests" == all ]]; then
    PYTHONPATH=$src timeout 1500 python3 -m pytest -q -p no:cacheprovider "$T" -k "decode_batches or verify" \
        > "$out/tests.log" 2>&1
    echo "tests (all; rc $?): $(tail -n 1 "$out/tests.log")"
elif [[ "$tests" != 0 ]]; then
    PYTHONPATH=$src timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider "${subset[@]}" \
        > "$out/tests.log" 2>&1
    echo "tests (${#subset[@]} cases; rc $?): $(tail -n 1 "$out/tests.log")"
    grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -n 20
fi

timing() {  # $1: the source tree, $2: its name (the folder of its log and JSON under $OUT)
    mkdir -p "$out/$2"
    PYTHONPATH=$1 OUT="$out/$2" timeout "${TIMING_TIMEOUT:-170}" python3 -m mimw.megakernel.tools.batch_step \
        --models llama-3.2-1b,llama-3.1-8b --batches 1,8,16,32 --verify 1x16 > "$out/$2/batch_step.log" 2>&1
    echo "batch_step $2 ($1; rc $?)"
}
if [[ -n "${BASE_SRC:-}" ]]; then
    timing "$BASE_SRC" base
fi
timing "$src" new

python3 - "$out" <<'EOF'
import os, re, sys

out = sys.argv[1]
def rows(name):
    """(device, {(model, step): ms}) from a run's log: every cell is printed as it is measured."""
    path = os.path.join(out, name, "batch_step.log")
    if not os.path.exists(path):
        return None, {}
    dev, cells = None, {}
    for line in open(path):
        if line.startswith("read bandwidth"):
            dev = line.split("(", 1)[1].rstrip(")\n")
        m = re.match(r"\[batch_step\] (\S+) default (B=\d+|verify \S+ \S+): ([\d.]+) ms", line)
        if m:
            step = f"decode {m.group(2)[2:]}" if m.group(2).startswith("B=") else m.group(2)
            cells[(m.group(1), step)] = float(m.group(3))
    return dev, cells

dev_b, base = rows("base")
dev_n, new = rows("new")
print(f"device: base {dev_b}, new {dev_n}")
print(f"{'model':14s} {'step':>24s} {'base ms':>8s} {'new ms':>8s} {'delta':>8s}")
order = lambda k: (k[0], k[1].startswith("verify"), int(k[1].split()[1]) if k[1][0] == "d" else 0, k[1])  # noqa: E731
for key in sorted(set(base) | set(new), key=order):
    b, n = base.get(key), new.get(key)
    d = f"{n - b:+8.3f}" if b is not None and n is not None else "       -"
    fmt = lambda v: f"{v:8.3f}" if v is not None else "       -"  # noqa: E731
    print(f"{key[0]:14s} {key[1]:>24s} {fmt(b)} {fmt(n)} {d}")
EOF
