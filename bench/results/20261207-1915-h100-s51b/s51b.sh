# s51b (main, and branch shortblk in .carry/sb): short verify blocks token by token (GPU tests); verify blocks vs
# per-token attention by block length (1B, 8B); #27 spec_steps if time is left
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=src
name=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$name"
(cd .carry/sb && timeout 110 python3 -m pytest -q -p no:cacheprovider -rfE tests/megakernel/test_batch_gpu.py -m gpu -k "(2x1x2 or 2x2x2x2 or 4x2x1) and (llama-3.2-1b or smollm2)" > $OUT/tests-sb.log 2>&1
 echo "sb tests rc $?: $(tail -n 1 $OUT/tests-sb.log)"; grep -E '^(FAILED|ERROR|E  )' $OUT/tests-sb.log | head -8)
timeout 170 python3 -m mimw.megakernel.tools.batch_step --models llama-3.2-1b,llama-3.1-8b --context 1024 --batches 1 --verify 1x2,1x4,1x8,1x16 > $OUT/verify.log 2>&1
echo "verify rc $?"; grep -E "verify|^model|^llama" $OUT/verify.log | grep -v "^\[batch_step\]" | tail -n 40
if [ $SECONDS -lt 250 ]; then
  timeout $((385 - SECONDS)) python3 -m mimw.bench.spec_steps --results bench/results/20261207-1735-cpu-spec-smollm2-135m-instruct-q4-1.json \
    --model llama-3.2-1b,llama-3.1-8b --backend megakernel --context 1024 --out $OUT > $OUT/spec-steps.log 2>&1
  echo "spec rc $?"; grep -E "spec_steps|\|" $OUT/spec-steps.log | cut -c1-400 | tail -20
fi
